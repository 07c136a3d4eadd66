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
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from recipes.analyze.plan import explain_plan, fewest_block_layers, overrides_of, plan, without_measured_ooms
from recipes.analyze.predicted import advise_before_running, explain_prediction, recipe_budget
from recipes.analyze.report import NOISY_STEPS, control_gap_pct, find_results, merge_repeats, rank_rows
from recipes.errors import ConfigError
from recipes.files import GIB
from recipes.measure.profile import first_label_to_try, top_contributors
from recipes.offload import offload_config
from recipes.offload import option_of as offload_option_of
from recipes.predict.compare import recorded_shares
from recipes.predict.estimate import predict, predict_options
from recipes.predict.fit import with_slack
from recipes.recompute import NO_RECOMPUTE, is_full, recompute_config, recompute_order, selective_labels
from recipes.results import deciding_rank, first_sentence, recompute_of, worst_row

MIB = 2**20
#: Fragmentation is flagged when reserved - allocated is at least this fraction of reserved ...
FRAG_FRACTION = 0.10
#: ... and at least this many GiB (small gaps are the allocator's normal rounding).
FRAG_MIN_GIB = 0.5
#: Peaks closer than this are the same memory (the allocator rounds blocks; a label that saves only
#: this much saves nothing).
SAME_MEMORY_GIB = 0.05


def measured_candidates(sweep_dir: Path) -> list[dict]:
    """One candidate per point: its worst numbers over ranks and its deltas against the control."""
    rows = rank_rows(find_results(sweep_dir))
    points: dict[str, dict] = {}
    for r in rows:
        c = points.setdefault(r["run_dir"] or r["point"], {  # two points may share a name, not a directory
            "point": r["point"], "model": r["model"], "attention": r["attention"], "recompute": r["recompute"],
            "offload": r.get("offload") or "none", "status": r["point_status"] or r["status"], "source": "measured", "key": r["_key"],
            "family_key": r["_family_key"], "ranks": [], "error": r.get("error"),
        })
        c["ranks"].append({k: r.get(k) for k in ("rank", "status", "device", "peak_allocated_gib",
                                                  "peak_reserved_gib", "fragmentation_gib", "ledger_bytes")})
        if r["worst"] or r["rank"] is None:  # the worst rank's time and deltas speak for the point
            c.update({k: r.get(k) for k in ("step_ms", "step_noise", "step_spread", "control", "d_peak_gib", "d_peak_pct",
                                            "d_ledger_pct", "d_time_pct", "worst_rank", "gpu_ms", "gpu_spread",
                                            "d_gpu_pct") if r.get(k) is not None})
            c["worst_rank"] = r["rank"]
    for c in points.values():
        for key in ("peak_allocated_gib", "peak_reserved_gib", "ledger_bytes"):  # the worst over ranks
            values = [x[key] for x in c["ranks"] if x.get(key) is not None]
            c[key] = max(values) if values else None
    return list(points.values())


def _layout(result: dict) -> str:
    """The parallel layout a point ran, as the override that selects it: ``parallel=ep2``, or the
    sizes where they were set by hand (``parallel.tensor_model_parallel_size=2`` keeps ``single``)."""
    par = (result.get("config") or {}).get("parallel") or {}
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
            "context_parallel_size", "expert_model_parallel_size")
    choice = (result.get("choices") or {}).get("parallel") or "single"
    hand = [f"parallel.{k}={par[k]}" for k in keys if (par.get(k) or 1) > 1]
    return " ".join(hand) if choice == "single" and hand else f"parallel={choice}"


def _groups(results: list[dict]) -> dict[tuple, dict]:
    """One completed result per (model, attention, layout) of the sweep: the config to predict the
    recompute options from, without activation offload (a point without it where there is one; else an
    offload point's config with its offload off, as the predicted rows' commands run them)."""
    groups: dict[tuple, dict] = {}
    for r in sorted(results, key=lambda r: offload_option_of(r.get("config") or {}) != "none"):
        ch = r.get("choices") or {}
        if r.get("status") == "ok" and r.get("config"):
            groups.setdefault((ch.get("model"), ch.get("attention"), _layout(r)), r)
    return {key: _without_offload(r) for key, r in groups.items()}


def _without_offload(result: dict) -> dict:
    cfg = result["config"]
    if offload_option_of(cfg) == "none":
        return result
    off = offload_config("none")
    keys = ("fine_grained_activation_offloading", "offload_modules")
    return {**result, "config": {**cfg, "offload": {**cfg["offload"], **{k: off[k] for k in keys}}}}


