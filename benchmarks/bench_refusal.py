"""How long a refused run takes to answer: the median of N fresh ``python train.py`` processes, wall and
CPU time, with what each loaded (a refusal should load neither torch nor megatron-core).

    python benchmarks/bench_refusal.py                       # train.py recompute=selective/moe_act, 9 runs
    python benchmarks/bench_refusal.py -n 5 model.vocab_size=256
    python benchmarks/bench_refusal.py --baseline            # also `python -c pass` and `import hydra`

Wall time moves with the machine's load; user+system CPU time much less, so both are printed.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def timed(command: list[str], cwd: Path) -> tuple[float, float, int, str]:
    """(wall s, user+sys CPU s, exit code, stderr's first line) of one fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.returncode, (done.stderr.strip().splitlines() or [""])[0]


def row(name: str, command: list[str], n: int, cwd: Path) -> str:
    runs = [timed(command, cwd) for _ in range(n)]
    walls, cpus = [r[0] for r in runs], [r[1] for r in runs]
    codes = sorted({r[2] for r in runs})
    return (f"| {name} | {n} | {statistics.median(walls):.2f} | {min(walls):.2f} | {statistics.median(cpus):.2f} "
            f"| {','.join(map(str, codes))} | {runs[-1][3][:90]} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", default=["recompute=selective/moe_act"])
    parser.add_argument("-n", type=int, default=9, help="fresh processes per row (default 9)")
    parser.add_argument("--baseline", action="store_true", help="also time Python's start and importing Hydra")
    args = parser.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:  # a refusal writes nothing; the run directory is thrown away
        train = [py, str(REPO / "train.py"), *args.overrides, f"output_dir={tmp}/run"]
        print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores\n")
        print("| command | n | wall median s | wall min s | CPU median s | exit | first line |\n"
              "|---|---|---|---|---|---|---|")
        if args.baseline:
            print(row("python -c pass", [py, "-c", "pass"], args.n, REPO))
            print(row("import hydra", [py, "-c", "import hydra.main"], args.n, REPO))
        print(row("train.py " + " ".join(args.overrides), train, args.n, REPO))


if __name__ == "__main__":
    main()
