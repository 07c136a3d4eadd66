"""``torch.compile`` of the transformer layers against eager: equal losses, and how much faster.

    python benchmarks/bench_compile.py model=standard_attn size=h200        # on a GPU
    python benchmarks/bench_compile.py model=moe size=h200 --steps 8
    python benchmarks/bench_compile.py model=standard_attn                  # size=tiny: a CPU smoke run

For each variant a fresh ``Trainer`` (the worker's, with the given Hydra overrides) from the same
seed runs ``--warmup`` steps (the compiled variant compiles here), then ``--steps`` timed ones. It
prints one row per variant: the median step time, its ratio to eager, whether every step's loss
equals eager's bit for bit and the largest difference, and the graph breaks dynamo recorded
(each a return to Python inside a layer, which keeps kernels from fusing across it), with the most
frequent reasons below the table.

Variants: ``eager``; ``compile`` (``torch.compile(layer.forward)`` for every ``TransformerLayer``,
the per-block compile torchtitan applies, default mode); on a GPU also ``cudagraphs``, megatron-core's
own per-layer CUDA graphs (``cuda_graph_impl="local"``, passed as ``+model.cuda_graph_impl=local``;
megatron captures them after ``cuda_graph_warmup_steps``, 3, so that variant warms up 2 steps more).
megatron-core's own fused helpers (``jit_fuser``: the fused SwiGLU) are compiled in all. A variant
that fails prints its error in its row. This is a benchmark: it changes no default; docs/speed.md says
what it measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

VARIANTS = ("eager", "compile", "cudagraphs")  # cudagraphs: on a GPU only


def compile_layers(chunks) -> int:
    """Compile every transformer layer's forward in place; returns how many."""
    count = 0
    for chunk in chunks:
        for module in chunk.modules():
            if type(module).__name__ == "TransformerLayer":
                module.forward = torch.compile(module.forward)
                count += 1
    return count


def run(cfg: dict, variant: str, warmup: int, steps: int) -> dict:
    from torch._dynamo.utils import counters

    from recipes.build.compat import seed_model_parallel_rng
    from recipes.run.worker import Trainer

    seed_model_parallel_rng(cfg["train"]["seed"])
    trainer = Trainer(cfg)
    counters.clear()
    layers = compile_layers(trainer.chunks) if variant == "compile" else 0
    cuda = torch.cuda.is_available()
    losses, times = [], []
    try:
        for i in range(warmup + steps):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = trainer.step()
            if cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - start)
            losses.append(float(loss))
    finally:
        trainer.close()
    breaks: Counter = Counter()
    for reason, n in counters["graph_break"].items():  # dynamo's reasons run over several lines
        breaks[" ".join(reason.split("\n")[:2]).strip()] += n
    return {"variant": variant, "layers": layers, "losses": losses, "step_ms": statistics.median(times) * 1e3,
            "breaks": breaks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (model=..., size=..., recompute=...)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    args = parser.parse_args()

    from launch.torchrun import free_port
    from recipes.config import compose_config
    from recipes.run.worker import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    cfg = compose_config(args.overrides)
    init_distributed(cfg)
    variants = VARIANTS if torch.cuda.is_available() else VARIANTS[:2]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (a smoke run: times mean nothing)"
    print(f"# {' '.join(args.overrides) or 'defaults'}; {device}; torch {torch.__version__}; "
          f"{args.warmup} warm-up + {args.steps} timed steps")
    rows = []
    for v in variants:
        try:
            if v == "cudagraphs":
                graphs = compose_config([*args.overrides, "+model.cuda_graph_impl=local"])
                rows.append(run(graphs, v, args.warmup + 2, args.steps))
            else:
                rows.append(run(cfg, v, args.warmup, args.steps))
        except Exception as err:  # a variant that cannot run here is a finding, not the end of the table
            rows.append({"variant": v, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"})
    eager = rows[0]
    print("\n| variant | layers compiled | step ms (median) | vs eager | losses equal to eager | largest loss difference | graph breaks |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | - | - | - | - | - | failed: {r['error']} |")
            continue
        diff = max(abs(a - b) for a, b in zip(r["losses"], eager["losses"]))
        print(f"| {r['variant']} | {r['layers']} | {r['step_ms']:.1f} | {r['step_ms'] / eager['step_ms']:.3f}x | "
              f"{r['losses'] == eager['losses']} | {diff:.3e} | {sum(r['breaks'].values())} |")
    for r in rows:
        for reason, n in r.get("breaks", Counter()).most_common(5):
            print(f"- {r['variant']}: {n} x {reason[:200]}")


if __name__ == "__main__":
    main()