def _is_gpu(device: str | None) -> bool:
    """A rank's recorded ``device`` (``torch.cuda.get_device_name()`` or ``cpu``) names a GPU."""
    return device not in (None, "cpu")


def _on_gpu(result: dict) -> bool:
    """Whether a run ran on GPUs: from its ranks' ``device``, whatever their status (a GPU sweep whose
    points all ran out of memory is still a GPU sweep); results without it, from allocator numbers."""
    ranks = result.get("ranks") or []
    return any(_is_gpu(r.get("device")) or r.get("memory") for r in ranks)


def predicted_candidates(sweep_dir: Path, budget_gib: float | None = None) -> list[dict]:
    """recipes.predict.estimate's rows for options of the sweep's families that it did not measure.

    ``source: "predicted"``: listed as worth measuring, never chosen. Memory is the predicted peak
    per rank with the allocator's slack (GPU sweeps, judged like the measured reserved peaks) or the
    predicted activation bytes (CPU sweeps, to match the ledger). With a budget, an unmeasured
    ``full/block`` on a GPU sweep is priced at the fewest layers that fit it."""

    results = find_results(sweep_dir)
    measured = {((r.get("choices") or {}).get("model"), (r.get("choices") or {}).get("attention"), _layout(r),
                 recompute_of(r)) for r in results if offload_option_of(r.get("config") or {}) == "none"}
    layouts = {_layout(r) for r in results}
    rows = []
    for (model, attention, layout), r in _groups(results).items():
        gpu = _on_gpu(r)
        try:
            done, _ = predict_options(r["config"], "cuda" if gpu else "cpu")
        except ConfigError:  # a family or feature the estimator does not model: nothing predicted
            continue
        # a sweep over layouts: each predicted row names the layout it prices (and runs it)
        where = {"parallel": layout} if len(layouts) > 1 else {}
        for option, p in done:
            if (model, attention, layout, option) in measured:
                continue
            extra = {}
            if option == "full/block" and gpu and budget_gib is not None:
                rc, p = fewest_block_layers(r["config"], recompute_config(option), budget_gib)
                extra = {"recompute_num_layers": rc["recompute_num_layers"]}
            # on a GPU sweep the measured points are judged on reserved: so are the predictions
            nbytes = with_slack(p["peak_bytes"], p["allocator_slack"]) if gpu else p["activation_bytes"]
            name = f"{model} {attention} {option}" + (f" {layout}" if where else "")
            rows.append({"point": name, "model": model, "attention": attention,
                         "recompute": option, "status": "predicted", "source": "predicted",
                         "memory_gib": nbytes / GIB, **where, **extra})
    return rows


def predicted_next_to_measured(sweep_dir: Path) -> list[dict]:
    """For each measured point: the estimator's prediction for its config beside the measurement.

    The prediction is of the worst rank's pipeline stage; under expert parallel at the routing that
    rank recorded (else balanced), as ``estimate --compare`` prices it, with the before-a-run bound
    for the worst EP rank (``estimate.moe_imbalance``) beside it. A point run in several processes is
    one row (``merge_repeats``: its highest peak)."""

    results = merge_repeats(find_results(sweep_dir))
    layouts = {_layout(r) for r in results}
    rows = []
    for r in results:
        if r.get("status") != "ok" or not r.get("config") or not r.get("ranks"):
            continue
        gpu = _on_gpu(r)
        device = "cuda" if gpu else "cpu"
        worst = worst_row(r)
        rank = next((x for x in r["ranks"] if x.get("rank") == worst.rank), {})
        try:
            ledger_share, peak_share = recorded_shares(r["config"], device, rank)
            stage = worst.coords.get("pp") if ledger_share else None
            p = predict(r["config"], device, stage=stage, routed_share=ledger_share or 1)
            peak = p if peak_share is None else predict(r["config"], device, stage=stage, routed_share=peak_share)
            bound = predict(r["config"], device) if p["routed_share"] is not None else None
        except ConfigError:
            continue
        name = r.get("name") + (f" {_layout(r)}" if len(layouts) > 1 else "")
        row = {"point": name, "predicted_ledger_bytes": p["activation_bytes"],
               "measured_ledger_bytes": worst.ledger_bytes}
        if gpu:
            row["predicted_peak_gib"] = peak["peak_bytes"] / GIB
            row["measured_peak_gib"] = worst.peak_allocated_gib
            if bound is not None:
                row["bound_peak_gib"] = bound["peak_bytes"] / GIB
                row["routing"] = "recorded" if ledger_share else "balanced"
        rows.append(row)
    return rows


