"""Time megatron's SequentialMLP against recipes.build.experts.GroupedExperts (forward + backward).

    python benchmarks/bench_experts.py [--moe-act] [--iters N]

On CUDA it runs the h200 size's MoE shape (hidden 2048, moe_ffn_hidden_size 2048, 8 experts, top-2,
4096 x 2 tokens, bf16, SwiGLU); on a CPU a tiny shape, as a smoke run whose times mean nothing.
Both modules hold the same weights; the script checks their outputs agree (relative error), then
prints a markdown table: median fwd+bwd time over N iterations (CUDA events after warm-up), the
ratio to SequentialMLP, and the bytes autograd saves for backward (unique storages after the
forward; what ``moe_act`` shrinks). With ``--moe-act`` it adds GroupedExperts with moe_act and
checks that its gradients equal those without it, bit for bit. "peak alloc" (CUDA) is the most
memory allocated above parameters and inputs during one fwd+bwd of the experts alone: there the
backward's own temporaries dominate, so it does not show what moe_act saves across a whole model
(the saved-for-backward column does). At this shape SequentialMLP is host-bound: its GPU kernels
take about as long as the loop path's; the wall-time gap is Python and launch overhead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MIB = 2**20


def init_single_process() -> None:
    """gloo group of one, megatron model-parallel state, CPU compat, upstream fixes, RNG."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from launch.torchrun import set_one_rank_env
    from recipes.build import upstream
    from recipes.build.compat import install_cpu_compat, seed_model_parallel_rng

    set_one_rank_env()
    dist.init_process_group("gloo", rank=0, world_size=1)
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel()
    install_cpu_compat()
    upstream.apply_all()
    seed_model_parallel_rng(1234)


def make_config(args, moe_act: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    recompute = dict(recompute_granularity="selective", recompute_modules=["moe_act"])
    return TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=16,
        num_moe_experts=args.experts,
        moe_ffn_hidden_size=args.ffn,
        moe_router_topk=args.topk,
        moe_grouped_gemm=True,
        moe_token_dispatcher_type="allgather",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bf16=args.dtype == torch.bfloat16,
        params_dtype=args.dtype,
        **(recompute if moe_act else {}),
    )


