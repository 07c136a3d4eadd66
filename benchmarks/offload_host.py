"""Where the offload manager's host work shows in a step: the offload options ``bench_paired.py`` saved.

    python benchmarks/offload_host.py docs/offload-h200/paired_offload_2026-12-05/0510_moe ...

No run: it reads saved processes (``bench_paired.py --save``). For each offload option without
recompute whose pass measured the manager's host cost (``offload_ms``; older records lack it):

- ``margin ms``: the option's off steps' median of step time less the host's own time (its time to
  return, less its wait at the grad-norm read): how far the host led the GPU, plus the optimizer's
  GPU work left after the host returned; ``wait ms`` that wait alone, where the run recorded it
  (the margin ``recipes.predict.replay.Timeline.added`` prices against); ``timeline's
  lead ms`` how far the pass's timeline puts the GPU behind the host at its last mark;
- ``host added ms`` and ``added ms``: what the option added to the host's own time and to the step
  (bench_paired's medians), and their ratio, the share of the added host work the step paid;
- ``pass's price ms``: the same host work as the pass's synthetic measure prices it (a group's cost
  and each tensor's, ``recipes.measure.regions.offload_host_ms``, times the groups and tensors the
  option moves a step), which ``recipes.predict.copies.timeline_offload_costs`` inserts.

Then the share paid by family and margin, and the least squares of the host added on the groups and
tensors moved, against the synthetic measure's median rates.
"""

from __future__ import annotations

import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

#: A margin at least this (ms) left the host room to lead; below it the step is near host-bound.
WIDE_MS = 40.0


def moved(cfg: dict) -> tuple[int, int]:
    """Offload groups and tensors the option moves a step (its prediction's, every micro-batch)."""
    from recipes.predict.estimate import num_microbatches, predict

    terms = predict({**cfg, "offload": {**cfg["offload"], "emulate_on_cpu": False}}, "cuda")["host_terms_per_layer"]
    m = num_microbatches(cfg)
    return m * sum(len(t) for t in terms), m * sum(sum(t.values()) for t in terms)


def lead(marks: dict) -> float | None:
    """ms the pass's timeline has the GPU reach its last mark after the host issued it (None without one)."""
    from recipes.predict.replay import Timeline

    timeline = Timeline.of(marks)
    return None if timeline is None else timeline.finish() - timeline.host[-1]


def rows(dirs: list[str]) -> list[dict]:
    from benchmarks.paired_tables import saved
    from recipes.offload import modules_of

    out = []
    for d in dirs:
        for n, r in saved(d):
            cfg, raw = r["raw"]["cfg"], r["raw"]
            marks = raw["module_times"][0].get("marks")
            cost = marks.get("offload_ms") if isinstance(marks, dict) else None
            if not modules_of(cfg) or cfg["recompute"]["recompute_granularity"] or not cost or "off_host_ms" not in raw:
                continue
            groups, tensors = moved(cfg)
            out.append({"dir": os.path.basename(d), "process": n, "family": cfg["model"]["family"],
                        "option": r["option"], "groups": groups, "tensors": tensors,
                        "margin_ms": statistics.median(s - h for s, h in zip(raw["off_ms"], raw["off_host_ms"])),
                        "wait_ms": statistics.median(raw["off_wait_ms"]) if raw.get("off_wait_ms") else None,
                        "lead_ms": lead(marks),
                        "host_added_ms": r["host_added_ms"], "added_ms": r["added_ms"],
                        "pass_ms": groups * cost["group"] + tensors * cost["tensor"], "cost": cost})
    return out


def report(dirs: list[str]) -> list[str]:
    import numpy as np

    every = rows(dirs)
    lines = ["| run | process | model | option | margin ms | wait ms | timeline's lead ms | host added ms | added ms "
             "| added / host added | pass's price ms | host added / pass's |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in every:
        wait, ahead = ("-" if v is None else f"{v:.1f}" for v in (r["wait_ms"], r["lead_ms"]))
        lines.append(f"| {r['dir']} | {r['process']} | {r['family']} | {r['option']} | {r['margin_ms']:.1f} | {wait} | {ahead} "
                     f"| {r['host_added_ms']:+.1f} | {r['added_ms']:+.1f} | {r['added_ms'] / r['host_added_ms']:.2f} "
                     f"| {r['pass_ms']:.1f} | {r['host_added_ms'] / r['pass_ms']:.2f} |")
    lines += ["", "| model | margin | rows | added / host added: median (range) | host added / pass's price: median |",
              "|---|---|---|---|---|"]
    for family in sorted({r["family"] for r in every}):
        for name, wide in ((f"under {WIDE_MS:.0f} ms", False), (f"{WIDE_MS:.0f} ms or more", True)):
            these = [r for r in every if r["family"] == family and (r["margin_ms"] >= WIDE_MS) == wide]
            shares = [r["added_ms"] / r["host_added_ms"] for r in these]
            if shares:
                lines.append(f"| {family} | {name} | {len(shares)} | {statistics.median(shares):.2f} "
                             f"({min(shares):.2f}-{max(shares):.2f}) "
                             f"| {statistics.median(r['host_added_ms'] / r['pass_ms'] for r in these):.2f} |")
    a = np.array([[r["groups"], r["tensors"]] for r in every], dtype=float)
    y = np.array([r["host_added_ms"] for r in every])
    (group, tensor), *_ = np.linalg.lstsq(a, y, rcond=None)
    rms = float(np.sqrt(np.mean((a @ np.array([group, tensor]) - y) ** 2)))
    lines += ["", f"host added, least squares over {len(every)} rows: {group:.3f} ms a group + {tensor:.3f} ms a "
              f"tensor (rms {rms:.1f} ms); the pass's measure, median: "
              f"{statistics.median(r['cost']['group'] for r in every):.3f} ms a group + "
              f"{statistics.median(r['cost']['tensor'] for r in every):.3f} ms a tensor"]
    return lines


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    print("\n".join(report(sys.argv[1:])))