def _gpu_points(results: list[dict]) -> list[dict]:
    return [r for r in results if r.get("status") == "ok" and r.get("config") and _on_gpu(r)]


def _base_point(ok: list[dict]) -> dict:
    """The point the others are priced against: no offload, the least recompute."""
    return min(ok, key=lambda r: (offload_option_of(r["config"]) != "none", recompute_order(recompute_of(r))))


def measured_rates(results: list[dict]) -> tuple[float | None, float | None, dict | None]:
    """What a GPU sweep measured for the planner: the model TFLOP/s per GPU its base point achieved
    (``_base_point``), the slowest host link an offload point recorded, and the module forward times
    the base point's deciding rank recorded (``measure.module_times``; each None when it has none).
    A point run in several processes (``measure.repeat``) counts as one: its processes' medians."""
    points = _gpu_points(results)
    links = [min(link["d2h_gb_s"], link["h2d_gb_s"]) for r in points for rank in r.get("ranks") or []
             if (link := (rank.get("offload") or {}).get("link")) and link.get("d2h_gb_s")]  # every process's
    ok = merge_repeats(points)
    if not ok:
        return None, (min(links) if links else None), None
    base = _base_point(ok)
    times = deciding_rank(base).get("module_times")
    return (worst_row(base).model_tflops_per_gpu, min(links) if links else None,
            times if times and "forward_ms" in times else None)


def sweep_plan(sweep_dir: Path, budget_gib: float) -> dict | None:
    """The planner (``recipes.analyze.plan``) on a GPU sweep's configuration, at the rate the sweep's
    no-recompute point achieved (model TFLOP/s per GPU) and the host link an offload point recorded;
    None for a CPU sweep or one without a completed point."""
    results = find_results(sweep_dir)
    ok = _gpu_points(results)
    if not ok:
        return None
    base = _base_point(ok)
    try:
        p = plan(base["config"], budget_gib, *measured_rates(ok))
    except ConfigError:
        return None
    oom = [r for r in results if r.get("status") == "oom" and r.get("config") and _on_gpu(r)]
    p = without_measured_ooms(p, {(recompute_of(r), offload_option_of(r["config"]),
                                   r["config"]["offload"]["activation_offload_fraction"]) for r in oom})
    p["measured"] = sorted({(recompute_of(r), offload_option_of(r["config"])) for r in ok + oom})
    choices = base.get("choices") or {}
    p["base"] = " ".join(f"{g}={choices[g]}" for g in ("model", "size", "attention", "parallel")
                         if choices.get(g) and not (g == "parallel" and choices[g] == "single"))
    return p


def what_drives_the_peak(sweep_dir: Path) -> dict | None:
    """The guide's first label from the control's peak attribution (recipes.measure.profile), if profiled."""

    for r in sorted(find_results(sweep_dir), key=lambda r: recompute_order(recompute_of(r))):
        if recompute_of(r) in NO_RECOMPUTE and r.get("status") == "ok":
            label, why = first_label_to_try(r)
            if label is None and why.startswith("no peak attribution"):
                continue
            return {"point": r.get("name"), "top": top_contributors(r), "label": label, "why": why}
    return None


