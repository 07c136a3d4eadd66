"""Seconds per sweep point: the same 6-point sweep with each point started as its own process, and
forked from the fork server (``fork_server=true``, the default; launch/forkserver.py), end to end.

    python benchmarks/bench_points.py                    # size=tiny on this machine (a CPU is enough)
    python benchmarks/bench_points.py size=h200 --repeats 2
    python benchmarks/bench_points.py size=h200 --only forked   # the default's cost alone
    python benchmarks/bench_points.py size=h200 --only forked --points   # and each point's phases
    python benchmarks/bench_points.py size=h200 --only forked --points --empty-caches   # a first sweep's compiles

Each variant is a fresh ``python train.py -m`` (controller, Hydra, the points, the report) in a fresh
sweep directory, run one after the other, alternating when repeated. Prints one row per sweep: its wall
time, its fixed cost (the sweep's wall time less its points' steps after the first: the controller,
starts, imports, builds, first steps with their compiles, exits and the report), and per point (the
``time:`` line's phases, recipes.run.console.time_breakdown) the mean wall, the
start and imports before the worker's ``main``, megatron's imports, and the rest. ``--points`` adds
one row per point: its recompute label and where its time went (first step: build to the end of the
first step, where compiles happen; steps: the rest of the measured window; then the measurements after
the steps, and the exit: results, process group, the process's end). The sweep row also splits the
controller's own time: before the first point (Hydra, validation, the fork server's start is the first
point's), between points, after the last (the report).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from recipes.run.console import time_breakdown  # noqa: E402

POINTS = "recompute=none,control,selective/core_attn,selective/mlp,selective/layernorm,full"
#: A point's measurements after its timed steps (the GPU-time or profiled step, the control ledgers'
#: passes, the module-time pass): what the rest of a point's wall after the steps is not, is its exit.
AFTER_THE_STEPS = ("profile", "control ledgers", "module times")
VARIANTS = {"own process": "fork_server=false", "forked": "fork_server=true"}


def run_sweep(overrides: list[str], flag: str, sweep_dir: Path, empty_caches: bool) -> tuple[float, list[dict], dict]:
    cmd = [sys.executable, str(REPO / "train.py"), "-m", POINTS, "measure.profile=none", *overrides, flag,
           f"hydra.sweep.dir={sweep_dir}"]
    env = dict(os.environ)
    if empty_caches:  # what a machine's first sweep compiles (inductor's graphs, Triton's kernels)
        env.update(TORCHINDUCTOR_CACHE_DIR=str(sweep_dir.parent / f"{sweep_dir.name}_inductor"),
                   TRITON_CACHE_DIR=str(sweep_dir.parent / f"{sweep_dir.name}_triton"))
    started, start = time.time(), time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    results = sorted((json.loads(p.read_text()) for p in sweep_dir.glob("*/result.json")),
                     key=lambda r: r.get("launched") or 0.0)  # launch order
    spans = [(r["launched"], r["launched"] + r.get("wall_s", 0.0)) for r in results if r.get("launched")]
    outside = {  # the controller's own time: Hydra's start and composition, validation, the report
        "before the first point": spans[0][0] - started if spans else wall,
        "between points": sum(b[0] - a[1] for a, b in zip(spans, spans[1:])),
        "after the last point": started + wall - spans[-1][1] if spans else 0.0,
    }
    return wall, [dict(time_breakdown(r), label=r["choices"].get("recompute", "?")) for r in results], outside


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every point (default size=tiny)")
    parser.add_argument("--repeats", type=int, default=1, help="sweeps per variant, alternating")
    parser.add_argument("--empty-caches", action="store_true",
                        help="each sweep with empty inductor and Triton caches, as a machine's first")
    parser.add_argument("--points", action="store_true", help="also one row per point, in launch order")
    parser.add_argument("--only", choices=[name.split()[0] for name in VARIANTS],
                        help="run one variant: own (each point its own process) or forked")
    args = parser.parse_args()
    overrides = args.overrides or ["size=tiny"]
    rows, points = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, flag in VARIANTS.items():
                if args.only and not name.startswith(args.only):
                    continue
                wall, phases, outside = run_sweep(overrides, flag, Path(tmp) / f"{repeat}_{flag.split('=')[1]}",
                                         args.empty_caches)
                mean = {k: statistics.mean(p.get(k, 0.0) for p in phases) for k in
                        ("wall", "start+imports", "megatron imports")}
                mean["fixed"] = wall - sum(p.get("to the window end", 0.0) for p in phases)
                rows.append((name, wall, len(phases), mean, outside))
                points.extend((name, p) for p in phases)
                print(f"{name}: {wall:.1f} s for {len(phases)} points", file=sys.stderr, flush=True)
    caches = ", empty compile caches" if args.empty_caches else ""
    print(f"6-point sweep ({POINTS}), {' '.join(overrides)}, profiling off{caches}\n")
    print("| points start | sweep wall s | fixed cost s | points | point wall s (mean) | start+imports s "
          "| megatron imports s | rest of the point s | before the first point s | between points s "
          "| after the last point s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, wall, n, mean, outside in rows:
        rest = mean["wall"] - mean["start+imports"] - mean["megatron imports"]
        print(f"| {name} | {wall:.1f} | {mean['fixed']:.1f} | {n} | {mean['wall']:.2f} | {mean['start+imports']:.2f} | "
              f"{mean['megatron imports']:.2f} | {rest:.2f} | {outside['before the first point']:.1f} | "
              f"{outside['between points']:.1f} | {outside['after the last point']:.1f} |")
    if args.points:
        print("\n| points start | recompute | wall s | start+imports s | build s | first step s | steps s | "
              "measured after the steps s | exit s |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, p in points:
            head = sum(p.get(k, 0.0) for k in ("start+imports", "W&B init", "megatron imports", "device init",
                                               "process group", "parallel state"))
            after = sum(p.get(k, 0.0) for k in AFTER_THE_STEPS)
            before = head + p.get("build", 0.0) + p.get("first step", 0.0) + p.get("to the window end", 0.0)
            print(f"| {name} | {p['label']} | {p['wall']:.1f} | {head:.1f} | {p.get('build', 0.0):.1f} | "
                  f"{p.get('first step', 0.0):.1f} | {p.get('to the window end', 0.0):.1f} | {after:.1f} | "
                  f"{p['wall'] - before - after:.1f} |")


if __name__ == "__main__":
    main()
