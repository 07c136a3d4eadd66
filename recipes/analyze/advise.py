"""The guide's procedure applied to a measured sweep: which recompute choice to use for a budget.

    python -m recipes advise multirun/moe/defaults --budget-gib 80          # text for a person
    python -m recipes advise multirun/moe/defaults --budget-gib 80 --json   # JSON for a script
    python -m recipes advise --budget-gib 40 --predict model=moe size=h200  # before any run (predicted)

In the guide's order: (1) is the pressure real allocation or allocator fragmentation (reserved well
above allocated on some rank)? (2) among points whose every rank fits the budget, the one with the
least step time, preferring no recompute, then selective labels, and full recompute only when
nothing narrower fits; (3) whether an attention-backend change saves more than a recompute label;
(4) when nothing fits, the closest point and what to try next.

A GPU point fits when its highest peak *reserved* across ranks is within the budget (reserved is
what the process holds from the device; it excludes the CUDA context and NCCL buffers, so keep some
headroom). A CPU sweep has no allocator peaks: points are then compared on the activation ledger
(bytes saved for backward in one micro-batch) and the budget is applied to the ledger alone, which
leaves out weights, gradients and optimizer state: a ranking to confirm with a GPU sweep.

The points it weighs come from ``recipes.analyze.candidates``, and ``recipes.analyze.explain`` says the
advice in words.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from recipes.analyze.candidates import (
    fragmentation,
    is_gpu,
    measured_candidates,
    predicted_candidates,
    predicted_next_to_measured,
    sweep_plan,
    what_drives_the_peak,
)
from recipes.analyze.confirm import compare, explain_confirm
from recipes.analyze.explain import explain
from recipes.analyze.predicted import advise_before_running, explain_prediction, recipe_budget
from recipes.analyze.report import control_gap_pct
from recipes.analyze.sweep import find_results
from recipes.errors import ConfigError
from recipes.files import GIB
from recipes.recompute import NO_RECOMPUTE, is_full, recompute_order, selective_labels

#: Peaks closer than this are the same memory (the allocator rounds blocks; a label that saves only
#: this much saves nothing).
SAME_MEMORY_GIB = 0.05


def _memory(c: dict, gpu: bool) -> float | None:
    """What fit is judged on, in GiB: highest peak reserved (GPU), else the ledger (CPU)."""
    if gpu:
        return c.get("peak_reserved_gib") if c.get("peak_reserved_gib") is not None else c.get("peak_allocated_gib")
    return c["ledger_bytes"] / GIB if c.get("ledger_bytes") is not None else None


def superfluous(fitting: list[dict]) -> dict[str, dict]:
    """Points that recompute a strict superset of another fitting point's labels, in the same config,
    for no less memory (point -> that narrower point). Their extra replay cannot make a step faster,
    so a lead in step time is between-process noise: they are never the choice.
    E.g. gdn_norm_out-core_attn under SDPA, where core_attn saves nothing."""
    out = {}
    for c in fitting:
        mine = selective_labels(c["recompute"])
        if not mine:
            continue
        for d in fitting:
            theirs = selective_labels(d["recompute"])
            if (theirs is not None and d is not c and d["key"] == c["key"] and theirs < mine
                    and d.get("offload", "none") == c.get("offload", "none")
                    and c["memory_gib"] >= d["memory_gib"] - SAME_MEMORY_GIB):
                out[c["point"]] = d
                break
    return out


def noise_floor_pct(candidates: list[dict]) -> float | None:
    """How far the same computation measured apart in separate processes, in percent: ``control``
    against ``none``, and each repeated point's spread over its processes (``measure.repeat``). The
    sweep's own noise floor for step-time differences (the largest)."""
    gaps = [100.0 * c["step_spread"] for c in candidates if c.get("step_spread") is not None]
    control = control_gap_pct(candidates)
    gaps += [control] if control is not None else []
    return max(gaps) if gaps else None


def _pick(fitting: list[dict]) -> dict | None:
    """No recompute (nor offload) first, then selective labels and activation offload, full recompute
    last; least step time within the class (offload competes with the labels on measured time)."""
    for allowed in (lambda c: c["recompute"] in NO_RECOMPUTE and c.get("offload", "none") == "none",
                    lambda c: not is_full(c["recompute"]),
                    lambda c: True):
        pool = [c for c in fitting if allowed(c) and c.get("step_ms") is not None]
        if pool:
            return min(pool, key=lambda c: (c["step_ms"], recompute_order(c["recompute"])))
    return None