def routed_inputs(args, device):
    """What MoELayer hands the experts: tokens sorted by expert, counts (on the host, as the
    allgather dispatcher gives them) and one router prob per routed token."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.tokens, args.experts, generator=gen)
    top_probs, top_experts = torch.softmax(logits, -1).topk(args.topk, dim=-1)
    order = top_experts.flatten().argsort(stable=True)
    tokens_per_expert = torch.bincount(top_experts.flatten(), minlength=args.experts)
    routed = args.tokens * args.topk
    x = torch.randn(routed, args.hidden, generator=gen).to(device, args.dtype)
    probs = top_probs.flatten()[order].to(device)  # fp32, as the router's
    grad = torch.randn(routed, args.hidden, generator=gen).to(device, args.dtype)
    return x, tokens_per_expert, probs, grad


def fwd_bwd(module, x, tokens_per_expert, probs, grad):
    """One forward + backward on fresh leaves; returns output and all gradients."""
    module.zero_grad(set_to_none=True)
    x, probs = x.detach().requires_grad_(), probs.detach().requires_grad_()
    out, _ = module(x, tokens_per_expert, probs)
    out.backward(grad)
    return [out.detach(), x.grad, probs.grad] + [p.grad for p in module.parameters()]


def median_ms(module, inputs, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fwd_bwd(module, *inputs)
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fwd_bwd(module, *inputs)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fwd_bwd(module, *inputs)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def saved_mib(module, x, tokens_per_expert, probs, grad) -> float:
    """Unique storages autograd holds after one forward; storages moe_act discarded count 0."""
    saved = []
    x, probs = x.detach().requires_grad_(), probs.detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, _ = module(x, tokens_per_expert, probs)
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in saved}
    out.backward(grad)
    return sum(storages.values()) / MIB


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def add_layer_args(parser: argparse.ArgumentParser) -> None:
    """The timed MoE layer's shape and repetitions (this benchmark and bench_dispatch.py)."""
    cuda = torch.cuda.is_available()
    parser.add_argument("--iters", type=int, default=20 if cuda else 3)
    parser.add_argument("--warmup", type=int, default=5 if cuda else 1)
    parser.add_argument("--hidden", type=int, default=2048 if cuda else 64)
    parser.add_argument("--ffn", type=int, default=2048 if cuda else 64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096 * 2 if cuda else 256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--moe-act", action="store_true", help="also time moe_act recompute")
    add_layer_args(parser)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    args = parser.parse_args()
    args.dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    init_single_process()
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from recipes.build.experts import GroupedExperts, use_grouped_mm

    device = torch.device("cuda") if cuda else torch.device("cpu")
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    config = make_config(args, moe_act=False)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    sequential = SequentialMLP(args.experts, config, submodules, pg_collection=pgs)
    grouped = GroupedExperts(args.experts, config, pg_collection=pgs)
    grouped.load_from_sequential(sequential)
    looped = GroupedExperts(args.experts, config, pg_collection=pgs)
    looped.load_state_dict(grouped.state_dict())
    looped.gemm_impl = "loop"
    inputs = routed_inputs(args, device)
    auto = "grouped_mm" if use_grouped_mm(inputs[0], grouped.weight1, grouped.weight2) else "loop"
    rows = [
        ("SequentialMLP (megatron)", "loop of MLPs", sequential),
        ("GroupedExperts", auto, grouped),
        ("GroupedExperts", "loop", looped),
    ]
    if args.moe_act:
        recompute_config = make_config(args, moe_act=True)
        recomputed = GroupedExperts(args.experts, recompute_config, pg_collection=pgs)
        recomputed.load_state_dict(grouped.state_dict())
        rows.append(("GroupedExperts + moe_act", auto, recomputed))

    dtype = str(args.dtype).removeprefix("torch.")
    if cuda:
        print(f"# experts benchmark, CUDA: {torch.cuda.get_device_name()}")
    else:
        print("# experts benchmark, CPU smoke run (tiny shape; the times mean nothing)")
    print(f"tokens {args.tokens} x top-{args.topk}, hidden {args.hidden}, moe_ffn_hidden_size "
          f"{args.ffn}, {args.experts} experts, {dtype}, SwiGLU, tokens per expert "
          f"{inputs[1].tolist()}, torch {torch.__version__}")
    reference = fwd_bwd(sequential, *inputs)
    for name, path, module in rows[1:]:
        errors = [rel_err(a, b) for a, b in zip(fwd_bwd(module, *inputs)[:3], reference)]
        print(f"{name} [{path}] vs SequentialMLP, relative error: output {errors[0]:.2e}, "
              f"input grad {errors[1]:.2e}, probs grad {errors[2]:.2e}")
    if args.moe_act:
        pairs = zip(fwd_bwd(recomputed, *inputs), fwd_bwd(grouped, *inputs))
        same = all(torch.equal(a, b) for a, b in pairs)
        print(f"moe_act output and all gradients bit-identical to no recompute: {same}")

    print(f"\n| experts | GEMM path | fwd+bwd ms (median of {args.iters}) | speed vs SequentialMLP "
          "| saved for backward MiB |" + (" peak alloc MiB |" if cuda else ""))
    print("|---|---|---|---|---|" + ("---|" if cuda else ""))
    base = None
    for name, path, module in rows:
        ms = median_ms(module, inputs, args.warmup, args.iters)
        base = base or ms
        mib = saved_mib(module, *inputs)
        peak = ""
        if cuda:
            module.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            fwd_bwd(module, *inputs)
            peak = f" {(torch.cuda.max_memory_allocated() - before) / MIB:.0f} |"
        print(f"| {name} | {path} | {ms:.3f} | {base / ms:.2f}x | {mib:.1f} |{peak}")

if __name__ == "__main__":
    main()
