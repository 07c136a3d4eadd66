"""``train.deterministic`` checked: each selective label against ``none`` in one process, and the table
of benchmarks/gpu_determinism.sh.

    python benchmarks/determinism.py labels [--families F,...] OUT.json [overrides...]
    python benchmarks/determinism.py table OUT_DIR                    # the script's table from its runs

``labels``: in one process (one rank), for each family a ``Trainer`` (the worker's) from the same seed
computes one step's gradients (every micro-batch, no update) under ``recompute=none`` and then under
each selective label the family has; every parameter's gradient (megatron's fp32 ``main_grad`` on a
GPU) and the loss must equal none's bit for bit, and the label's checkpoint regions must have run.
``table``: reads the straight sweep (``OUT_DIR/straight``), the kill -9 and resume runs
(``OUT_DIR/resume_<family>``) and ``OUT_DIR/labels.json``, and prints one row a family: whether two
straight runs (with and without ``train.deterministic``) are bit-identical in every step's loss and grad
norm, whether the resumed run equals the straight one from its first step, whether every label equals
none, and the step time with and without (the median of each run's measured window, averaged over its
runs). It also writes ``OUT_DIR/table.md`` and ``OUT_DIR/table.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FAMILIES = ("standard_attn", "mla", "moe")
#: Labels whose replay sums a gradient's terms in another order (the norm's input also feeds the residual:
#: tests/test_recompute_exact.py's test_layernorm_recompute_reorders_one_gradient_sum): equal to none's to
#: rounding, deterministic or not. The table names them apart from the bit-identical ones.
REORDERED = ("layernorm",)


def family_labels(cfg: dict) -> list[str]:
    """The selective options of one label that apply to this model (shared_experts only with shared experts)."""
    from recipes.recompute import LABELS, options_for, selective_labels

    out = []
    for option in options_for(cfg["model"]):
        labels = selective_labels(option)
        if labels and len(labels) == 1 and LABELS[next(iter(labels))].applies(cfg["model"]):
            out.append(option)
    return out


def step_gradients(cfg: dict) -> tuple[float, dict, dict]:
    """(loss, {parameter: gradient}, checkpoint counts) of one step from the seed, no update."""
    import torch

    from recipes.run.world import fresh_trainer

    trainer = fresh_trainer(cfg)
    try:
        loss = trainer.compute_gradients(record_ledger=False)
        grads = {}
        for i, chunk in enumerate(trainer.chunks):
            for name, p in chunk.named_parameters():
                g = getattr(p, "main_grad", None)
                g = p.grad if g is None else g
                if g is not None:
                    grads[f"{i}.{name}"] = g.detach().clone()
        return loss, grads, trainer.counter.as_dict()
    finally:
        trainer.close()
        del trainer
        import gc

        gc.collect()  # the next family's model in the same memory
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def labels_main(out: Path, overrides: list[str], families: list[str]) -> None:
    import torch

    from recipes.config import compose_config
    from recipes.run.world import init_one_rank
    from recipes.validate import validate

    rows: dict[str, dict] = {}
    world = False
    for family in families:
        base = [f"model={family}", "train.deterministic=true", *overrides]
        cfg = compose_config([*base, "recompute=none"])
        validate(cfg)
        if not world:
            init_one_rank(cfg)
            world = True
        loss0, grads0, _ = step_gradients(cfg)
        again, grads_again, _ = step_gradients(cfg)  # none twice in one process: the baseline's own repeat
        rows[family] = {"none_again": loss0 == again and _equal(grads0, grads_again)[0], "labels": {}}
        del grads_again
        for option in family_labels(cfg):
            label_cfg = compose_config([*base, f"recompute={option}"])
            validate(label_cfg)
            loss, grads, counts = step_gradients(label_cfg)
            same, first_diff = _equal(grads0, grads)
            worst = 0.0 if same else _worst_relative(grads0, grads)
            ran = sum(c.get("recompute", 0) for c in counts.values())
            rows[family]["labels"][option.split("/", 1)[1]] = {
                "loss_equal": loss == loss0, "grads_equal": same, "first_differing": first_diff,
                "max_relative_difference": worst, "replayed_regions": ran, "parameters": len(grads0)}
            print(f"{family} {option}: loss {'=' if loss == loss0 else '!='} none, gradients "
                  f"{'equal' if same else f'differ ({first_diff} first; worst {worst:.1e} of the largest)'}, "
                  f"{ran} regions replayed", flush=True)
            del grads
        del grads0
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out.write_text(json.dumps(rows, indent=1))


def _equal(a: dict, b: dict) -> tuple[bool, str | None]:
    import torch

    if a.keys() != b.keys():
        return False, "parameter names"
    for name in a:
        if not torch.equal(a[name], b[name]):
            return False, name
    return True, None


def _worst_relative(a: dict, b: dict) -> float:
    """The largest |a - b| of any parameter, over that parameter's largest |a| (0 where equal)."""
    worst = 0.0
    for name in a.keys() & b.keys():
        scale = float(a[name].abs().max()) or 1.0
        worst = max(worst, float((a[name].float() - b[name].float()).abs().max()) / scale)
    return worst


