"""The entrypoint's steady-state step time against a bare megatron-core loop of the same model.

Runs, in one invocation: (1) a bare loop in this process — the same TransformerConfig and layer
spec, GPTModel, megatron DDP + DistributedOptimizer on GPU (AdamW on CPU), random tokens already on
the device, forward/backward/step, no schedule, no data pipeline, no measurement hooks; then (2)
``python train.py`` with the same overrides in a fresh process, reading its result.json. Prints a
markdown table with the ratio (target: entrypoint within 2% of the bare loop).

    python benchmarks/bench_entrypoint.py size=h200 attention=sdpa recompute=none
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def compose(overrides: list[str]) -> dict:
    from recipes.config import compose_config

    return compose_config(overrides)


def bare_loop(cfg: dict, steps: int, warmup: int) -> float:
    """Median step seconds of the plainest megatron-core training loop of this model."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    from megatron.core import parallel_state

    from recipes import compat, upstream
    from recipes.model import build_model, build_transformer_config

    on_gpu = torch.cuda.is_available()
    compat.install_cpu_compat()
    upstream.apply_all()
    torch.distributed.init_process_group("nccl" if on_gpu else "gloo")
    parallel_state.initialize_model_parallel()
    compat.seed_model_parallel_rng(cfg["train"]["seed"])
    config = build_transformer_config(cfg, on_gpu)
    chunks = build_model(cfg, config)
    if on_gpu:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        model = DistributedDataParallel(config, ddp, chunks[0])
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=config.bf16,
                                                     params_dtype=config.params_dtype,
                                                     use_distributed_optimizer=True, clip_grad=1.0),
                                     [model])
    else:
        model = chunks[0]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t = cfg["train"]
    dev = compat.device()
    tokens = torch.randint(0, cfg["model"]["vocab_size"], (t["micro_batch_size"], t["seq_length"]), device=dev)
    position_ids = torch.arange(t["seq_length"], device=dev).expand_as(tokens)
    times = []
    for i in range(warmup + steps):
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        if on_gpu:
            model.zero_grad_buffer()
        opt.zero_grad()
        loss = model(tokens, position_ids, None, labels=tokens).float().mean()
        loss.backward()
        if on_gpu:
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([model])
        opt.step()
        if on_gpu:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def entrypoint(overrides: list[str], steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, str(REPO / "train.py"), *overrides, f"output_dir={out}",
               f"train.train_iters={steps + warmup}", f"train.warmup_iters={warmup}"]
        subprocess.run(cmd, check=True, cwd=REPO, capture_output=True)
        return json.loads((Path(out) / "result.json").read_text())


def main() -> None:
    overrides = sys.argv[1:]
    steps, warmup = 20, 3
    cfg = compose(overrides)
    # The entrypoint first, in its own process, before this process holds GPU memory.
    result = entrypoint(overrides, steps, warmup)
    rank = result["ranks"][0]
    bare = bare_loop(cfg, steps, warmup)
    ours = rank["timing"]["step_time_s"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\n{time.strftime('%Y-%m-%d')}, {device}, overrides: {' '.join(overrides) or '(defaults)'}")
    print("| loop | median step ms | ratio |\n|---|---|---|")
    print(f"| bare megatron-core | {bare * 1e3:.2f} | 1.000 |")
    print(f"| train.py entrypoint | {ours * 1e3:.2f} | {ours / bare:.3f} |")


if __name__ == "__main__":
    main()
