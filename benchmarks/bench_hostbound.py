"""Is a training step bound by the host or by the GPU? One row per fresh process.

    python benchmarks/bench_hostbound.py --processes 6                       # model=moe size=h200
    python benchmarks/bench_hostbound.py --processes 2 model=standard_attn size=h200

Each process builds the worker's ``Trainer`` for the overrides (``model=moe size=h200`` unless they
name a model or size), runs 3 untimed steps, then 6 timed ones, and reports the medians of:

- ``step ms``: the step, from its start to the GPU's end (synchronized);
- ``host blocked ms``: the time the host waited inside the step for the GPU (``Tensor.item``: megatron
  reads the grad norm once a step). Near 0 means the host never got ahead: it bounds the step;
- ``host work ms``: step minus blocked minus the wait after ``step()`` returned (the optimizer's
  kernels finishing): what the host took to issue the step;
- ``device ms``: the GPU's kernel and copy time of one more step under torch's profiler (CUDA activity
  only, so the host is not slowed by recording its own calls).

A step is GPU-bound when the host blocks for a good part of it, host-bound when it does not; comparing
processes says whether a slower process had a slower host or a slower GPU. A GPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def measure(overrides: list[str]) -> dict:
    import torch

    from recipes.config import compose_config
    from recipes.measure.syncs import ItemWaits
    from recipes.run.world import fresh_trainer, init_one_rank

    cfg = compose_config(defaults(overrides))
    init_one_rank(cfg)
    trainer = fresh_trainer(cfg)
    try:
        with ItemWaits() as blocked:
            for _ in range(3):
                trainer.step()
            torch.cuda.synchronize()
            steps, waits, tails = [], [], []
            for _ in range(6):
                blocked.seconds = 0.0
                start = time.perf_counter()
                trainer.step()
                issued = time.perf_counter()
                torch.cuda.synchronize()
                steps.append(time.perf_counter() - start)
                waits.append(blocked.seconds)
                tails.append(time.perf_counter() - issued)
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                trainer.step()
                torch.cuda.synchronize()
            device = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
    finally:
        trainer.close()
    host = statistics.median(s - w - t for s, w, t in zip(steps, waits, tails))
    return {"step_ms": statistics.median(steps) * 1e3, "blocked_ms": statistics.median(waits) * 1e3,
            "host_ms": host * 1e3, "device_ms": device * 1e3}


def defaults(overrides: list[str]) -> list[str]:
    out = [] if any(o.startswith("model=") for o in overrides) else ["model=moe"]
    out += [] if any(o.startswith("size=") for o in overrides) else ["size=h200"]
    return out + ["profile=none", *overrides]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Everything else is a Hydra override, as train.py takes them.")
    parser.add_argument("--processes", type=int, default=4, help="fresh processes, one after another (default 4)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: measure, print JSON
    args, overrides = parser.parse_known_args()
    if args.one:
        print("RESULT " + json.dumps(measure(overrides)), flush=True)
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_hostbound.py needs a GPU: it times the host against the GPU's kernels")
    print(f"{' '.join(defaults(overrides))}, {args.processes} processes, {torch.cuda.get_device_name()}\n")
    print("| process | step ms | host blocked ms | host work ms | device ms | bound by |")
    print("|---|---|---|---|---|---|")
    for n in range(args.processes):
        done = subprocess.run([sys.executable, __file__, "--one", *overrides], cwd=REPO, capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"| {n} | failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]} | | | | |")
            continue
        r = json.loads(line[len("RESULT "):])
        bound = "host" if r["blocked_ms"] < 0.1 * r["step_ms"] else "GPU"
        print(f"| {n} | {r['step_ms']:.1f} | {r['blocked_ms']:.1f} | {r['host_ms']:.1f} | {r['device_ms']:.1f} | {bound} |",
              flush=True)


if __name__ == "__main__":
    main()
