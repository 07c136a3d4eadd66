"""Host synchronisations: the calls that make the host wait for the GPU, counted on any device.

On a GPU the host queues kernels and runs ahead, until it needs a value the device computes: reading
a tensor on the host (``.item()``, ``bool()``/``int()``/``float()`` of a tensor, ``.tolist()``,
``.cpu()``, ``.numpy()``), or an op whose output size depends on the values (``nonzero``,
``masked_select``, indexing with a boolean mask, ``unique``, ``repeat_interleave`` without
``output_size``), which reads a count first. Then it waits, and the GPU idles while the host
catches up. ``torch.cuda.set_sync_debug_mode`` reports these on a GPU only; ``HostSyncCounter``
counts the same calls on a CPU too, so a CPU test can pin a code path that has none, and a GPU run
can say where each one comes from. On a machine with CUDA only calls on GPU tensors count (a host
tensor never waits); without CUDA every call counts, as the same code would make it on a GPU.

It sees reads through the patched ``Tensor`` methods and the value-dependent ops through a
``TorchDispatchMode`` (this thread; on a CPU autograd's backward runs on it too). It does not see a
copy from host to device (``.to("cuda")`` of a CPU tensor, which waits on a GPU when the memory is
pageable): on a CPU there is no device to copy to, so such copies are invisible here.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Tensor methods that read values on the host (``item``, ``bool()`` etc. dispatch
#: ``_local_scalar_dense``, which the mode sees).
READS = ("cpu", "tolist", "numpy")
#: aten ops that read a value, or size their output by the data.
OPS = {
    "_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
    "unique_consecutive", "equal",
}
_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass
class SyncEvent:
    """One synchronising call: what (``Tensor.cpu``, ``aten.nonzero``) and where (the first frame
    outside torch and this module: ``megatron/core/.../token_dispatcher.py:318 dispatch_postprocess``)."""

    what: str
    where: str


@dataclass
class HostSyncCounter:
    """``with HostSyncCounter() as syncs: ...`` records every synchronising call in the block."""

    events: list[SyncEvent] = field(default_factory=list)

    def counts(self, *tensors) -> bool:
        """Whether a call on these tensors counts: on a machine with CUDA only if one is on the GPU
        (host tensors never wait); without CUDA every call, as the GPU run would make it."""
        return not self._cuda or any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors)

    def __enter__(self) -> HostSyncCounter:
        self._cuda = torch.cuda.is_available()
        self._originals = {name: getattr(torch.Tensor, name) for name in READS}
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, self._wrap(name, original))
        self._mode = _SyncMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)

    def _wrap(self, name: str, original):
        def read(tensor, *args, **kwargs):
            if self.counts(tensor):
                self.record(f"Tensor.{name}")
            return original(tensor, *args, **kwargs)

        return read

    def record(self, what: str) -> None:
        self.events.append(SyncEvent(what, _caller()))

    def __len__(self) -> int:
        return len(self.events)

    def by_site(self) -> Counter:
        """Counts per (what, where), most frequent first."""
        return Counter((e.what, e.where) for e in self.events)


class ItemWaits:
    """The host's seconds inside ``Tensor.item`` while entered (``seconds``; the caller resets it):
    on a GPU, how long a step's host waited for the device where megatron reads the grad norm, once a
    step. What the host took to issue a step is its time to return less these waits
    (the host-bound studies behind docs/offload.md)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._item = None

    def __enter__(self) -> ItemWaits:
        item = self._item = torch.Tensor.item

        def timed_item(tensor):
            start = time.perf_counter()
            try:
                return item(tensor)
            finally:
                self.seconds += time.perf_counter() - start

        torch.Tensor.item = timed_item
        return self

    def __exit__(self, *exc) -> None:
        torch.Tensor.item = self._item


class CudaSyncSites:
    """``with CudaSyncSites() as sites: ...`` records where every synchronizing CUDA call of the block
    comes from, as ``torch.cuda.set_sync_debug_mode("warn")`` reports them on a GPU: the calls
    ``HostSyncCounter`` sees and those it cannot (a copy from pageable host memory, a stream
    synchronize). Without CUDA it records nothing (``available`` is False).

    A site is the innermost frame outside torch and this module (``_caller``); a call made from
    autograd's backward thread, with no Python frame of its own, reads as the frame that ran
    ``backward``."""

    def __init__(self) -> None:
        self.available = torch.cuda.is_available()
        self.sites: Counter = Counter()

    def __enter__(self) -> CudaSyncSites:
        if self.available:
            torch.cuda.synchronize()
            self._catch = warnings.catch_warnings()
            self._catch.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = self._show
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.available:
            torch.cuda.set_sync_debug_mode("default")
            self._catch.__exit__(*exc)

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message):
            self.sites[_caller(depth=1)] += 1

    def __len__(self) -> int:
        return sum(self.sites.values())


class _SyncMode(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if (name in OPS
                or (name in ("index", "index_put", "index_put_") and _has_mask(args[1]))
                or (name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor")
                    and kwargs.get("output_size") is None)):
            if self.counter.counts(*_tensors(args)):
                self.counter.record(f"aten.{name}")
        return func(*args, **kwargs)


def _tensors(args) -> list:
    out = []
    for a in args:
        out += _tensors(a) if isinstance(a, (list, tuple)) else [a]
    return out


def _has_mask(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _caller(depth: int = 2) -> str:
    """The innermost frame outside torch, the warnings module and this module, as ``path:line
    function`` (the path from ``megatron/`` or the repository, not the machine's prefix)."""
    frame = sys._getframe(depth)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and path != __file__ and not path.endswith("warnings.py"):
            return f"{_short(path)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _short(path: str) -> str:
    for marker in ("/site-packages/", "/megatron/", "/recipes/", "/tests/", "/benchmarks/"):
        if marker in path:
            head = "" if marker == "/site-packages/" else marker.strip("/") + "/"
            return head + path.split(marker, 1)[1]
    return path
