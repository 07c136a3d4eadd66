"""Seconds per sweep point: the same 6-point sweep with each point started as its own process, and
forked from the fork server (``fork_server=true``, the default; launch/forkserver.py), end to end.

    python benchmarks/bench_points.py                    # size=tiny on this machine (a CPU is enough)
    python benchmarks/bench_points.py size=h200 --repeats 2
    python benchmarks/bench_points.py size=h200 --only forked   # the default's cost alone

Each variant is a fresh ``python train.py -m`` (controller, Hydra, the points, the report) in a fresh
sweep directory, run one after the other, alternating when repeated. Prints one row per sweep: its wall
time, and per point (the ``time:`` line's phases, recipes.run.console.time_breakdown) the mean wall, the
start and imports before the worker's ``main``, megatron's imports, and the rest.
"""

from __future__ import annotations

import argparse
import json
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
VARIANTS = {"own process": "fork_server=false", "forked": "fork_server=true"}


def run_sweep(overrides: list[str], flag: str, sweep_dir: Path) -> tuple[float, list[dict]]:
    cmd = [sys.executable, str(REPO / "train.py"), "-m", POINTS, "measure.profile=none", *overrides, flag,
           f"hydra.sweep.dir={sweep_dir}"]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    results = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/result.json"))]
    return wall, [time_breakdown(r) for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every point (default size=tiny)")
    parser.add_argument("--repeats", type=int, default=1, help="sweeps per variant, alternating")
    parser.add_argument("--only", choices=[name.split()[0] for name in VARIANTS],
                        help="run one variant: own (each point its own process) or forked")
    args = parser.parse_args()
    overrides = args.overrides or ["size=tiny"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, flag in VARIANTS.items():
                if args.only and not name.startswith(args.only):
                    continue
                wall, phases = run_sweep(overrides, flag, Path(tmp) / f"{repeat}_{flag.split('=')[1]}")
                mean = {k: statistics.mean(p.get(k, 0.0) for p in phases) for k in
                        ("wall", "start+imports", "megatron imports")}
                rows.append((name, wall, len(phases), mean))
                print(f"{name}: {wall:.1f} s for {len(phases)} points", file=sys.stderr, flush=True)
    print(f"6-point sweep ({POINTS}), {' '.join(overrides)}, profiling off\n")
    print("| points start | sweep wall s | points | point wall s (mean) | start+imports s | megatron imports s "
          "| rest of the point s |")
    print("|---|---|---|---|---|---|---|")
    for name, wall, n, mean in rows:
        rest = mean["wall"] - mean["start+imports"] - mean["megatron imports"]
        print(f"| {name} | {wall:.1f} | {n} | {mean['wall']:.2f} | {mean['start+imports']:.2f} | "
              f"{mean['megatron imports']:.2f} | {rest:.2f} |")


if __name__ == "__main__":
    main()
