"""Where a checkpoint region's host time goes: megatron's ``CheckpointWithoutOutput`` timed part by part.

    python benchmarks/bench_region.py model=moe size=h200 recompute=selective/moe_act
    python benchmarks/bench_region.py model=standard_attn size=h200 recompute=selective/layernorm

The elementwise labels (``moe_act``, ``layernorm``, ``gdn_norm_out``) checkpoint one small region each
with megatron's ``CheckpointWithoutOutput``: the region's first forward runs under no_grad and saves
the RNG states; its output's storage is freed; a grad hook on the next module's output replays the
region under enable_grad (RNG states forked and restored) and a nested ``torch.autograd.backward``
runs the region's backward. Each of those is host work the step pays where its host is behind the
GPU. This builds the worker's ``Trainer`` for the overrides, runs 3 steps, then ``--steps`` steps with
every part wrapped in a host timer (no synchronisation inside a step), and prints each part's host
microseconds a region, and the step's host ms (its own: less its waits for the GPU in ``Tensor.item``)
against the same steps with the option switched off (``benchmarks.paired_steps.switched_off``). A CPU runs it; its figures mean something on a GPU's
host.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time
from functools import partial, wraps

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import paired_steps  # noqa: E402  (a step's host and wall ms; the option switched off)

TIMES: dict[str, list[float]] = collections.defaultdict(list)
PHASE = ["on"]  # which steps a part's time belongs to: "on" (the option) or "off" (switched off)


def _timed(name: str, fn):
    @wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name].append(time.perf_counter() - start)
    return timed


def instrument() -> None:
    """Wrap each part of ``CheckpointWithoutOutput`` (megatron-core 0.19.2's tensor_parallel.random)."""
    from megatron.core.tensor_parallel import random as r

    cls, fn = r.CheckpointWithoutOutput, r.CheckpointWithoutOutputFunction
    plain_checkpoint = cls.checkpoint

    def checkpoint(self, run_function, *args):
        return plain_checkpoint(self, _timed("replayed function", run_function), *args)

    cls.checkpoint = _timed("checkpoint (first forward, no_grad, RNG states saved)", checkpoint)
    cls.discard_output_and_register_recompute = _timed("discard output, register hook",
                                                       cls.discard_output_and_register_recompute)
    cls._recompute = _timed("recompute hook (RNG fork, replay, share storage)", cls._recompute)
    fn.backward = staticmethod(_timed("region backward (nested autograd.backward)", fn.backward))
    r._get_all_rng_states = _timed("  get RNG states", r._get_all_rng_states)
    r._set_all_rng_states = _timed("  set RNG states", r._set_all_rng_states)
    plain_share = r._get_share_storage

    def share():
        return _timed("  share storage", plain_share())
    r._get_share_storage = share

    from recipes.build.experts import GroupedExperts
    plain_activation = GroupedExperts.activation

    def activation(self, *args):  # moe_act's region function, timed in both kinds of step
        import torch
        name = f"experts' activation, {'grad' if torch.is_grad_enabled() else 'no_grad'} ({PHASE[0]} steps)"
        return _timed(name, plain_activation)(self, *args)
    GroupedExperts.activation = activation


def step_host_ms(trainer, cuda: bool) -> tuple[float, float]:
    """(the host's own ms until step() returned, less its waits in ``Tensor.item``; the step's ms from
    a drained stream to its end), as ``bench_paired`` times a step (``paired_steps.timed_step``)."""
    host: list[float] = []
    ms = paired_steps.timed_step(trainer, cuda, host)
    return host[0], ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Everything else is a Hydra override, as train.py takes them.")
    parser.add_argument("--steps", type=int, default=6, help="timed steps each way (default 6)")
    args, overrides = parser.parse_known_args()

    from recipes.build.compat import cuda_available
    from recipes.config import compose_config
    from recipes.run.world import fresh_trainer, init_one_rank

    cfg = compose_config(overrides)
    init_one_rank(cfg)
    instrument()
    trainer, cuda = fresh_trainer(cfg), cuda_available()
    off = partial(paired_steps.switched_off, trainer)
    paired_steps.install_meters()  # this process measures and exits: never uninstalled
    for _ in range(3):
        step_host_ms(trainer, cuda)
        with off():
            step_host_ms(trainer, cuda)
    TIMES.clear()
    on, without = [], []
    for _ in range(args.steps):
        on.append(step_host_ms(trainer, cuda))
        with off():
            PHASE[0] = "off"
            without.append(step_host_ms(trainer, cuda))
            PHASE[0] = "on"
    trainer.close()
    regions = len(TIMES.get("discard output, register hook", [])) / args.steps
    print(f"{' '.join(overrides)}; {args.steps} steps each way; {regions:.0f} regions a step")
    print("| part | calls a step | host us a call (median) | host ms a step |\n|---|---|---|---|")
    for name, ts in TIMES.items():
        print(f"| {name} | {len(ts) / args.steps:.0f} | {statistics.median(ts) * 1e6:.1f} "
              f"| {sum(ts) * 1e3 / args.steps:.2f} |")
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    print(f"\nstep host ms: on {med(on, 0):.1f}, off {med(without, 0):.1f}, added {med(on, 0) - med(without, 0):+.1f}"
          f" ({(med(on, 0) - med(without, 0)) / max(regions, 1) * 1e3:.0f} us a region)")
    print(f"step ms:      on {med(on, 1):.1f}, off {med(without, 1):.1f}, added {med(on, 1) - med(without, 1):+.1f}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
