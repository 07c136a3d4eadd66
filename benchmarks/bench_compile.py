"""``torch.compile`` of the transformer layers against eager: equal losses, and how much faster.

    python benchmarks/bench_compile.py model=standard_attn size=h200        # on a GPU
    python benchmarks/bench_compile.py model=moe size=h200 --steps 8
    python benchmarks/bench_compile.py model=standard_attn                  # size=tiny: a CPU smoke run

Each variant runs in a fresh process (a device-side assert in one, as the compiled MoE layer hit on
the H200, poisons that process's CUDA context and no other): a ``Trainer`` (the worker's, with the
given Hydra overrides) from the same seed runs ``--warmup`` steps (the compiled variant compiles here), then ``--steps`` timed ones. It
prints one row per variant: the median step time, its ratio to eager, whether every step's loss
equals eager's bit for bit and the largest difference, and the graph breaks dynamo recorded
(each a return to Python inside a layer, which keeps kernels from fusing across it), with the most
frequent reasons below the table.

Variants: ``eager``; ``compile`` (``model.compile=layer``: ``torch.compile(layer.forward)`` for every
``TransformerLayer``, the per-block compile torchtitan applies, default mode); on a GPU also ``compile
attention`` (``model.compile=attention``: each layer's ``self_attention`` only, the MoE layer's grouped
experts stay eager), ``cudagraphs``, megatron-core's
own per-layer CUDA graphs (``cuda_graph_impl="local"``, passed as ``+model.cuda_graph_impl=local``, with
the graph-safe RNG tracker they need; megatron captures them after ``cuda_graph_warmup_steps``, 3, so
that variant warms up 2 steps more), and ``eager again`` (eager in another process: how far two eager
runs' losses differ where kernels are not deterministic). Each row has the process's peak allocated
memory; ``--logs DIR`` keeps each variant's output (a failed one's traceback).
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
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

VARIANTS = ("eager", "compile", "compile attention", "cudagraphs", "eager again")  # after the first two: a GPU only


#: The ``model.compile`` scope each compiled variant builds with (recipes.build.model.compile_layers).
SCOPES = {"compile": "layer", "compile attention": "attention"}


def run(cfg: dict, variant: str, warmup: int, steps: int) -> dict:
    from torch._dynamo.utils import counters

    from recipes.run.world import fresh_trainer

    trainer = fresh_trainer(cfg)  # graph-safe generators where cfg builds megatron's local CUDA graphs
    counters.clear()
    layers = sum(type(m).__name__ == "TransformerLayer" for c in trainer.chunks for m in c.modules()) \
        if variant in SCOPES else 0
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
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"variant": variant, "layers": layers, "losses": losses, "step_ms": statistics.median(times) * 1e3,
            "peak_gib": peak, "breaks": breaks}


def run_variant(overrides: list[str], variant: str, warmup: int, steps: int) -> dict:
    """One variant in this process (``--variant``): a row, or the error it ended with."""
    from recipes.config import compose_config
    from recipes.run.world import init_one_rank

    try:
        if variant == "cudagraphs":
            cfg = compose_config([*overrides, "+model.cuda_graph_impl=local"])
            warmup += 2
        else:  # no validation: the benchmark also runs what train.py refuses (a compiled MoE layer)
            cfg = compose_config([*overrides, *([f"model.compile={SCOPES[variant]}"] if variant in SCOPES else [])])
        init_one_rank(cfg)
        row = run(cfg, variant, warmup, steps)
        row["breaks"] = dict(row["breaks"])
        return row
    except Exception as err:  # a variant that cannot run here is a finding, not the end of the table
        import traceback

        traceback.print_exc()  # into the variant's log (--logs)
        return {"variant": variant, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}


def in_own_process(overrides: list[str], variant: str, warmup: int, steps: int, logs: str | None = None) -> dict:
    """``run_variant`` in a fresh process; a process that dies (a device-side assert) is a failed row.
    With ``logs``, the process's output goes to ``logs/<variant>.log``."""
    import json
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--variant", variant, "--json", out.name,
                               "--warmup", str(warmup), "--steps", str(steps), *overrides],
                              capture_output=True, text=True)
        if logs:
            Path(logs).mkdir(parents=True, exist_ok=True)
            Path(logs, f"{variant.replace(' ', '_')}.log").write_text(done.stdout + done.stderr)
        try:
            return json.loads(Path(out.name).read_text())
        except ValueError:
            tail = [line for line in done.stderr.splitlines() if line.strip()][-1:] or [f"exit {done.returncode}"]
            return {"variant": variant, "error": f"process ended ({done.returncode}): {tail[0][:200]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (model=..., size=..., recompute=...)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--logs", help="a folder for each variant's output (its traceback when it fails)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in this process
    parser.add_argument("--json", help=argparse.SUPPRESS)  # where --variant writes its row
    args = parser.parse_args()
    if args.variant:
        import json

        row = run_variant(args.overrides, args.variant, args.warmup, args.steps)
        with open(args.json, "w") as f:
            json.dump(row, f)
        return
    cuda = torch.cuda.is_available()
    variants = VARIANTS if cuda else VARIANTS[:2]
    device = torch.cuda.get_device_name() if cuda else "CPU (a smoke run: times mean nothing)"
    print(f"# {' '.join(args.overrides) or 'defaults'}; {device}; torch {torch.__version__}; "
          f"{args.warmup} warm-up + {args.steps} timed steps; each variant in its own process")
    rows = [in_own_process(args.overrides, v, args.warmup, args.steps, args.logs) for v in variants]
    eager = rows[0]
    print("\n| variant | layers compiled | step ms (median) | vs eager | peak allocated GiB | losses equal to eager | "
          "largest loss difference | graph breaks |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r or "error" in eager:
            print(f"| {r['variant']} | - | {r.get('step_ms', '-')} | - | - | - | - | failed: {r.get('error', 'eager failed')} |")
            continue
        diff = max(abs(a - b) for a, b in zip(r["losses"], eager["losses"]))
        peak = "-" if r.get("peak_gib") is None else f"{r['peak_gib']:.2f}"
        print(f"| {r['variant']} | {r['layers']} | {r['step_ms']:.1f} | {r['step_ms'] / eager['step_ms']:.3f}x | {peak} | "
              f"{r['losses'] == eager['losses']} | {diff:.3e} | {sum(r['breaks'].values())} |")
    for r in rows:
        for reason, n in Counter(r.get("breaks", {})).most_common(5):
            print(f"- {r['variant']}: {n} x {reason[:200]}")


if __name__ == "__main__":
    main()
