"""megatron's unfused RoPE against the fused one (recipes/build/rope.py): bits and time, forward + backward.

    python benchmarks/bench_rope.py            # on a GPU: the h200 size's q and k, standard and MLA

For each shape it applies RoPE to a strided view (q or k as the layer's fused projection output holds
them), runs backward with a fixed gradient, checks that the outputs and input gradients are
bit-identical, and prints the median time of a forward + backward over 50 (CUDA events: the host's
launch time included, which the GPU waits for at these sizes) and their kernels' time alone (``kernel
ms``: 20 more under a CUDA-only profile, the host left out). On a CPU it runs one small shape under
Triton's interpreter (a smoke run: the times mean nothing there).
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from recipes.build import rope  # noqa: E402
from recipes.measure.steptrace import trace_step  # noqa: E402

KERNEL_CALLS = 20

# (name, s, b, heads, head dim, rotary dims, MLA interleaved, the row width the view is cut from)
H200 = [("standard q (h200)", 4096, 2, 16, 128, 128, False, 3 * 128),
        ("standard k (h200)", 4096, 2, 16, 128, 128, False, 3 * 128),
        ("MLA q rope part (h200)", 4096, 2, 16, 64, 64, True, 192),
        ("MLA k rope part (h200)", 4096, 2, 1, 64, 64, True, 576)]
SMOKE = [("smoke", 16, 2, 2, 16, 16, False, 48)]


def run(t, freqs, grad, mla: bool, fused: bool, interpret: bool):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd as unfused

    out = (rope.fused_rotary_pos_emb(t, freqs, mla, interpret=interpret) if fused
           else unfused(t, freqs, mla_rotary_interleaved=mla))  # megatron's: nothing installed here
    out.backward(grad)
    return out


def main() -> None:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu (Triton interpreter; times mean nothing)'}")
    print("| tensor | shape | unfused ms | fused ms | speed-up | unfused kernel ms | fused kernel ms | kernel speed-up "
          "| outputs equal | gradients equal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, s, b, h, d, rot, mla, width in (H200 if cuda else SMOKE):
        gen = torch.Generator(device=device).manual_seed(0)
        base = torch.randn(s, b, h, width, generator=gen, device=device).to(torch.bfloat16)
        freqs = torch.randn(s, 1, 1, rot, generator=gen, device=device) * 3
        grad = torch.randn(s, b, h, d, generator=gen, device=device).to(torch.bfloat16)
        results, times, kernels = {}, {}, {}
        for fused in (False, True):
            leaf = base.clone().requires_grad_()
            out = run(leaf[..., :d], freqs, grad, mla, fused, not cuda)
            results[fused] = (out.detach(), leaf.grad)
            samples = []
            for _ in range(50 if cuda else 2):
                leaf.grad = None
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                run(leaf[..., :d], freqs, grad, mla, fused, not cuda)
                if cuda:
                    end.record()
                    torch.cuda.synchronize()
                    samples.append(start.elapsed_time(end))
            times[fused] = statistics.median(samples) if samples else float("nan")

            def calls(leaf=leaf, fused=fused, d=d, freqs=freqs, grad=grad, mla=mla):
                for _ in range(KERNEL_CALLS):
                    leaf.grad = None
                    run(leaf[..., :d], freqs, grad, mla, fused, False)

            trace = trace_step(calls, host=False) if cuda else None
            kernels[fused] = trace["kernel_total_s"] * 1e3 / KERNEL_CALLS if trace else float("nan")
        same_out = torch.equal(results[True][0], results[False][0])
        same_grad = torch.equal(results[True][1], results[False][1])
        print(f"| {name} | {s}x{b}x{h}x{d} | {times[False]:.3f} | {times[True]:.3f} | "
              f"{times[False] / times[True]:.2f}x | {kernels[False]:.3f} | {kernels[True]:.3f} | "
              f"{kernels[False] / kernels[True]:.2f}x | {same_out} | {same_grad} |")


if __name__ == "__main__":
    main()