def _faster_full(choice: dict | None, fitting: list[dict], floor: float | None) -> dict | None:
    """A full-recompute point (e.g. ``full/block`` over a few layers) that fits in no more memory than a
    selective choice and measured faster: the guide puts full recompute last because it usually
    replays most, but a partial block can replay less than a wide label (H200, GDN: full/block over
    4 of 8 layers +12% against mlp's +27%, same memory). ``resolved`` when the lead exceeds the
    sweep's noise floor; then it becomes the choice."""
    if not choice or choice["recompute"] in NO_RECOMPUTE or is_full(choice["recompute"]):
        return None
    rivals = [f for f in fitting if is_full(f["recompute"]) and f.get("step_ms") is not None
              and f["key"] == choice["key"] and f["step_ms"] < choice["step_ms"]
              and f["memory_gib"] <= choice["memory_gib"] + SAME_MEMORY_GIB]
    best = min(rivals, key=lambda f: f["step_ms"], default=None)
    if best is None:
        return None
    lead = (choice["step_ms"] / best["step_ms"] - 1) * 100
    return {"full": best, "over": choice, "lead_pct": lead, "resolved": floor is not None and lead > floor}


def _attention_finding(measured: list[dict], gpu: bool) -> dict | None:
    """Does switching attention backend save more memory than the best selective label does?"""
    best = None
    for base in [c for c in measured if c["recompute"] in NO_RECOMPUTE]:
        others = [c for c in measured if c["family_key"] == base["family_key"] and c["attention"] != base["attention"]
                  and c["recompute"] == base["recompute"]]
        labels = [c for c in measured if c["key"] == base["key"] and c["recompute"] not in NO_RECOMPUTE
                  and not is_full(c["recompute"])]  # selective labels
        for alt in others:
            saving = _memory(base, gpu) - _memory(alt, gpu)
            top = max(labels, key=lambda c: _memory(base, gpu) - _memory(c, gpu), default=None)
            label_saving = _memory(base, gpu) - _memory(top, gpu) if top else 0.0
            if saving > label_saving and saving > 0 and (best is None or saving > best["saving_gib"]):
                best = {"from": base["attention"], "to": alt["attention"], "control": base["recompute"],
                        "saving_gib": saving, "d_time_pct": (alt["step_ms"] / base["step_ms"] - 1) * 100
                        if alt.get("step_ms") and base.get("step_ms") else None,
                        "best_label": top["recompute"] if top else None, "label_saving_gib": label_saving,
                        "label_d_time_pct": top.get("d_time_pct") if top else None}
    return best


def advise(candidates: list[dict], budget_gib: float) -> dict:
    """The advice as data (what ``--json`` prints); ``explain`` turns it into text."""
    measured = [c for c in candidates if c["source"] == "measured"]
    gpu = any(is_gpu(r.get("device")) or r.get("peak_allocated_gib") is not None
              for c in measured for r in c["ranks"])
    ok = [c for c in measured if c["status"] == "ok" and _memory(c, gpu) is not None]
    for c in ok:
        c["memory_gib"] = _memory(c, gpu)
        c["fits"] = c["memory_gib"] <= budget_gib
    fitting = [c for c in ok if c["fits"]]
    extra = superfluous(fitting)
    choice = _pick([c for c in fitting if c["point"] not in extra])
    floor = noise_floor_pct(measured)
    faster_full = _faster_full(choice, fitting, floor)
    if faster_full and faster_full["resolved"]:
        choice = faster_full["full"]
    closest = None if choice else min(ok, key=lambda c: c["memory_gib"], default=None)
    slim = _public
    return {
        "budget_gib": budget_gib,
        "basis": "peak_reserved_gib (highest over ranks)" if gpu else "ledger_bytes (CPU: no allocator peaks)",
        "device": "gpu" if gpu else "cpu",
        "fragmentation": fragmentation(ok + [c for c in measured if c["status"] == "oom"]) if gpu else [],
        "choice": slim(choice),
        "closest": slim(closest),
        "noise_floor_pct": floor,
        "faster_full": faster_full and {"full": slim(faster_full["full"]), "over": slim(faster_full["over"]),
                                        "lead_pct": faster_full["lead_pct"], "resolved": faster_full["resolved"]},
        "superfluous": [{**slim(c), "narrower": extra[c["point"]]["recompute"]} for c in fitting
                        if c["point"] in extra and choice and c.get("step_ms") is not None
                        and c["step_ms"] < choice["step_ms"]],
        "faster_not_fitting": [slim(c) for c in ok if choice and not c["fits"] and c["step_ms"] < choice["step_ms"]],
        "full_fitting": [slim(c) for c in fitting if is_full(c["recompute"]) and c is not choice],
        "attention": _attention_finding(ok, gpu),
        "not_fitting": [slim(c) for c in measured if c["status"] == "oom"] + [slim(c) for c in ok if not c["fits"]],
        "not_measured": [slim(c) for c in measured if c["status"] not in ("ok", "oom")],
        "predicted": [slim(c) for c in candidates if c["source"] == "predicted"],
        "full_measured": any(is_full(c["recompute"]) for c in ok),
        "fits_if_defragmented": [_public(c) for c in ok if gpu and not c["fits"]
                                 and (c.get("peak_allocated_gib") or budget_gib + 1) <= budget_gib],
    }


