"""What pinned copies on a side stream do to the host and to a training step beside them. GPU only.

    python benchmarks/bench_copy_interference.py            # model=moe size=h200
    python benchmarks/bench_copy_interference.py model=standard_attn size=h200

Activation offload copies a step's saved tensors to the host and back on streams of their own. Its
price counts the offload manager's host work and the copies compute waits for; this measures what
the copies do besides, with no offload at all:

1. ``launches`` (3000 one-kernel launches) and ``python`` (a dict loop, no CUDA) timed on the host
   idle, and while a side stream copies 512 MiB buffers back to back: device to host (``d2h``), host
   to device (``h2d``), ``both``, and device to device (``d2d``, no host memory). A ratio over 1 is
   host work that runs slower beside the copies. 7 repetitions each, the modes interleaved.
2. The worker's ``Trainer`` for the Hydra overrides: one step's host ms (until it returned, less its
   waits in ``Tensor.item``) and its wall ms, with 15 or 30 copies of 256 MiB (about 75 or 150 ms at
   55 GB/s) queued on a side stream just before it, one direction at a time, against none. 6
   repetitions each, interleaved. The step's own copies to the device (its batch) share the link with
   the side stream's.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def side_copies(nbytes: int):
    """Pinned host buffers, device buffers and two side streams: (queue, busy). ``queue(direction, n)``
    queues n copies of ``nbytes`` on them and returns at once: ``d2h`` and ``h2d`` each on a stream
    of its own, ``both`` on both, ``d2d`` device to device (any other direction, none); ``busy()``
    whether any is still copying."""
    import torch

    pinned, pinned2 = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    gbuf, gbuf2 = (torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2))
    side, side2 = torch.cuda.Stream(), torch.cuda.Stream()

    def queue(direction: str, n: int) -> None:
        with torch.cuda.stream(side):
            for _ in range(n):
                if direction in ("d2h", "both"):
                    pinned.copy_(gbuf, non_blocking=True)
        with torch.cuda.stream(side2):
            for _ in range(n):
                if direction in ("h2d", "both"):
                    gbuf2.copy_(pinned2, non_blocking=True)
        if direction == "d2d":
            with torch.cuda.stream(side):
                for _ in range(n):
                    gbuf2.copy_(gbuf, non_blocking=True)

    return queue, lambda: not (side.query() and side2.query())


def host_beside_copies() -> list[str]:
    import torch

    x = torch.randn(64, device="cuda")

    def launches(n=3000):
        t = time.perf_counter()
        for _ in range(n):
            x.add(1.0)
        return (time.perf_counter() - t) * 1e3

    def python(n=300000):
        t, d = time.perf_counter(), {}
        for i in range(n):
            d[i & 4095] = i
        return (time.perf_counter() - t) * 1e3

    queue, busy = side_copies(512 << 20)

    out = []
    for fn in (launches, python):
        for _ in range(3):
            fn()
            torch.cuda.synchronize()
        res = {}
        for _ in range(7):
            for mode in ("idle", "d2h", "h2d", "both", "d2d"):
                torch.cuda.synchronize()
                if mode != "idle":
                    queue(mode, 30)
                    time.sleep(0.02)
                ms = fn()
                copying = busy()
                torch.cuda.synchronize()
                res.setdefault(mode, []).append((ms, copying))
        base = statistics.median(m for m, _ in res["idle"])
        out.append(fn.__name__ + " " + " ".join(
            f"{k}: {statistics.median(m for m, _ in v):.2f} ms ({statistics.median(m for m, _ in v) / base:.3f}x, "
            f"copying at end {sum(b for _, b in v)}/7)" for k, v in res.items()))
    return out


def step_beside_copies(overrides: list[str]) -> list[str]:
    import torch

    from benchmarks.bench_hostbound import defaults
    from recipes.config import compose_config
    from recipes.measure.syncs import ItemWaits
    from recipes.run.world import fresh_trainer, init_one_rank

    cfg = compose_config(defaults(overrides))
    init_one_rank(cfg)
    trainer = fresh_trainer(cfg)
    queue, busy = side_copies(256 << 20)

    def step(mode, waits):
        torch.cuda.synchronize()
        queue(*mode)
        waits.seconds = 0.0
        t = time.perf_counter()
        trainer.step()
        returned = time.perf_counter()
        host = (returned - t - waits.seconds) * 1e3
        copying = busy()
        torch.cuda.synchronize()
        return host, (time.perf_counter() - t) * 1e3, copying

    modes = [("none", 0), ("d2h", 15), ("d2h", 30), ("h2d", 15), ("h2d", 30)]
    out, res = [], {}
    try:
        with ItemWaits() as waits:
            for _ in range(3):
                step(modes[0], waits)
            for rep in range(6):
                for m in (modes if rep % 2 == 0 else modes[::-1]):
                    res.setdefault(m, []).append(step(m, waits))
    finally:
        trainer.close()
    base = statistics.median(h for h, _, _ in res[modes[0]])
    wbase = statistics.median(h for _, h, _ in res[modes[0]])
    for m, v in res.items():
        h, w = statistics.median(x for x, _, _ in v), statistics.median(x for _, x, _ in v)
        out.append(f"{m[0]} {m[1]} x 256 MiB: host {h:.1f} ms ({h - base:+.1f}), step {w:.1f} ms ({w - wbase:+.1f}), "
                   f"copying at return {sum(b for *_, b in v)}/6")
    return out


def main() -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_copy_interference.py needs a CUDA GPU: it times pinned copies over the host link")
    print(f"{torch.cuda.get_device_name()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for line in host_beside_copies() + step_beside_copies(sys.argv[1:]):
        print(line, flush=True)


if __name__ == "__main__":
    main()
