"""``python -m recipes calibrate``: measure this machine's GPU into a hardware profile (``recipes.hardware``).

    python -m recipes calibrate --out h100.yaml [model=mla size=h200_long]
    python -m recipes plan --budget-gib 70 model=mla size=h200_long cluster.gpu=h100.yaml

In well under two minutes: what CUDA and its libraries hold (total - free once the context, cuBLAS and
a first allocation are up, less what PyTorch's allocator holds), bf16 matmul TFLOP/s at the model's
shapes (hidden x FFN width, one micro-batch of 1-8 sequences: the rows the planner's micro-batch sizes
give), device-to-device copy bandwidth (HBM), and pinned host<->device bandwidth alone and beside a
running matmul (what offload's copies get in a step). The offload manager's host cost a group is
left to the spec figures (``estimate.offload_ms_per_group``): measuring it needs a model.
On a machine without a GPU it refuses in one line: profiles describe GPUs.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import yaml

from recipes.files import GIB
from recipes.hardware import load_profile, match_profile

#: Rows of the matmuls timed below the model's micro-batches (a small micro-batch's GEMMs).
SMALL_ROWS = (1024, 2048, 4096, 8192)
MAX_ROWS = 131072


def _time_ms(fn, iters: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def matmul_tflops(hidden: int, ffn: int, rows_list: list[int]) -> dict[int, float]:
    """bf16 TFLOP/s of (rows x hidden) @ (hidden x ffn), per row count."""
    import torch

    out = {}
    w = torch.randn(hidden, ffn, device="cuda", dtype=torch.bfloat16)
    for rows in rows_list:
        a = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        iters = max(3, min(50, int(4e13 / (2 * rows * hidden * ffn))))
        ms = _time_ms(lambda a=a: a @ w, iters)
        out[rows] = round(2 * rows * hidden * ffn / (ms / 1e3) / 1e12, 1)
        del a
    return out


def hbm_gb_s(nbytes: int = 2 * GIB) -> float:
    """Device-to-device copy bandwidth (read + write), GB/s."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), 10)
    return round(2 * nbytes / (ms / 1e3) / 1e9, 1)


def link_gb_s(nbytes: int = GIB, beside_compute: bool = False) -> tuple[float, float]:
    """(device->host, host->device) GB/s of pinned copies on a side stream, alone or while the default
    stream runs a matmul loop (as offload's copies run beside a step's compute)."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    out = []
    for direction in ("d2h", "h2d"):
        def copy(direction=direction):
            with torch.cuda.stream(side):
                (host.copy_(dev, non_blocking=True) if direction == "d2h" else dev.copy_(host, non_blocking=True))
        copy()
        torch.cuda.synchronize()
        if beside_compute:
            for _ in range(200):  # queued compute (about 0.3 s on an H100) that outlasts the copies
                a @ a
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(side)
        for _ in range(3):
            copy()
        end.record(side)
        torch.cuda.synchronize()
        out.append(round(3 * nbytes / (start.elapsed_time(end) / 1e3) / 1e9, 1))
    return out[0], out[1]


def cuda_reserved_gib() -> float:
    """What CUDA's context and its libraries hold outside PyTorch's allocator: total - free after the
    context, cuBLAS and a first allocation are up, less what the allocator reserves."""
    import torch

    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return round((total - free - torch.cuda.memory_reserved()) / GIB, 2)


def host_memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) * 1024 / GIB, 1)
    except OSError:
        return None
    return None


def model_shapes(overrides: list[str]) -> tuple[int, int, int]:
    """(hidden, FFN width, sequence length) of the model the overrides name (default size=h200_long)."""
    from recipes.config import compose_config, typed

    cfg = typed(compose_config(overrides or ["size=h200_long"]))
    m = cfg.model
    return m.hidden_size, m.ffn_hidden_size, cfg.train.seq_length


def calibrate(overrides: list[str]) -> dict:
    """The profile of this machine's GPU, measured."""
    import torch

    device = torch.cuda.get_device_name(0)
    spec_name = match_profile(device)
    spec = load_profile(spec_name) if spec_name else None
    held = cuda_reserved_gib()
    _, total = torch.cuda.mem_get_info()
    hidden, ffn, seq = model_shapes(overrides)
    rows = sorted({*SMALL_ROWS, *(seq * b for b in (1, 2, 4, 8) if seq * b <= MAX_ROWS)})
    table = matmul_tflops(hidden, ffn, rows)
    alone = link_gb_s()
    beside = link_gb_s(beside_compute=True)
    return {"name": f"measured_{spec_name or 'gpu'}", "gpu": device, "match": list(spec.match) if spec else [device],
            "memory_gib": round(total / GIB, 2), "cuda_reserved_gib": held, "hbm_gb_s": hbm_gb_s(),
            # the planner's rates are shares of the spec peak (estimate.mfu): keep it, the table gives the shape
            "bf16_tflops": float(spec.bf16_tflops) if spec else max(table.values()),
            "host_link": spec.host_link if spec else "host link",
            "host_link_gb_s": min(beside), "host_link_alone_gb_s": min(alone),
            "matmul_tflops": table, "host_memory_gib": host_memory_gib(), "gpus_per_node": torch.cuda.device_count(),
            "source": f"measured on {device} {datetime.date.today().isoformat()} at hidden {hidden}, FFN {ffn}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides naming the model whose shapes to time")
    parser.add_argument("--out", type=Path, default=Path("hardware.yaml"), help="the profile to write")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: calibrate measures a GPU and there is none here; profiles are for GPUs: plan with a spec "
              "profile instead (cluster.gpu=h100_sxm|h200|b200|gb200)", file=sys.stderr)
        return 2
    profile = calibrate(args.overrides)
    args.out.write_text(yaml.safe_dump(profile, sort_keys=False))
    load_profile(str(args.out))  # what was written loads and validates
    print(f"wrote {args.out}: {load_profile(str(args.out)).describe()}; matmul TFLOP/s by rows "
          f"{profile['matmul_tflops']}, HBM {profile['hbm_gb_s']} GB/s, host link alone "
          f"{profile['host_link_alone_gb_s']} GB/s")
    return 0
