"""Where a training step's host time goes: one step under torch's profiler with Python stacks.

    python benchmarks/bench_hostprofile.py model=moe size=h200
    python benchmarks/bench_hostprofile.py model=standard_attn size=h200

Builds the worker's ``Trainer`` for the Hydra overrides, runs 3 steps, then profiles one more (CPU
activity, and CUDA's where there is a GPU) and prints the host time of the top-level aten operators:
forward ones by the first megatron, recipes or torch.nn frame of their Python stack, backward ones by
the autograd node they ran under. The profiler's own recording inflates every figure; compare rows
within one run. A CPU is enough to run it; its figures mean something on the GPU's host.
"""
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from recipes.config import compose_config  # noqa: E402
from recipes.run.world import fresh_trainer, init_one_rank  # noqa: E402


def _top_level(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def _autograd_node(event) -> str | None:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("autograd::engine::evaluate_function"):
            return parent.name.split(": ", 1)[-1]
        parent = parent.cpu_parent
    return None


def main() -> None:
    cfg = compose_config(sys.argv[1:])
    init_one_rank(cfg)
    trainer = fresh_trainer(cfg)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(3):
        trainer.train_step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, with_stack=True,
                 experimental_config=torch._C._profiler._ExperimentalConfig(verbose=True)) as prof:
        trainer.train_step()
        sync()
    total, backward = [0, 0.0], collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type.name != "CPU" or not event.name.startswith("aten::") or not _top_level(event):
            continue
        total[0] += 1
        total[1] += event.cpu_time_total
        node = _autograd_node(event)
        if node:
            backward[node][0] += 1
            backward[node][1] += event.cpu_time_total
    print(f"top-level aten ops {total[0]}, their host time {total[1] / 1e3:.1f} ms")
    forward = collections.defaultdict(lambda: [0, 0.0])
    for avg in prof.key_averages(group_by_stack_n=8):
        if not avg.key.startswith("aten::") or not avg.stack:
            continue
        frames = [f for f in avg.stack if ("megatron" in f or "recipes" in f or "torch/nn" in f) and "profiler" not in f]
        where = frames[0].split("site-packages/")[-1] if frames else avg.stack[0]
        forward[where][0] += avg.count
        forward[where][1] += avg.self_cpu_time_total
    print("== forward (ops with a Python stack): self host ms by first frame")
    for where, (n, us) in sorted(forward.items(), key=lambda kv: -kv[1][1])[:45]:
        print(f"{us / 1e3:8.2f} ms {n:6d} ops  {where}")
    print("== backward: host ms by autograd node (top-level aten ops under it)")
    for where, (n, us) in sorted(backward.items(), key=lambda kv: -kv[1][1])[:35]:
        print(f"{us / 1e3:8.2f} ms {n:6d} ops  {where}")
    trainer.close()


if __name__ == "__main__":
    main()