def family_groups(candidates: list[dict]) -> list[tuple[str, list[dict]]]:
    """The candidates split by what the sweep fixed besides recompute, offload and attention (the
    model, its size, the layout...), each with a label saying which: a choice is per family, so a
    model x recompute sweep gets one answer per model. A sweep of one family is one unlabelled group.
    Predicted rows go with the first group of their model and attention."""
    measured = [c for c in candidates if c["source"] == "measured"]
    keys = list(dict.fromkeys(c["family_key"] for c in measured))
    if len(keys) <= 1:
        return [("", candidates)]
    members = {k: [c for c in measured if c["family_key"] == k] for k in keys}
    labels = _group_labels(keys, members)
    groups, placed = [], set()
    for key in keys:
        pairs = {(c["model"], c["attention"]) for c in members[key]}
        predicted = [c for c in candidates if c["source"] == "predicted" and id(c) not in placed
                     and (c["model"], c["attention"]) in pairs]
        placed |= {id(c) for c in predicted}
        groups.append((labels[key], members[key] + predicted))
    return groups


def _group_labels(keys: list[str], members: dict[str, list[dict]]) -> dict[str, str]:
    """Each group's name: its model choice where that tells the groups apart, else the settings that
    differ between them (at most three)."""
    models = {k: sorted({str(c["model"]) for c in members[k]}) for k in keys}
    if len({tuple(m) for m in models.values()}) == len(keys):
        return {k: "model=" + ",".join(models[k]) for k in keys}

    def leaves(tree, prefix: str = "") -> dict:
        if not isinstance(tree, dict):
            return {prefix: tree}
        return {k: v for key, sub in tree.items() for k, v in leaves(sub, f"{prefix}{key}.").items()}

    flat = {k: {leaf.rstrip("."): v for leaf, v in leaves(json.loads(k)).items()} for k in keys}
    differ = [leaf for leaf in flat[keys[0]] if len({json.dumps(flat[k].get(leaf)) for k in keys}) > 1]
    return {k: " ".join([f"model={','.join(models[k])}"] + [f"{leaf}={flat[k].get(leaf)}" for leaf in differ[:3]])
            for k in keys}


def _public(c: dict | None) -> dict | None:
    """The keys of a candidate that the JSON output carries."""
    keys = ("point", "model", "attention", "recompute", "offload", "status", "source", "memory_gib", "peak_allocated_gib",
            "peak_reserved_gib", "ledger_bytes", "step_ms", "step_noise", "step_spread", "control", "d_peak_gib",
            "d_peak_pct",
            "d_ledger_pct", "d_time_pct", "worst_rank", "fits", "error", "recompute_num_layers", "parallel", "gpu_ms",
            "gpu_spread", "d_gpu_pct")
    return None if c is None else {k: c.get(k) for k in keys if c.get(k) is not None}


