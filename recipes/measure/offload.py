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
- ``CopyTimeline`` times each group's copy out and back and where compute waits for a reload (the
  stall ``recipes.predict.cost`` prices) on the step's clock, with no profiler to slow the step.
"""

from __future__ import annotations

import inspect
import threading
import time
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


class CopyTimeline:
    """While entered, times megatron's manager on the step's clock: each group's copy out (on the
    device-to-host stream, ``bulk_offload_group``), its reload (host-to-device, ``bulk_reload_group``,
    including its wait for the copy out) and each wait of compute for a reload
    (``OffloadTensorGroup.wait_reload_event``, where the group's module begins its backward). Each is
    bracketed by two timing events on its stream, so a copy's interval is when its stream ran it and a
    wait's is the time compute stood still for it. ``count`` counts the waits; ``summary()`` and
    ``timeline()`` read the clock after the step (None on a CPU, whose emulated streams have none)."""

    def __enter__(self) -> CopyTimeline:
        from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

        self.count, self._spans, self.strided, timeline = 0, [], Counter(), self
        group_cls, handler = fgo.OffloadTensorGroup, fgo.ChunkOffloadHandler
        wait, out, back = group_cls.wait_reload_event, handler.bulk_offload_group, handler.bulk_reload_group
        self._undo = [(group_cls, "wait_reload_event", wait), (handler, "bulk_offload_group", out),
                      (handler, "bulk_reload_group", back)]
        self._zero = self._event(torch.cuda.current_stream()) if torch.cuda.is_available() else None

        def timed(kind, group, stream, call, nbytes=0):
            if not isinstance(stream, torch.cuda.Stream):  # the CPU's emulated stream
                return call()
            before = timeline._event(stream)
            value = call()
            timeline._spans.append((kind, group._name, nbytes, before, timeline._event(stream)))
            return value

        def wait_reload_event(group, stream):
            timeline.count += 1
            return timed("wait", group, stream, lambda: wait(group, stream))

        def bulk_offload_group(self_, group):
            # what the manager copies (its own test: a tensor below min_offloaded_tensor_size stays), and
            # of those the strided ones, which it makes contiguous on the copy stream first
            tensors = [t for t in group._tensors.values()
                       if isinstance(t, torch.Tensor) and self_.tensor_need_offloading_checker(t)]
            timeline.strided[group._name] += sum(1 for t in tensors if not t.is_contiguous())
            return timed("out", group, self_.d2h_stream, lambda: out(self_, group), sum(map(_nbytes, tensors)))

        def bulk_reload_group(self_):
            group = self_._groups_to_reload[-1]
            nbytes = sum(_nbytes(s[1]) for s in group._tensors.values() if isinstance(s, tuple))
            return timed("back", group, self_.h2d_stream, lambda: back(self_), nbytes)

        group_cls.wait_reload_event = wait_reload_event
        handler.bulk_offload_group, handler.bulk_reload_group = bulk_offload_group, bulk_reload_group
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, value in self._undo:
            setattr(owner, name, value)

    @staticmethod
    def _event(stream) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def timeline(self) -> list[tuple[str, str, int, float, float]] | None:
        """(kind: out, back or wait; the group's offload point; bytes copied; start ms; end ms), from
        when the block was entered, in the order the host issued them; None without a GPU clock."""
        if self._zero is None or not all(isinstance(s[3], torch.cuda.Event) for s in self._spans):
            return None
        torch.cuda.synchronize()
        return [(kind, name, n, self._zero.elapsed_time(a), self._zero.elapsed_time(b))
                for kind, name, n, a, b in self._spans]

    def seconds(self) -> float | None:
        """Seconds compute waited for reloads in all, once the step is done; None without a GPU."""
        spans = self.timeline()
        return None if spans is None else sum(b - a for kind, _, _, a, b in spans if kind == "wait") / 1e3

    def summary(self) -> dict:
        """What a run records: the waits (``reload_waits``, ``reload_wait_s``: the stall), the strided
        tensors each point's groups copied out (``strided_out``) and, on a GPU,
        each copy stream's busy time and the rate its copies ran at inside the step (``copies``:
        bytes over busy seconds, against ``host_link_bandwidth``'s copies alone), and the step's
        ``copy_timeline`` (ms, from ``timeline()``)."""
        spans = self.timeline()
        out = {"reload_waits": self.count, "reload_wait_s": self.seconds(), "strided_out": dict(self.strided)}
        if spans is not None:
            copies = {}
            for kind, stream in (("out", "d2h"), ("back", "h2d")):
                mine = [(n, b - a) for k, _, n, a, b in spans if k == kind]
                busy = sum(t for _, t in mine) / 1e3
                copies[f"{stream}_busy_s"] = busy
                copies[f"{stream}_gb_s"] = sum(n for n, _ in mine) / busy / 1e9 if busy > 0 else None
            out["copies"] = copies
            out["copy_timeline"] = [[kind, name, n, round(a, 3), round(b, 3)] for kind, name, n, a, b in spans]
        return out


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


# --- Where the manager's host time goes ------------------------------------------------------------
#: The manager's methods ``ManagerCalls`` times, by class: each group's commit and reload, the saved-tensor
#: hooks (``tensor_push``, ``tensor_pop``), the copies' issue, the chunk handlers' set-up and the autograd
#: functions that mark where each group begins and ends.
MANAGER_METHODS = {
    "ChunkOffloadHandler": ("tensor_push", "tensor_pop", "tensor_need_offloading_checker", "offload", "reload",
                            "bulk_offload_group", "bulk_reload_group", "bulk_offload", "bulk_reload",
                            "on_group_commit_forward", "on_group_start_forward", "on_group_commit_backward",
                            "on_group_start_backward"),
    "PipelineOffloadManager": ("__enter__", "__exit__", "init_model_chunk_offload_handler", "reset",
                               "flush_delayed_groups", "push_offload_groups"),
    "FineGrainedActivationOffloadingInterface": ("__enter__", "__exit__", "group_offload", "init_chunk_handler"),
    "OffloadTensorGroup": ("wait_reload_event",),
    "FineGrainedOffloadingGroupCommitFunction": ("forward", "backward"),
    "FineGrainedOffloadingGroupStartFunction": ("forward", "backward"),
}


class ManagerCalls:
    """While entered, times each call of megatron's offload manager's methods (``MANAGER_METHODS``) on
    the host: its calls and its own ms (``self``: less the timed methods it called), per method, on
    whichever thread runs it (the backward's run on autograd's). ``summary()`` gives
    {"Class.method": [calls, self ms, inclusive ms]} and ``total_ms``, the sum of the self times: all
    the host time spent inside the manager. What a step's offload costs the host, method by method,
    against what ``recipes.measure.regions.offload_host_ms`` measures on its synthetic groups."""

    def __enter__(self) -> ManagerCalls:
        from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

        self.calls: Counter = Counter()
        self.self_ms: Counter = Counter()
        self.inclusive_ms: Counter = Counter()
        self._undo, local, calls = [], threading.local(), self

        def timed(key, plain):
            def call(*args, **kwargs):
                stack = getattr(local, "stack", None)
                if stack is None:
                    stack = local.stack = []
                stack.append(0.0)  # the time of timed calls inside this one
                start = time.perf_counter()
                try:
                    return plain(*args, **kwargs)
                finally:
                    spent = (time.perf_counter() - start) * 1e3
                    inner = stack.pop()
                    if stack:
                        stack[-1] += spent
                    calls.calls[key] += 1
                    calls.self_ms[key] += spent - inner
                    calls.inclusive_ms[key] += spent
            return call

        for cls_name, methods in MANAGER_METHODS.items():
            cls = getattr(fgo, cls_name)
            for name in methods:
                static = inspect.getattr_static(cls, name)
                plain = getattr(cls, name)
                wrapped = timed(f"{cls_name}.{name}", plain)
                setattr(cls, name, staticmethod(wrapped) if isinstance(static, staticmethod) else wrapped)
                self._undo.append((cls, name, static))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)

    def summary(self) -> dict:
        return {"methods": {k: [n, round(self.self_ms[k], 4), round(self.inclusive_ms[k], 4)]
                            for k, n in sorted(self.calls.items())},
                "total_ms": round(sum(self.self_ms.values()), 4)}
