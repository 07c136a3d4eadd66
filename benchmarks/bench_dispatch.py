"""megatron's allgather token dispatcher against the local one (recipes/build/dispatch.py): time and
host synchronisations of an MoE layer, and where every host sync of a training step comes from.

    python benchmarks/bench_dispatch.py                      # one MoE layer, forward + backward
    python benchmarks/bench_dispatch.py --step size=h200     # a whole model=moe training step
    python benchmarks/bench_dispatch.py --step model=standard_attn size=h200   # any model's step

Layer mode builds megatron's MoELayer (router, dispatcher, GroupedExperts) twice with the same
weights, at the h200 size's MoE shape on CUDA (hidden 2048, expert ffn 2048, 8 experts, top-2,
4096 x 2 tokens, bf16) and a tiny one on a CPU (a smoke run: the times mean nothing there). It prints
the median wall time of a forward + backward (the host waits for the device at the end of each, so
a sync in the middle shows as time the GPU idles while the host launches the rest), the host syncs
per forward + backward (``recipes.measure.syncs.HostSyncCounter``; on CUDA also the count
``torch.cuda.set_sync_debug_mode`` warns about), and whether outputs and gradients are identical.

Step mode runs the worker's ``Trainer`` for the given overrides (``model=moe`` unless they name a
model), one warm-up step, then counts the host syncs of one more step (per dispatcher for an MoE
model) and lists them by call site; on CUDA also where every synchronizing CUDA call of a third step
comes from (``recipes.measure.syncs.CudaSyncSites``: the counted ones and the copies from pageable
host memory and stream synchronizes the counter cannot see).
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

from recipes.measure.syncs import CudaSyncSites, HostSyncCounter  # noqa: E402

DISPATCHERS = ("allgather", "local")


def cuda_sync_warnings(fn) -> CudaSyncSites:
    """Where the synchronizing CUDA calls of ``fn()`` come from (empty without CUDA)."""
    with CudaSyncSites() as sites:
        fn()
    return sites


def layer_mode(args) -> None:
    from bench_experts import init_single_process
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.transformer_config import TransformerConfig

    from recipes.build.dispatch import LocalDispatchMoELayer
    from recipes.build.experts import grouped_experts_builder

    init_single_process()
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=16, num_moe_experts=args.experts,
        moe_ffn_hidden_size=args.ffn, moe_router_topk=args.topk, moe_grouped_gemm=True,
        moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.01, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, bf16=cuda, params_dtype=dtype)
    submodules = MoESubmodules(experts=grouped_experts_builder())
    device = torch.device("cuda" if cuda else "cpu")
    layers = {"allgather": MoELayer(config, submodules, layer_number=1).to(device)}
    layers["local"] = LocalDispatchMoELayer(config, submodules, layer_number=1).to(device)
    layers["local"].load_state_dict(layers["allgather"].state_dict())
    if not cuda:  # the grouped GEMM exists on a CPU too; the loop path would read counts on the host
        for layer in layers.values():
            layer.experts.gemm_impl = "grouped_mm"
    gen = torch.Generator().manual_seed(0)
    shape = (args.tokens // 2, 2, args.hidden)
    hidden = torch.randn(shape, generator=gen).to(device, dtype)
    grad = torch.randn(shape, generator=gen).to(device, dtype)
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=device))

    def fwd_bwd(layer):
        x = hidden.detach().clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        out, _ = layer(x)
        out.backward(grad)
        return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]

    print(f"# MoE layer: {'CUDA ' + torch.cuda.get_device_name() if cuda else 'CPU smoke run (tiny)'}; "
          f"tokens {args.tokens} x top-{args.topk}, hidden {args.hidden}, expert ffn {args.ffn}, "
          f"{args.experts} experts, {str(dtype).removeprefix('torch.')}, torch {torch.__version__}")
    results = {name: fwd_bwd(layer) for name, layer in layers.items()}
    same = all(torch.equal(a, b) for a, b in zip(results["local"], results["allgather"]))
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(results["local"], results["allgather"]))
    print(f"local vs allgather: outputs and gradients identical: {same} (largest difference {diff:.3e})")
    print(f"\n| dispatcher | fwd+bwd ms (median of {args.iters}) | host syncs (counted) | CUDA sync warnings |")
    print("|---|---|---|---|")
    for name, layer in layers.items():
        for _ in range(args.warmup):
            fwd_bwd(layer)
        times = []
        for _ in range(args.iters):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fwd_bwd(layer)
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        with HostSyncCounter() as syncs:
            fwd_bwd(layer)
        warned = cuda_sync_warnings(lambda layer=layer: fwd_bwd(layer))
        print(f"| {name} | {statistics.median(times):.2f} | {len(syncs)} | {len(warned) if warned.available else '-'} |")
        for (what, where), n in syncs.by_site().most_common():
            print(f"|  | {n} x {what} | {where} | |")


def step_mode(overrides: list[str]) -> None:
    from recipes.config import compose_config
    from recipes.run.world import fresh_trainer, init_one_rank

    base = overrides if any(o.startswith("model=") for o in overrides) else ["model=moe", *overrides]
    cfg = compose_config(base)
    init_one_rank(cfg)
    moe = bool(cfg["model"].get("num_moe_experts"))
    for name in DISPATCHERS if moe else (None,):
        cfg = compose_config(base + ([f"model.moe_token_dispatcher_type={name}"] if name else []))
        trainer = fresh_trainer(cfg)
        try:
            trainer.step()  # warm-up: first-step allocations and one-time work
            with HostSyncCounter() as syncs:
                trainer.step()
            warned = cuda_sync_warnings(trainer.step)
        finally:
            trainer.close()
        print(f"\n## {' '.join(base)}{f' ({name} dispatcher)' if name else ''}: {len(syncs)} host syncs "
              f"in one step (counted)" + (f"; {len(warned)} CUDA sync warnings" if warned.available else ""))
        for (what, where), n in syncs.by_site().most_common():
            print(f"- {n} x `{what}` at {where}")
        if warned.available:
            print("CUDA sync warnings by site:")
            for where, n in warned.sites.most_common():
                print(f"- {n} x at {where}")


def main() -> None:
    from bench_experts import add_layer_args

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", nargs="*", metavar="OVERRIDE", default=None,
                        help="count the syncs of a training step (model=moe unless given), with these Hydra overrides")
    add_layer_args(parser)
    args = parser.parse_args()
    if args.step is not None:
        step_mode(args.step)
    else:
        layer_mode(args)


if __name__ == "__main__":
    main()
