"""Training-step speed per family: tokens/s, model TFLOP/s, MFU, and what recompute costs.

For each family it runs three points, each a fresh worker process (``python train.py -m``):
no recompute, or, when that is predicted not to fit this GPU, the narrowest option predicted to
fit (``recipes.analyze.advise --predict``); the guide's label for the family; and full recompute. Then it
prints, per point: step time, tokens/s, model TFLOP/s and MFU against ``measure.peak_tflops``
(989, H200 bf16 dense), hardware TFLOP/s including the replayed forward work, the replay as a
fraction of the step's model FLOPs (the ideal overhead: full recompute replays one forward, about
+33%), and the measured step-time overhead against the first point.

    python benchmarks/bench_mfu.py --size h200 [--families standard_attn,moe] [-- extra overrides]
    make bench SIZE=h200
    python benchmarks/bench_mfu.py --results results/sweep_standard_attn results/sweep_moe
    python tools/evidence.py unpack h200 /tmp/h200 && python benchmarks/bench_mfu.py --results /tmp/h200/sweep_*

``--results`` runs nothing: it builds the same table from sweeps already measured (the label sweeps
hold every point it needs), taking the narrowest fitting option where ``none`` ran out of memory.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from recipes.analyze.sweep import find_results  # noqa: E402
from recipes.recompute import GUIDE_FIRST_LABEL  # noqa: E402  (after the repo is on sys.path)
from recipes.results import recompute_of, worst_row  # noqa: E402


def first_option(family: str, size: str, extra: list[str]) -> str:
    """``none``, or the narrowest option predicted to fit this GPU when ``none`` is not."""
    import torch

    if not torch.cuda.is_available():
        return "none"
    from recipes.analyze.predicted import advise_before_running

    budget = torch.cuda.get_device_properties(0).total_memory / 2**30 - 2.0  # context, NCCL
    advice = advise_before_running([f"model={family}", f"size={size}", *extra], budget)
    fits = {r["recompute"]: r["fits"] for r in advice["options"]}
    if fits.get("none", True) or advice["choice"] is None:
        return "none"
    return advice["choice"]["recompute"]


def by_option(family: str, results: list[dict]) -> dict[str, dict]:
    """This family's results by recompute option (a later result for the same option wins)."""
    return {recompute_of(r): r for r in results if r["choices"]["model"] == family}


def option_rows(family: str, options: list[str], results: list[dict]) -> list[dict]:
    """One table row per option (in order, once each), with this family's result for it, if any."""
    mine = by_option(family, results)
    return [{"family": family, "recompute": o, "result": mine.get(o)} for o in dict.fromkeys(options)]


def run_family(family: str, size: str, extra: list[str], out: Path) -> list[dict]:
    options = [first_option(family, size, extra), GUIDE_FIRST_LABEL[family], "full"]
    sweep_dir = out / family
    cmd = [sys.executable, str(REPO / "train.py"), "-m", f"model={family}", f"size={size}",
           "recompute=" + ",".join(dict.fromkeys(options)), "profile=none",
           f"hydra.sweep.dir={sweep_dir}", *extra]
    subprocess.run(cmd, cwd=REPO, check=False, capture_output=True)
    return option_rows(family, options, find_results(sweep_dir))


def first_measured(family: str, results: list[dict]) -> str:
    """``none``, or when it did not fit, the ok point with the largest peak (the narrowest fitting
    option)."""
    latest = by_option(family, results)
    ok = [r for r in latest.values() if r.get("status") == "ok"]
    if latest.get("none", {}).get("status") == "ok" or not ok:
        return "none"
    return recompute_of(max(ok, key=lambda r: worst_row(r).peak_allocated_gib))


def rows_from_results(dirs: list[Path]) -> list[dict]:
    """The table's rows from measured sweeps: per family none (or, when it did not fit, the ok
    point with the largest peak, i.e. the narrowest fitting option), the guide's label, full."""
    per_dir = [find_results(d) for d in dirs]
    sizes = {r["choices"].get("size") for results in per_dir for r in results}
    rows = []
    for results in per_dir:  # one sweep at a time: two sizes of a family are two blocks of rows
        for family in dict.fromkeys(r["choices"]["model"] for r in results):
            options = [first_measured(family, results), GUIDE_FIRST_LABEL[family], "full"]
            for row in option_rows(family, options, results):
                if len(sizes) > 1:
                    size = next((r["choices"].get("size") for r in results if r["choices"]["model"] == family), "")
                    row["family"] = f"{family} (size={size})"
                rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| family | recompute | status | step ms | tokens/s | model TFLOP/s | MFU | hardware TFLOP/s "
             "| replay (ideal overhead) | measured overhead |", "|" + "---|" * 10]
    base: dict[str, float] = {}
    for row in rows:
        r = row["result"]
        if not r or r.get("status") != "ok":
            lines.append(f"| {row['family']} | {row['recompute']} | {r.get('status') if r else 'missing'} |"
                         + " |" * 7)
            continue
        t = worst_row(r)
        base.setdefault(row["family"], t.step_time_s)
        mfu = f"{t.mfu:.1%}" if t.mfu is not None else "-"
        lines.append(
            f"| {row['family']} | {row['recompute']} | ok | {t.step_ms:.1f} | {t.tokens_per_s:.0f} "
            f"| {t.model_tflops_per_gpu:.1f} | {mfu} | {t.hardware_tflops_per_gpu:.1f} "
            f"| +{t.recompute_flops_fraction:.1%} | {t.step_time_s / base[row['family']] - 1:+.1%} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--families", default="standard_attn,mla,moe")
    parser.add_argument("--out", type=Path, default=REPO / "multirun" / "bench")
    parser.add_argument("--results", type=Path, nargs="+", help="measured sweep dirs: print their table, run nothing")
    parser.add_argument("extra", nargs="*", help="Hydra overrides applied to every point")
    args = parser.parse_args()
    if args.results:
        rows = rows_from_results(args.results)
        first = next((r["result"] for r in rows if r["result"] and r["result"]["ranks"]), None)
        where = f"{first['created'][:10]}, {first['ranks'][0]['device']}" if first else "no results"
        print(f"{where}, from {' '.join(map(str, args.results))} (measured earlier; nothing run now)")
        print(table(rows))
        return 0
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke run: times are not MFU)"
    start = time.time()
    rows = [row for family in args.families.split(",") for row in run_family(family, args.size, args.extra, args.out)]
    print(f"{time.strftime('%Y-%m-%d')}, {device}, size={args.size} {' '.join(args.extra)}, "
          f"{time.time() - start:.0f} s")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
