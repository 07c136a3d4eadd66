"""The entrypoint's steady-state step time against a bare megatron-core loop of the same model.

Runs, in one invocation: (1) a bare loop in this process — the same TransformerConfig and layer
spec, GPTModel, megatron DDP + DistributedOptimizer on GPU (AdamW on CPU), random tokens already on
the device, forward/backward of each micro-batch (``train.global_batch_size / micro_batch_size``),
one step, no schedule, no data pipeline, no measurement hooks; then (2)
``python train.py`` with the same overrides in a fresh process, reading its result.json. Prints a
markdown table with the ratio (target: entrypoint within 2% of the bare loop).

    python benchmarks/bench_entrypoint.py size=h200 attention=sdpa recompute=none [--kernels] [--compile-rope]
    python benchmarks/bench_entrypoint.py model=moe size=h200 recompute=none --repeats 4

``--repeats N`` runs N alternating pairs, each side in a fresh process, and prints the ratio of each
pair and their median: on the H200 one MoE pair gave 1.122 and the next 0.979, because a process's
step time moves by several percent from one process to the next (its own steps agree within 1-3%),
so a 2% claim needs the median over pairs.

``--steps N`` and ``--warmup N`` (default 20 and 3) set how many steps each loop times and how many
it runs first untimed (a test checks the pairs with a few).

``--kernels`` also profiles three bare-loop steps and prints the GPU kernel time per step by kind
(GEMM, attention, norm, optimizer, loss, elementwise) and the top kernels: what limits MFU.
``--compile-rope`` also times the bare loop again with megatron's RoPE under ``torch.compile`` (issue
7: measure torch.compile both ways, in one run, before anything adopts it).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from recipes.config import compose_config  # noqa: E402  (after the repo is on sys.path)


def bare_loop(cfg: dict, steps: int, warmup: int, kernels: bool = False,
              compile_rope: bool = False) -> tuple[float, float]:
    """(median, fastest) step seconds of the plainest megatron-core training loop of this model (and, with
    ``kernels``, the GPU kernel time per step by kind, printed)."""
    import torch

    from launch.torchrun import set_one_rank_env

    set_one_rank_env()
    from megatron.core import parallel_state

    from recipes.build import compat, upstream
    from recipes.build.model import build_model, build_transformer_config

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
    if cfg["train"]["fused_adam"]:  # the same optimizer kernel as the entrypoint's
        from recipes.run.trainer import use_fused_adam

        use_fused_adam(opt)
    t = cfg["train"]
    dev = compat.device()
    tokens = torch.randint(0, cfg["model"]["vocab_size"], (t["micro_batch_size"], t["seq_length"]), device=dev)
    position_ids = torch.arange(t["seq_length"], device=dev).expand_as(tokens)
    num_microbatches = (t["global_batch_size"] or t["micro_batch_size"]) // t["micro_batch_size"]

    def step() -> None:  # the entrypoint's step: every micro-batch's forward and backward, one update
        if on_gpu:
            model.zero_grad_buffer()
        opt.zero_grad()
        for _ in range(num_microbatches):
            loss = model(tokens, position_ids, None, labels=tokens).float().mean() / num_microbatches
            loss.backward()
        if on_gpu:
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([model])
        opt.step()

    def timed() -> list[float]:
        times = []
        for i in range(warmup + steps):
            if on_gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            if on_gpu:
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        return times

    times = timed()
    if kernels:
        print(kernel_table(step, statistics.median(times), on_gpu))
    if compile_rope:
        print(compiled_rope_row(model, tokens, position_ids, timed, statistics.median(times)))
    return statistics.median(times), min(times)


def compiled_rope_row(model, tokens, position_ids, timed, plain_s: float) -> str:
    """The same loop with megatron's unfused rotary embedding under ``torch.compile``, side by side.

    Without TE, ``apply_rope_fusion`` is unavailable and RoPE runs as separate cat/mul/add kernels
    (about 2.4 ms of copies per dense H200 step, docs/evidence/h200.md). This measures whether
    inductor's fusion of that function wins, and checks the loss is unchanged at the same weights;
    nothing in ``recipes/`` uses it unless it does.
    """
    import torch
    from megatron.core.models.common.embeddings import rope_utils

    def loss() -> float:
        with torch.no_grad():
            return float(model(tokens, position_ids, None, labels=tokens).float().mean())

    plain_loss = loss()
    original = rope_utils._apply_rotary_pos_emb_bshd
    rope_utils._apply_rotary_pos_emb_bshd = torch.compile(original, dynamic=False)
    try:
        compiled_loss = loss()
        times = timed()  # its warm-up steps include the compilation
    finally:
        rope_utils._apply_rotary_pos_emb_bshd = original
    median = statistics.median(times)
    return (f"\ntorch.compile of megatron's RoPE (bare loop, same run): {median * 1e3:.2f} ms median "
            f"against {plain_s * 1e3:.2f} ms plain ({median / plain_s:.3f}x); "
            f"loss at the same weights {plain_loss:.6f} plain, {compiled_loss:.6f} compiled")


#: Kernel name patterns -> what the time is spent on (first match wins; names from the H200 profile).
KERNEL_KINDS = [
    ("attention (flash/cuDNN/efficient)", ("flash", "fmha", "cudnn", "attention", "sdpa", "efficient")),
    ("GEMM (matmul)", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "wgmma", "sm90_")),
    ("norm (RMSNorm)", ("rms", "norm")),
    ("optimizer (Adam, grad copies)", ("multi_tensor", "adam", "l2norm", "scale")),
    ("loss (softmax, cross-entropy)", ("softmax", "log_softmax", "nll", "cross_entropy")),
    ("elementwise, copies, other", ("",)),
]


def kernel_table(step, step_s: float, on_gpu: bool, repeats: int = 3, top: int = 12) -> str:
    """GPU kernel time per step by kind and the top kernels, from torch.profiler over ``repeats`` steps.

    Busy = kernel time / wall step time: what is left is the GPU waiting on the host (launch and
    Python overhead) or on synchronization, the part no kernel tuning recovers.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            step()
        if on_gpu:
            torch.cuda.synchronize()
    # Device events are kernels, memcpys/memsets and user annotations ("Optimizer.step#AdamW.step",
    # "ProfilerStep#"); the annotations span other kernels, so counting them would count twice.
    kernels = [e for e in prof.events() if on_gpu and e.device_type == torch.autograd.DeviceType.CUDA
               and "#" not in e.name]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time / 1e3 / repeats  # ms per step
    by_kind = {kind: 0.0 for kind, _ in KERNEL_KINDS}
    for name, ms in by_name.items():
        low = name.lower()
        kind = next(k for k, pats in KERNEL_KINDS if any(p in low for p in pats))
        by_kind[kind] += ms
    busy = sum(by_name.values())
    lines = [f"\nGPU kernel time per step (torch.profiler, {repeats} steps): {busy:.1f} ms of a "
             f"{step_s * 1e3:.1f} ms step ({busy / (step_s * 1e3):.0%} busy)",
             "| kind | ms/step | share of kernel time |", "|---|---|---|"]
    lines += [f"| {k} | {ms:.2f} | {ms / busy:.1%} |" for k, ms in sorted(by_kind.items(), key=lambda kv: -kv[1])
              if busy]
    lines += ["", f"| top {top} kernels | ms/step | calls/step |", "|---|---|---|"]
    counts: dict[str, int] = {}
    for e in kernels:
        counts[e.name] = counts.get(e.name, 0) + 1
    for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| `{name[:90]}` | {ms:.2f} | {counts[name] // repeats} |")
    return "\n".join(lines)


def entrypoint(overrides: list[str], steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, str(REPO / "train.py"), *overrides, f"output_dir={out}",
               f"train.train_iters={steps + warmup}", f"measure.start_step={warmup + 1}",
               f"measure.steps={steps}"]
        subprocess.run(cmd, check=True, cwd=REPO, capture_output=True)
        return json.loads((Path(out) / "result.json").read_text())


def bare_in_subprocess(overrides: list[str], steps: int, warmup: int) -> tuple[float, float]:
    """The bare loop in a fresh process (``--bare-only``), as the entrypoint runs in one."""
    proc = subprocess.run([sys.executable, __file__, "--bare-only", "--steps", str(steps), "--warmup", str(warmup),
                           *overrides], check=True, cwd=REPO, capture_output=True, text=True)
    median, fastest = json.loads(proc.stdout.strip().splitlines()[-1])
    return median, fastest


def repeated(overrides: list[str], repeats: int, steps: int, warmup: int) -> list[tuple[float, float]]:
    """(entrypoint median / bare median, fastest / fastest) of ``repeats`` alternating fresh pairs."""
    ratios = []
    for i in range(repeats):
        rank = entrypoint(overrides, steps, warmup)["ranks"][0]
        bare, bare_min = bare_in_subprocess(overrides, steps, warmup)
        ours, ours_min = rank["timing"]["step_time_s"], rank["timing"]["step_time_min_s"]
        print(f"| {i + 1} | {bare * 1e3:.2f} | {ours * 1e3:.2f} | {ours / bare:.3f} | {ours_min / bare_min:.3f} |",
              flush=True)
        ratios.append((ours / bare, ours_min / bare_min))
    return ratios


def count_option(args: list[str], flag: str, default: int, minimum: int, what: str) -> int:
    """The whole number after ``flag`` (taken out of ``args``), else ``default``; exits naming the flag."""
    if flag not in args:
        return default
    i = args.index(flag)
    value = args[i + 1] if i + 1 < len(args) else ""
    if not value.isdigit() or int(value) < minimum:
        sys.exit(f"bench_entrypoint: {flag} needs {what} >= {minimum}, got {value!r} (e.g. {flag} 4)")
    del args[i:i + 2]
    return int(value)


def main() -> None:
    args = sys.argv[1:]
    kernels, compile_rope, bare_only = (flag in args for flag in ("--kernels", "--compile-rope", "--bare-only"))
    repeats = count_option(args, "--repeats", 1, 1, "a whole number of process pairs")
    steps = count_option(args, "--steps", 20, 1, "a whole number of timed steps")
    warmup = count_option(args, "--warmup", 3, 0, "a whole number of untimed steps")
    overrides = [a for a in args if a not in ("--kernels", "--compile-rope", "--bare-only")]
    if repeats > 1 and (kernels or compile_rope):
        sys.exit("bench_entrypoint: --repeats times fresh processes of the plain loops; --kernels and "
                 "--compile-rope change one bare loop in this process. Run them without --repeats.")
    import torch  # after the arguments: a refusal answers without it

    cfg = compose_config(overrides)
    if bare_only:  # one side of a --repeats pair: print (median, fastest) seconds as JSON
        print(json.dumps(bare_loop(cfg, steps, warmup)))
        return
    if repeats > 1:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        print(f"{time.strftime('%Y-%m-%d')}, {device}, overrides: {' '.join(overrides) or '(defaults)'}, "
              f"{repeats} alternating pairs of fresh processes")
        print("| pair | bare median ms | train.py median ms | ratio (median) | ratio (fastest) |\n|---|---|---|---|---|")
        ratios = repeated(overrides, repeats, steps, warmup)
        med = statistics.median(r[0] for r in ratios)
        lo, hi = min(r[0] for r in ratios), max(r[0] for r in ratios)
        print(f"\nmedian ratio {med:.3f} over {repeats} pairs (range {lo:.3f}-{hi:.3f}); target <= 1.020")
        return
    # The entrypoint first, in its own process, before this process holds GPU memory.
    result = entrypoint(overrides, steps, warmup)
    rank = result["ranks"][0]
    bare, bare_min = bare_loop(cfg, steps, warmup, kernels, compile_rope)
    ours, ours_min = rank["timing"]["step_time_s"], rank["timing"]["step_time_min_s"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\n{time.strftime('%Y-%m-%d')}, {device}, overrides: {' '.join(overrides) or '(defaults)'}")
    # The fastest step next to the median: when the two ratios disagree, the gap is noise (another
    # process, clocks), not the entrypoint's per-step work.
    print("| loop | median step ms | ratio | fastest step ms | ratio |\n|---|---|---|---|---|")
    print(f"| bare megatron-core | {bare * 1e3:.2f} | 1.000 | {bare_min * 1e3:.2f} | 1.000 |")
    print(f"| train.py entrypoint | {ours * 1e3:.2f} | {ours / bare:.3f} | {ours_min * 1e3:.2f} | {ours_min / bare_min:.3f} |")


if __name__ == "__main__":
    main()
