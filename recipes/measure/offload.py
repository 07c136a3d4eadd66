"""What activation offload moved, how fast the host link is, and how much of the copying showed.

- ``OffloadMeter`` counts the bytes megatron's offload manager copies to the host (device-to-host) and
  back (host-to-device), per offload module, by wrapping the manager's copy functions: what a step
  really moved, not what the plan says. It also tells listeners (the activation ledger) about every
  tensor saved inside an offload point, which the manager's own saved-tensor hooks hide from the
  ledger's, and about each one it copies to the host.
- ``host_link_bandwidth`` times pinned copies between host and device (GB/s each way). GPU only.
- ``copy_overlap`` reads one profiled step's trace (``recipes.measure.steptrace``): the time the copy
  streams were busy, and the part of it with no compute kernel running (the exposed transfer time).
  GPU only.
- ``ReloadWaits`` times where compute waits for a reload (the stall ``recipes.predict.cost`` prices),
  with no profiler to slow the step.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Protocol

import torch

from recipes.measure.steptrace import trace_step


class OffloadListener(Protocol):
    def saved(self, tensor: torch.Tensor) -> None: ...

    def offloaded(self, tensor: torch.Tensor, nbytes: int) -> None: ...


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class OffloadMeter:
    """Bytes, tensors and groups the offload manager copied, cumulative; ``snapshot()`` and ``since()``
    per step. A group is one offload module of one layer of one micro-batch: ``groups_moved`` counts
    those copied out, ``groups_kept`` those committed and left on the device, which is what megatron's
    plan flags and its per-step rule together decide (it also keeps each micro-batch's last group of a
    module when that micro-batch's backward comes next, as without pipeline parallel)."""

    def __init__(self) -> None:
        self.d2h_bytes: Counter = Counter()  # per offload module
        self.groups_moved: Counter = Counter()  # per offload module
        self.groups_committed: Counter = Counter()
        self.h2d_bytes = 0
        self.d2h_tensors = 0
        self.h2d_tensors = 0
        self.listeners: list[OffloadListener] = []
        self._group = "unknown"
        self._undo: list = []

    def install(self) -> OffloadMeter:
        from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

        meter, cls = self, fgo.ChunkOffloadHandler
        offload, reload, bulk, push = cls.offload, cls.reload, cls.bulk_offload_group, cls.tensor_push
        commit = cls.bulk_offload

        def bulk_offload(self_, name, *args, **kwargs):  # every group's forward commit, moved or kept
            meter.groups_committed[name] += 1
            return commit(self_, name, *args, **kwargs)

        def bulk_offload_group(self_, group):  # only the groups megatron copies out
            meter._group = group._name
            meter.groups_moved[group._name] += 1
            return bulk(self_, group)

        def offload_(self_, src_tensor, *args, **kwargs):
            n = _nbytes(src_tensor)
            meter.d2h_bytes[meter._group] += n
            meter.d2h_tensors += 1
            for listener in meter.listeners:
                listener.offloaded(src_tensor, n)
            return offload(self_, src_tensor, *args, **kwargs)

        def reload_(self_, state, *args, **kwargs):
            meter.h2d_bytes += _nbytes(state[1])
            meter.h2d_tensors += 1
            return reload(self_, state, *args, **kwargs)

        def tensor_push(self_, tensor):
            for listener in meter.listeners:
                listener.saved(tensor)
            return push(self_, tensor)

        self._undo = [(cls, "offload", offload), (cls, "reload", reload), (cls, "bulk_offload_group", bulk),
                      (cls, "tensor_push", push), (cls, "bulk_offload", commit)]
        cls.offload, cls.reload, cls.bulk_offload_group, cls.tensor_push, cls.bulk_offload = (
            offload_, reload_, bulk_offload_group, tensor_push, bulk_offload)
        return self

    def uninstall(self) -> None:
        for owner, name, value in self._undo:
            setattr(owner, name, value)
        self._undo = []

    def snapshot(self) -> dict:
        """The counts so far."""
        return {"d2h_bytes": sum(self.d2h_bytes.values()), "h2d_bytes": self.h2d_bytes,
                "d2h_tensors": self.d2h_tensors, "h2d_tensors": self.h2d_tensors,
                "d2h_bytes_by_module": dict(self.d2h_bytes), "groups_moved": dict(self.groups_moved),
                "groups_kept": {k: n - self.groups_moved[k] for k, n in self.groups_committed.items()}}

    def since(self, before: dict) -> dict:
        """The counts since ``before`` (a ``snapshot()``)."""
        now = self.snapshot()
        out = {k: now[k] - before[k] for k in ("d2h_bytes", "h2d_bytes", "d2h_tensors", "h2d_tensors")}
        for key in ("d2h_bytes_by_module", "groups_moved", "groups_kept"):
            out[key] = {k: v - before[key].get(k, 0) for k, v in now[key].items() if v - before[key].get(k, 0)}
        return out


class ReloadWaits:
    """While entered, each wait of megatron's manager for a group's reload
    (``OffloadTensorGroup.wait_reload_event``, where the group's module begins its backward) is counted
    and, on a GPU, bracketed by two timing events on the waiting stream: the second runs once the wait
    is over, so their difference is the time compute stood still for that copy. ``seconds()`` sums them
    after the step (None on a CPU, whose emulated streams have no clock)."""

    def __enter__(self) -> ReloadWaits:
        from megatron.core.pipeline_parallel.fine_grained_activation_offload import OffloadTensorGroup

        self.count, self._events, self._original = 0, [], OffloadTensorGroup.wait_reload_event
        original, waits = self._original, self

        def wait_reload_event(group, stream):
            waits.count += 1
            if not isinstance(stream, torch.cuda.Stream):  # the CPU's emulated stream
                return original(group, stream)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(stream)
            original(group, stream)
            after.record(stream)
            waits._events.append((before, after))

        OffloadTensorGroup.wait_reload_event = wait_reload_event
        return self

    def __exit__(self, *exc) -> None:
        from megatron.core.pipeline_parallel.fine_grained_activation_offload import OffloadTensorGroup

        OffloadTensorGroup.wait_reload_event = self._original

    def seconds(self) -> float | None:
        """Seconds compute waited for reloads in all, once the step is done; None without a GPU."""
        if len(self._events) < self.count or not torch.cuda.is_available():
            return None  # an emulated stream's waits have no clock
        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in self._events) / 1e3


# --- GPU: the host link and the copies' overlap with compute --------------------------------------
def host_link_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> dict | None:
    """Pinned host <-> device copy bandwidth in GB/s (10^9 bytes per second), the best of ``repeats``
    copies of ``nbytes`` each way, on this process's GPU; None on a CPU."""
    if not torch.cuda.is_available():
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("d2h_gb_s", host, dev), ("h2d_gb_s", dev, host)):
        best = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        out[name] = nbytes / best / 1e9
    out["bytes"] = nbytes
    del host, dev
    torch.cuda.empty_cache()
    return out


def copy_overlap(step, keep: Path | None = None) -> tuple[dict, dict] | None:
    """Run ``step()`` (one training step) under torch's profiler: the copy streams' busy and exposed
    time per direction and together, in seconds, and the step's whole ``recipes.measure.steptrace``
    summary (the trace gzipped at ``keep`` when given); None on a CPU."""
    summary = trace_step(step, keep)
    if summary is None:
        return None
    return dict(summary["copies"]), summary