def _rank(path: Path) -> dict | None:
    """Rank 0 of a result.json (a one-rank run), or None."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ranks = result.get("ranks") or []
    return {**ranks[0], "config": result.get("config") or {}, "status": result.get("status")} if ranks else None


def _first_difference(a: list, b: list, offset: int = 0) -> int | None:
    """The first step (1-based, from ``offset``) where two per-step lists differ, or None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return offset + i + 1
    return None if len(a) == len(b) else offset + min(len(a), len(b)) + 1


def _straight(runs: list[dict]) -> str:
    if len(runs) < 2:
        return f"missing ({len(runs)} run)"
    a, b = runs[0], runs[1]
    step = _first_difference([*a["loss"], *a["grad_norm"]], [*b["loss"], *b["grad_norm"]])
    n = len(a["loss"])
    if step is None:
        return f"bit-identical ({n} steps)"
    where = step if step <= n else step - n
    return f"differs from step {where}" + (" (grad norm)" if step > n else "")


def table_main(out_dir: Path) -> None:
    straight: dict[tuple[str, bool], list[dict]] = {}
    for path in sorted((out_dir / "straight").glob("*/result.json")):
        rank = _rank(path)
        if rank is None or rank.get("status") != "ok":
            print(f"skipped {path}: {rank and rank.get('status')}", file=sys.stderr)
            continue
        cfg = rank["config"]
        key = (cfg["model"]["family"], bool(cfg["train"].get("deterministic")))
        straight.setdefault(key, []).append(rank)
    labels = json.loads((out_dir / "labels.json").read_text()) if (out_dir / "labels.json").exists() else {}
    families = [f for f in FAMILIES if any(k[0] == f for k in straight) or f in labels]
    rows = []
    for family in families:
        det, plain = straight.get((family, True), []), straight.get((family, False), [])
        row = {"family": family, "straight twice": _straight(det), "default, twice": _straight(plain)}
        resumed = _rank(out_dir / f"resume_{family}" / "result.json")
        if not det:
            row["kill -9 and resume"] = "no straight run"
        elif resumed is None or "resumed_from" not in resumed:
            row["kill -9 and resume"] = "not resumed (the kill came after the run ended?)" if resumed else "missing"
        else:
            first = resumed["first_step"]
            ref = det[0]
            step = _first_difference([*resumed["loss"], *resumed["grad_norm"]],
                                     [*ref["loss"][first - 1:], *ref["grad_norm"][first - 1:]], first - 1)
            span = f"steps {first}-{first + len(resumed['loss']) - 1}, resumed from {resumed['resumed_from']['step']}"
            row["kill -9 and resume"] = f"bit-identical ({span})" if step is None else f"differs ({span})"
        fam = labels.get(family)
        if fam is None:
            row["label vs none"] = "missing"
        else:
            exact = [l for l, r in fam["labels"].items() if r["loss_equal"] and r["grads_equal"]]
            parts = [f"bit-identical {len(exact)}/{len(fam['labels'])}" + (f" ({', '.join(exact)})" if exact else "")]
            for label, r in fam["labels"].items():
                if label not in exact:
                    known = " (a reordered sum, expected)" if label in REORDERED else ""
                    parts.append(f"{label}: loss {'equal' if r['loss_equal'] else 'differs'}, gradients within "
                                 f"{r['max_relative_difference']:.1e}{known}")
            idle = [l for l, r in fam["labels"].items() if not r["replayed_regions"]]
            if idle:
                parts.append(f"replayed nothing: {', '.join(idle)}")
            if not fam.get("none_again", True):
                parts.append("none twice in one process differs")
            row["label vs none"] = "; ".join(parts)
        times = {d: [r["timing"]["step_time_s"] for r in runs if r.get("timing")] for d, runs in
                 (("det", det), ("plain", plain))}
        if times["det"] and times["plain"]:
            t_det, t_plain = statistics.mean(times["det"]) * 1e3, statistics.mean(times["plain"]) * 1e3
            row["step time"] = f"{t_det:.1f} ms vs {t_plain:.1f} ms ({t_det / t_plain - 1:+.1%})"
        else:
            row["step time"] = "missing"
        rows.append(row)
    columns = ["family", "straight twice", "kill -9 and resume", "label vs none", "step time", "default, twice"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r[c] for c in columns) + " |" for r in rows]
    text = "\n".join(lines)
    print(text)
    (out_dir / "table.md").write_text(text + "\n")
    (out_dir / "table.json").write_text(json.dumps({"rows": rows, "labels": labels}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    lab = sub.add_parser("labels", help="each selective label against none, one process")
    lab.add_argument("out", type=Path)
    lab.add_argument("overrides", nargs="*")
    lab.add_argument("--families", default=",".join(FAMILIES))
    tab = sub.add_parser("table", help="the table of benchmarks/gpu_determinism.sh")
    tab.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    if args.command == "labels":
        labels_main(args.out, args.overrides, args.families.split(","))
    else:
        table_main(args.out_dir)


if __name__ == "__main__":
    main()