def fragmentation(candidates: list[dict]) -> list[dict]:
    """Every rank whose reserved peak is well above its allocated peak (the guide's step 1)."""
    found = []
    for c in candidates:
        for r in c["ranks"]:
            alloc, reserved = r.get("peak_allocated_gib"), r.get("peak_reserved_gib")
            if alloc is None or reserved is None:
                continue
            gap = reserved - alloc
            if gap >= FRAG_MIN_GIB and gap >= FRAG_FRACTION * reserved:
                found.append({"point": c["point"], "recompute": c["recompute"], "rank": r["rank"],
                              "allocated_gib": alloc, "reserved_gib": reserved, "fragmentation_gib": gap,
                              "fraction_of_reserved": gap / reserved})
    return found


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
    gpu = any(_is_gpu(r.get("device")) or r.get("peak_allocated_gib") is not None
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


def _public(c: dict | None) -> dict | None:
    """The keys of a candidate that the JSON output carries."""
    keys = ("point", "model", "attention", "recompute", "offload", "status", "source", "memory_gib", "peak_allocated_gib",
            "peak_reserved_gib", "ledger_bytes", "step_ms", "step_noise", "step_spread", "control", "d_peak_gib",
            "d_peak_pct",
            "d_ledger_pct", "d_time_pct", "worst_rank", "fits", "error", "recompute_num_layers", "parallel", "gpu_ms",
            "gpu_spread", "d_gpu_pct")
    return None if c is None else {k: c.get(k) for k in keys if c.get(k) is not None}


def _name(c: dict, choice: dict) -> str:
    """The recompute label, or the whole point name where model or attention differ from the choice."""
    same = all(c.get(k) == choice.get(k) for k in ("model", "attention"))
    return c["recompute"] if same else c["point"]


def _mem(value_gib: float, gpu: bool) -> str:
    return f"{value_gib:.2f} GiB" if gpu else f"{value_gib * GIB / MIB:.2f} MiB"


def _delta(c: dict, gpu: bool) -> str:
    """``saves 2.10 GiB peak allocated (-12.0%), at +3.1% step time, against <control point>``."""
    if not c.get("control"):
        return "has no matched control to compare with (none ran, or it did not fit)"
    if gpu and c.get("d_peak_gib") is not None:
        verb = "saves" if c["d_peak_gib"] <= 0 else "adds"
        mem = f"{verb} {abs(c['d_peak_gib']):.2f} GiB peak allocated ({c['d_peak_pct']:+.1f}%)"
    elif c.get("d_ledger_pct") is not None:
        verb = "saves" if c["d_ledger_pct"] <= 0 else "adds"
        mem = f"{verb} {abs(c['d_ledger_pct']):.1f}% of the activation ledger"
    else:
        mem = "has no memory delta"
    time = f"{c['d_time_pct']:+.1f}% step time" if c.get("d_time_pct") is not None else "unmeasured step time"
    return f"{mem}, at {time}, against {c['control']}"


def explain(advice: dict, sweep_dir: str = "") -> str:
    """A few sentences a person reads, citing the measured numbers."""
    gpu, budget = advice["device"] == "gpu", advice["budget_gib"]
    lines = [f"Advice for {sweep_dir} (budget {_mem(budget, gpu)}; judged on {advice['basis']})."]
    if not gpu:
        lines.append("CPU results: there are no allocator peaks, so points are compared on the activation ledger "
                     "(bytes saved for backward in one micro-batch) and the budget applies to the ledger alone. "
                     "Weights, gradients and optimizer state are not in it: run the sweep on a GPU to check the fit.")
    frag = advice["fragmentation"]
    if frag:
        worst = max(frag, key=lambda f: f["fragmentation_gib"])
        lines.append(f"1. Fragmentation: {len(frag)} rank(s) reserve well above what they allocate; worst "
                     f"`{worst['point']}` rank {worst['rank']}: reserved {worst['reserved_gib']:.2f} GiB, allocated "
                     f"{worst['allocated_gib']:.2f} GiB ({worst['fragmentation_gib']:.2f} GiB, "
                     f"{worst['fraction_of_reserved']:.0%} of reserved, is cached but unused). Re-run with "
                     "measure.expandable_segments=true (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) before "
                     "paying for recompute: the allocated peak is the real pressure.")
    elif not gpu:
        lines.append("1. Fragmentation: not measurable without an allocator; the GPU sweep's report shows it.")
    else:
        lines.append(f"1. Fragmentation: none; reserved is within {FRAG_FRACTION:.0%} (or {FRAG_MIN_GIB} GiB) of "
                     "allocated on every rank, so the pressure is real allocation.")
    c = advice["choice"]
    if c:
        held = f" reserved ({c['peak_allocated_gib']:.2f} GiB allocated)" if gpu else " ledger"
        mem = _mem(c["memory_gib"], gpu) + held
        offload = c.get("offload", "none")
        if c["recompute"] in NO_RECOMPUTE and offload != "none":
            head = (f"2. Choice: activation offload (offload={offload}, recompute={c['recompute']}): `{c['point']}` "
                    f"at {mem}, within the budget")
            why = f"it {_delta(c, gpu)}."
        elif c["recompute"] in NO_RECOMPUTE:
            head = f"2. Choice: no recompute (recompute={c['recompute']}): `{c['point']}` fits at {mem}"
            why = "nothing needs replaying, so any recompute label would only add step time."
        elif offload != "none":
            head = f"2. Choice: recompute={c['recompute']} with offload={offload} (`{c['point']}`) at {mem}, within the budget"
            why = f"it {_delta(c, gpu)}."
        else:
            head = f"2. Choice: recompute={c['recompute']} (`{c['point']}`) at {mem}, within the budget"
            why = f"it {_delta(c, gpu)}."
        text = f"{head}; {why} Step time {c['step_ms']:.1f} ms."
        faster = advice["faster_not_fitting"]
        if faster:
            text += " Faster but over the budget: " + ", ".join(
                f"{_name(f, c)} ({_mem(f['memory_gib'], gpu)}, {f['step_ms']:.1f} ms)" for f in faster) + "."
        floor = advice.get("noise_floor_pct")
        ff = advice.get("faster_full")
        if ff and ff["resolved"]:
            text += (f" Chosen over {_name(ff['over'], c)}, which fits too ({_mem(ff['over']['memory_gib'], gpu)}, "
                     f"{ff['over']['step_ms']:.1f} ms): the guide tries selective labels before full recompute, "
                     f"but here {c['recompute']} measured {ff['lead_pct']:.1f}% faster for no more memory, "
                     f"beyond this sweep's noise floor ({floor:.1f}%).")
        for f in advice["full_fitting"] if c["recompute"] not in NO_RECOMPUTE else []:
            if ff and not ff["resolved"] and f["point"] == ff["full"]["point"]:
                text += (f" {_name(f, c)} also fits ({_mem(f['memory_gib'], gpu)}) and measured "
                         f"{ff['lead_pct']:.1f}% faster ({f['step_ms']:.1f} ms), which "
                         + (f"is within this sweep's noise floor ({floor:.1f}%)" if floor is not None else
                            "this sweep cannot tell from noise (no none/control pair or repeats)")
                         + ": repeat both (measure.repeat=0,1,2) before preferring it.")
            else:
                text += (f" {_name(f, c)} also fits ({_mem(f['memory_gib'], gpu)}) but {_delta(f, gpu)}: "
                         "full recompute stays the last resort.")
        for f in advice.get("superfluous") or []:
            text += (f" {_name(f, c)} measured faster ({f['step_ms']:.1f} ms) but recomputes everything "
                     f"{f['narrower']} does and more, for no less memory: its lead is noise between processes"
                     + (f" (the same computation measured up to {floor:.1f}% apart in separate processes "
                        "here)" if floor else "")
                     + ".")
        if floor is not None and c["recompute"] not in NO_RECOMPUTE and c.get("d_time_pct") is not None \
                and abs(c["d_time_pct"]) <= floor:
            text += f" Its step-time cost ({c['d_time_pct']:+.1f}%) is within this sweep's noise floor ({floor:.1f}%)"
            if c.get("d_gpu_pct") is not None:  # measure.gpu_time resolves what the wall time cannot
                text += (f"; the GPU's busy time, which the host's speed does not move, puts it at "
                         f"{c['d_gpu_pct']:+.1f}% (measure.gpu_time).")
            else:
                text += ": repeat the points to resolve it (measure.repeat=0,1,2)."
        if (c.get("step_noise") or 0) > NOISY_STEPS:
            text += (f" Caution: its median step is {c['step_noise']:.0%} slower than its fastest, so the time "
                     "comparison is contention, not recompute; re-run on an idle machine (rerun=true) "
                     "before trusting it.")
        lines.append(text)
    else:
        lines.append(_nothing_fits(advice, gpu))
    a = advice["attention"]
    if a:
        cost = f"; step time {a['d_time_pct']:+.1f}%" if a.get("d_time_pct") is not None else ""
        label = (f"the best selective label under {a['from']} "
                 f"({a['best_label']} saves {_mem(a['label_saving_gib'], gpu)}"
                 + (f", {a['label_d_time_pct']:+.1f}% step time)" if a.get("label_d_time_pct") is not None else ")")
                 if a["best_label"] else "any recompute label measured")
        lines.append(f"3. Attention: attention={a['to']} saves {_mem(a['saving_gib'], gpu)} against "
                     f"attention={a['from']} (both with recompute={a['control']}{cost}), more than {label}. "
                     "Change the backend before recomputing.")
    for c in advice["not_fitting"]:
        if c["status"] == "oom":
            lines.append(f"- `{c['point']}`: ran out of memory (counts as not fitting): {first_sentence(c.get('error'))}")
    for c in advice["not_measured"]:
        why = (c.get("error") or "").splitlines() or ["no rank recorded an error (a rank wrote no result)"]
        lines.append(f"- `{c['point']}`: {c['status']}, not a candidate: {why[0]}")
    for c in advice["predicted"]:
        mem = _mem(c.get("memory_gib") or 0, gpu) + (" with allocator slack" if gpu else "")
        fits = (c.get("memory_gib") or 0) <= advice["budget_gib"]
        lines.append(f"- `{c['point']}`" + (f" over {c['recompute_num_layers']} layers" if c.get("recompute_num_layers")
                                            else "")
                     + f": predicted, not measured ({mem}); "
                     + (f"predicted to fit: worth a run ({overrides_of(c)})." if fits else "predicted over the budget."))
    p = advice.get("plan")
    if p:
        lines += ["Predicted for the combinations this sweep did not run: " + line[0].lower() + line[1:]
                  if i == 0 else line for i, line in enumerate(
                      explain_plan(p, p.get("base", ""), frozenset(tuple(m) for m in p.get("measured", []))))]
    drives = advice.get("drives")
    if drives:
        first = f"try recompute={drives['label']} first" if drives["label"] else "recompute is not the lever"
        lines.append(f"What drives the peak (`{drives['point']}`): {drives['top'].strip()}. The guide: {first}; "
                     f"{drives['why']}")
    pairs = advice.get("predicted_vs_measured") or []
    if pairs:
        lines.append("Predicted (recipes.predict.estimate) next to measured, worst rank:")
        for row in pairs:
            ledger = (f"ledger {row['predicted_ledger_bytes'] / MIB:.1f} predicted / "
                      f"{(row['measured_ledger_bytes'] or 0) / MIB:.1f} measured MiB")
            peak = (f"; peak {row['predicted_peak_gib']:.2f} / {row['measured_peak_gib']:.2f} GiB"
                    if row.get("measured_peak_gib") is not None else "")
            if row.get("bound_peak_gib") is not None:
                peak += (f" (routed rows {row['routing']}; before a run the worst EP rank is bounded at "
                         f"{row['bound_peak_gib']:.2f} GiB)")
            lines.append(f"  {row['point']}: {ledger}{peak}")
    return "\n".join(lines)


def _nothing_fits(advice: dict, gpu: bool) -> str:
    near = advice["closest"]
    if near is None:
        return "2. Nothing was measured successfully: no point ran to completion (see the statuses below)."
    over = near["memory_gib"] - advice["budget_gib"]
    tries = []
    if not advice["full_measured"]:
        tries.append("recompute=full (the broadest memory effect, the largest replay cost)")
    defrag = advice["fits_if_defragmented"]
    if defrag:
        tries.append("measure.expandable_segments=true first: " + ", ".join(
            f"{c['recompute']} allocates {c['peak_allocated_gib']:.2f} GiB" for c in defrag)
            + ", within the budget, so it may fit once the allocator stops fragmenting")
    elif advice["fragmentation"]:
        tries.append("measure.expandable_segments=true (reserved is above allocated)")
    experts = "; expert parallel" if near.get("model") == "moe" else ""
    tries += ["more parallelism to split activations across GPUs (parallel.tensor_model_parallel_size=2 with "
              f"parallel.sequence_parallel=true; pipeline or context parallel{experts})",
              "a smaller train.micro_batch_size or train.seq_length",
              "activation offload (offload=<option>, conf/offload; `python -m recipes advise --predict` prices it "
              "against recompute)"]
    return (f"2. Nothing fits {_mem(advice['budget_gib'], gpu)}. Closest: recompute={near['recompute']} "
            f"(`{near['point']}`) at {_mem(near['memory_gib'], gpu)}, {_mem(over, gpu)} over. Next: "
            + "; ".join(tries) + ".")


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
    candidates = measured_candidates(args.sweep_dir) + predicted_candidates(args.sweep_dir, args.budget_gib)
    advice = advise(candidates, args.budget_gib)
    advice["sweep_dir"] = str(args.sweep_dir)
    advice["plan"] = sweep_plan(args.sweep_dir, args.budget_gib)
    advice["drives"] = what_drives_the_peak(args.sweep_dir)
    advice["predicted_vs_measured"] = predicted_next_to_measured(args.sweep_dir)
    advice["text"] = explain(advice, str(args.sweep_dir))
    print(json.dumps(advice, indent=2, default=str) if args.json else advice["text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