def positive_budget(text: str) -> float:
    """argparse type: a positive number of GiB."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--budget-gib must be a number of GiB, got {text!r} (e.g. --budget-gib 80)") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"--budget-gib must be a positive number of GiB, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, nargs="?", help="a multirun/... sweep directory")
    parser.add_argument("--budget-gib", type=positive_budget, default=None,
                        help="memory per GPU that PyTorch's allocator may reserve, GiB: the GPU's capacity less what "
                             "CUDA and its libraries hold outside it (2.4 GiB on the H200: use 137 there). CPU "
                             "sweeps: applied to the activation ledger. Required, except with --predict "
                             "recipe=<name>, where it defaults to the recipe's GPU (H100 77, H200 137)")
    parser.add_argument("--json", action="store_true", help="print JSON for a script instead of text")
    parser.add_argument("--predict", nargs="+", metavar="OVERRIDE",
                        help="before any run: rank the options by predicted memory for these Hydra "
                        "overrides (e.g. --predict model=moe size=h200)")
    args = parser.parse_args(argv)
    if args.predict:
        try:
            budget = args.budget_gib or recipe_budget(args.predict)
            if budget is None:
                parser.error("--budget-gib is required (it defaults to the GPU of a recipe=<name> only)")
            advice = advise_before_running(args.predict, budget)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(json.dumps(advice, indent=2) if args.json else explain_prediction(advice))
        return 0
    if args.budget_gib is None:
        parser.error("--budget-gib is required for a sweep")
    if args.sweep_dir is None:
        parser.error("give a sweep directory, or --predict OVERRIDE... to rank options before any run")
    if not args.sweep_dir.is_dir():
        print(f"error: {args.sweep_dir} is not a directory (give a multirun/<sweep>/<overrides> path)", file=sys.stderr)
        return 2
    if not find_results(args.sweep_dir):
        print(f"error: no result.json under {args.sweep_dir}: run a sweep first (python train.py -m sweep=moe)",
              file=sys.stderr)
        return 2
    try:  # a sweep `python -m recipes plan` wrote: its predicted order beside the measured one
        confirmed = compare(args.sweep_dir)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    candidates = measured_candidates(args.sweep_dir) + predicted_candidates(args.sweep_dir, args.budget_gib)
    groups = family_groups(candidates)
    if len(groups) > 1:  # e.g. a plan's top three at several micro-batch sizes: the plan still compares them all
        return _advise_groups(args.sweep_dir, groups, args.budget_gib, args.json, confirmed)
    advice = advise(candidates, args.budget_gib)
    advice["sweep_dir"] = str(args.sweep_dir)
    advice["plan"] = sweep_plan(args.sweep_dir, args.budget_gib)
    advice["drives"] = what_drives_the_peak(args.sweep_dir)
    advice["predicted_vs_measured"] = predicted_next_to_measured(args.sweep_dir)
    advice["confirm"] = confirmed
    advice["text"] = "\n".join([explain(advice, str(args.sweep_dir)), *explain_confirm(advice["confirm"])])
    print(json.dumps(advice, indent=2, default=str) if args.json else advice["text"])
    return 0


def _advise_groups(sweep_dir: Path, groups: list[tuple[str, list[dict]]], budget_gib: float, as_json: bool,
                   confirmed: dict | None = None) -> int:
    """One answer per family of a sweep (``family_groups``). The planner's predictions price one base
    point, so they are left to ``--predict`` with each family's overrides; a plan's comparison
    (``confirmed``) spans the families, so it follows them once."""
    pairs = predicted_next_to_measured(sweep_dir)
    drives = what_drives_the_peak(sweep_dir)
    out = []
    for label, members in groups:
        advice = advise(members, budget_gib)
        names = {c["point"] for c in members}
        advice.update(group=label, sweep_dir=str(sweep_dir),
                      drives=drives if drives and drives["point"] in names else None,
                      predicted_vs_measured=[p for p in pairs if any(p["point"].startswith(n) for n in names)])
        advice["text"] = explain(advice, f"{sweep_dir} [{label}]")
        out.append(advice)
    head = (f"This sweep holds {len(groups)} families ({'; '.join(label for label, _ in groups)}): each is advised "
            "on its own points. For the planner's prediction of one: python -m recipes advise --budget-gib "
            f"{budget_gib:g} --predict <its overrides>.")
    if as_json:
        print(json.dumps({"sweep_dir": str(sweep_dir), "budget_gib": budget_gib, "groups": out, "confirm": confirmed},
                         indent=2, default=str))
    else:
        print("\n\n".join([head] + [a["text"] for a in out] + ["\n".join(explain_confirm(confirmed))] * bool(confirmed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
