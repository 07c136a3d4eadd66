"""megatron-core's fine-grained activation offload on the local spec, and its copy streams on a CPU.

megatron-core's offload manager (``pipeline_parallel/fine_grained_activation_offload.py``) is plain
PyTorch: saved-tensor hooks give each offload point's saved tensors to a group; after the point's
forward the group is copied to a pool of pinned host buffers on a device-to-host stream, and before
its backward it is copied back on a host-to-device stream, each ordered by events. On a GPU it runs as
megatron ships it, with the two workarounds in ``recipes.build.upstream`` (its Transformer Engine
guard, and the inline reload that does not wait for its own copy).

On a CPU there are no streams and no pinned memory, and the manager only takes CUDA tensors. For the
tests that prove offload exact (``offload.emulate_on_cpu=true``), ``emulate_copy_streams_on_cpu``
gives the same manager code, unchanged, a stand-in for ``torch.cuda`` in which

- a copy issued on a copy stream lands only when some stream waits for it (an event, or
  ``wait_stream``): the latest moment CUDA allows, so a missing wait reads a buffer not yet written;
- fresh buffers the manager allocates (its host pool, each reloaded tensor) are filled with NaN, so
  such a read shows in the gradients instead of reading stale bytes that happen to be right;
- the "host" copy is a second CPU buffer (not pinned), and CPU tensors count as device tensors.

What it does not model: a copy reads its source when it is issued (the compute stream runs at once
here, and the manager orders every copy after the compute that wrote its source).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED: list[bool] = []


def offload_manager():
    """megatron's offload manager singleton (the one the model's offload points and schedules use)."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

    return PipelineOffloadManager.get_instance()


def reset_offload_manager() -> None:
    """A fresh manager: it plans its groups during the first step after this (its warm-up), for the
    model built now. One per ``Trainer`` (tests build several models in one process)."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

    PipelineOffloadManager.reset_instance()


def copy_streams_ready(device: torch.device) -> bool:
    """Whether megatron's offload manager can copy here: a GPU, or a CPU with the stand-in streams
    installed (``emulate_copy_streams_on_cpu``)."""
    return device.type == "cuda" or bool(_INSTALLED)


@contextlib.contextmanager
def offload_paused(on: bool) -> Iterator[None]:
    """Forward-only passes (evaluation) with the manager's offload switched off: megatron's manager
    takes any pass for a training step, and one without backward would leave its groups unreloaded."""
    if not on:
        yield
        return
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        fine_grained_offloading_disable_offload,
        fine_grained_offloading_enable_offload,
    )

    fine_grained_offloading_disable_offload()
    try:
        yield
    finally:
        fine_grained_offloading_enable_offload()


# --- the CPU stand-in for torch.cuda's streams and events ---------------------------------------------
class HostStream:
    """A stream whose work is held until something waits for it (a copy stream), or runs at once
    (``immediate``: the compute stream)."""

    flushing = False  # while held work runs, its own copies are not held again

    def __init__(self, immediate: bool = False, **_: object):
        self.immediate = immediate
        self.pending: deque[Callable[[], None]] = deque()
        self.issued = 0
        self.done = 0

    def enqueue(self, work: Callable[[], None]) -> None:
        self.issued += 1
        if self.immediate:
            work()
            self.done += 1
        else:
            self.pending.append(work)

    def run_until(self, position: int) -> None:
        """Land this stream's work up to ``position`` (issue order)."""
        previous, HostStream.flushing = HostStream.flushing, True
        try:
            while self.done < position:
                self.pending.popleft()()
                self.done += 1
        finally:
            HostStream.flushing = previous

    def synchronize(self) -> None:
        self.run_until(self.issued)

    def wait_stream(self, other: HostStream) -> None:
        other.synchronize()

    def wait_event(self, event: HostEvent) -> None:
        event.synchronize()

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        event = event or HostEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return self.done >= self.issued


class HostEvent:
    """A position in a ``HostStream``; waiting for it lands that stream's work up to there."""

    def __init__(self, **_: object):
        self.stream: HostStream | None = None
        self.position = 0

    def record(self, stream: HostStream | None = None) -> None:
        self.stream = stream or _CURRENT[-1]
        self.position = self.stream.issued

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.position)

    wait = synchronize

    def query(self) -> bool:
        return self.stream is None or self.stream.done >= self.position


_COMPUTE = HostStream(immediate=True)
_CURRENT: list[HostStream] = [_COMPUTE]
_STREAMS: list[HostStream] = []


class _HeldCopies(TorchFunctionMode):
    """Inside ``stream(copy stream)``: ``Tensor.copy_`` is held on that stream (its source read now)."""

    def __init__(self, stream: HostStream):
        super().__init__()
        self.stream = stream

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and not HostStream.flushing:
            dst, src = args[0], args[1].detach().clone()
            self.stream.enqueue(lambda: dst.copy_(src))
            return dst
        return func(*args, **kwargs)


class _CudaOnCpu:
    """``torch.cuda`` as the offload module sees it on a CPU: host streams and events."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def Stream(*args, **kwargs) -> HostStream:  # noqa: N802 (torch's name)
        stream = HostStream()
        _STREAMS.append(stream)
        return stream

    Event = HostEvent

    @staticmethod
    def current_stream(device=None) -> HostStream:  # noqa: ARG004
        return _CURRENT[-1]

    @staticmethod
    @contextlib.contextmanager
    def stream(stream: HostStream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        _CURRENT.append(stream)
        mode = contextlib.nullcontext() if stream.immediate else _HeldCopies(stream)
        try:
            with mode:
                yield
        finally:
            _CURRENT.pop()

    @staticmethod
    def synchronize(device=None) -> None:  # noqa: ARG004
        for stream in _STREAMS:
            stream.synchronize()


class _TorchForOffloadOnCpu:
    """``torch`` as the offload module sees it on a CPU: ``cuda`` above, no pinning, NaN-filled buffers."""

    cuda = _CudaOnCpu()

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, pin_memory: bool = False, **kwargs) -> torch.Tensor:  # noqa: ARG004
        out = torch.empty(*args, **kwargs)
        if out.is_floating_point():
            out.fill_(float("nan"))
        return out


def emulate_copy_streams_on_cpu() -> bool:
    """Run megatron's offload manager on a CPU (see the module docstring). Only without CUDA; returns
    True when installed (idempotent)."""
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    fgo.torch = _TorchForOffloadOnCpu()
    handler = fgo.ChunkOffloadHandler

    def can_manage(tensor: torch.Tensor) -> bool:  # megatron's test, with the CPU as the device
        stray = isinstance(tensor, torch._subclasses.fake_tensor.FakeTensor
                           | torch._subclasses.functional_tensor.FunctionalTensor)
        return not isinstance(tensor, torch.nn.Parameter) and not stray and tensor.device.type in ("cuda", "cpu")

    handler._can_manage_tensor_for_offload = staticmethod(can_manage)
    record_stream = torch.Tensor.record_stream

    def record_host_stream(tensor: torch.Tensor, stream) -> None:
        if not isinstance(stream, HostStream):  # held copies keep their own source
            record_stream(tensor, stream)

    torch.Tensor.record_stream = record_host_stream
    _INSTALLED.append(True)
    return True
