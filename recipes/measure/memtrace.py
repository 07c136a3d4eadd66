"""The memory trace of one training step: who allocates what, in which phase, and when it is freed.

Recording only; ``recipes.measure.profile`` replays a ``Trace`` to find the peak and attribute it.

- ``PhaseTracker`` labels the code running now, per thread, as "phase|kind": forward/backward of
  layer i (a TransformerLayer's ``layer_number``), embedding, logits/loss, gradient finalization,
  optimizer step; the kind is the ledger's module kind (``recipes.measure.ledger.module_kinds``).
- GPU (``record_gpu``): the caching allocator's event trace for this one step
  (``torch.cuda.memory._record_memory_history``); each event carries the label of the thread that
  made it (``_set_memory_metadata`` is thread-local, and backward hooks run on autograd's thread,
  so they stamp that thread). Blocks are attributed to parameters, gradients and optimizer state
  by address (megatron DDP's contiguous buffers, DistributedOptimizer's fp32 main params and Adam
  states, torch AdamW's states), to a module kind by the label at their allocation, else to
  other/transient.
- CPU (``record_cpu``): no allocator trace, so the events are the storages saved for backward (pack
  hooks; freed when autograd releases them, seen by weakref finalizers), gradients (post-accumulate
  hooks) and optimizer state. Transients are invisible; the labels and the bookkeeping are the same.
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from recipes.measure.ledger import module_kinds
from recipes.measure.timeline import STATIC, TRANSIENT
from recipes.recompute import KINDS

BEFORE = "before step"
#: Allocator trace entries kept for the profiled step (a few hundred bytes each, host memory).
MAX_ENTRIES = 2_000_000
_REGION = {"embedding": "embedding", "norm": "final norm", "logits": "logits/loss", "other": "decoder"}
_TOKENS = itertools.count()


# --- phases: which layer and module kind is running, in every thread ---------------------------


class PhaseTracker:
    """Labels "phase|kind|token" for the code running now, per thread.

    Forward: module pre/post hooks (global, as the ledger's) keep a stack of (kind, region); a
    TransformerLayer's ``layer_number`` names the region. Backward: gradient hooks on the outputs of
    the model, its layers and its embedding mark "backward <region>" when their gradient arrives; a
    module forward inside backward (recompute) is labelled "backward layer j" with its own kind.
    ``stamp`` mirrors each label into the CUDA allocator's thread-local trace metadata.
    """

    def __init__(self, chunks: list[torch.nn.Module], stamp: bool = False):
        # lazy: megatron takes seconds to import; tools that never build a model skip it
        from megatron.core.transformer.transformer_layer import TransformerLayer

        self.kinds: dict[int, str] = {}
        for chunk in chunks:
            self.kinds.update(module_kinds(chunk))
        self.layers = {id(m): m.layer_number for c in chunks for m in c.modules()
                       if isinstance(m, TransformerLayer)}
        self.embeddings = {id(m) for c in chunks for n, m in c.named_modules()
                           if n.rsplit(".", 1)[-1] == "embedding"}
        # a chunk's own code is the loss on the last pipeline stage, the stage's glue elsewhere
        self.roots = {id(c): "logits/loss" if getattr(getattr(c, "module", c), "post_process", True)
                      else "pipeline stage" for c in chunks}
        self.token = f"t{next(_TOKENS)}"
        self.stamp = stamp
        self.on_change: Callable[[str], None] | None = None
        self.on_root: Callable[[int, bool], None] | None = None  # (chunk id, entering) in forward
        self._local = threading.local()
        self._handles: list = []

    def _state(self):
        st = self._local
        if not hasattr(st, "stack"):
            st.stack, st.base, st.label = [], f"{BEFORE}|transient|{self.token}", ""
        return st

    def label(self) -> str:
        return self._state().label or self._state().base

    def set_base(self, phase: str, kind: str = "transient") -> None:
        """The label of this thread while no module runs (backward regions, optimizer step)."""
        st = self._state()
        st.base = f"{phase}|{kind}|{self.token}"
        self._update(st)

    def _update(self, st) -> None:
        if st.stack:
            kind, region, in_backward = st.stack[-1]
            label = f"{'backward' if in_backward else 'forward'} {region}|{kind}|{self.token}"
        else:
            label = st.base
        if label != st.label:
            st.label = label
            if self.stamp:
                torch.cuda.memory._set_memory_metadata(label)
            if self.on_change is not None:
                self.on_change(label)

    def _pre(self, module, args) -> None:
        kind = self.kinds.get(id(module))
        if kind is None:
            return
        st = self._state()
        in_backward = torch._C._current_graph_task_id() != -1
        outer = st.stack[-1][1] if st.stack else ""
        if in_backward and not st.stack:  # a recompute: it belongs to the layer being backpropagated
            outer = st.base.split("|", 1)[0].removeprefix("backward ")
        if id(module) in self.layers:
            region = f"layer {self.layers[id(module)]}"
        elif id(module) in self.roots:
            region = self.roots[id(module)]
        elif outer.startswith("layer") or (st.stack and st.stack[-1][0] == kind):
            region = outer  # inside a layer, or the same kind as the enclosing module (RoPE in the model)
        else:
            region = _REGION.get(kind, kind)
        st.stack.append((kind, region, in_backward))
        if self.on_root is not None and id(module) in self.roots and not in_backward:
            self.on_root(id(module), True)
        self._update(st)

    def _post(self, module, args, output) -> None:
        if id(module) not in self.kinds:
            return
        st = self._state()
        if st.stack:
            _, region, in_backward = st.stack.pop()
            if id(module) in self.roots and not st.stack:
                st.base = f"forward {region}|transient|{self.token}"  # the loss function runs next
                if self.on_root is not None:
                    self.on_root(id(module), False)
            elif in_backward and id(module) in self.layers:  # recomputed layer: its backward follows
                st.base = f"backward {region}|grad|{self.token}"
            marks = id(module) in self.layers or id(module) in self.roots or id(module) in self.embeddings
            if marks:
                self._mark_backward(output, region)
        self._update(st)

    def _mark_backward(self, output, region: str) -> None:
        tensors = output if isinstance(output, (tuple, list)) else (output,)
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                self._handles.append(t.register_hook(lambda grad: self.set_base(f"backward {region}", "grad")))
                return

    @contextlib.contextmanager
    def installed(self, trainer) -> Iterator[PhaseTracker]:
        """Hooks on for one ``trainer.step()``: also labels gradient finalization and the optimizer."""
        forward_backward, optimizer = trainer.forward_backward, trainer.optimizer
        had_step = "step" in vars(optimizer)
        inner_step = optimizer.step

        def labelled_forward_backward(*args, **kwargs):
            out = forward_backward(*args, **kwargs)
            self.set_base("grad finalize")
            return out

        def labelled_step(*args, **kwargs):
            self.set_base("optimizer step", "optimizer")
            return inner_step(*args, **kwargs)

        self._handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._pre),
            torch.nn.modules.module.register_module_forward_hook(self._post),
        ]
        trainer.forward_backward, optimizer.step = labelled_forward_backward, labelled_step
        self.set_base(BEFORE)
        try:
            yield self
        finally:
            trainer.forward_backward = forward_backward
            if had_step:
                optimizer.step = inner_step
            else:
                del optimizer.step
            for h in self._handles:
                h.remove()
            self._handles = []
            if self.stamp:
                torch.cuda.memory._set_memory_metadata("")


def split_label(label: str) -> tuple[str, str, str]:
    """(phase, kind, token) of a label; the allocator may append lines of its own to the metadata."""
    parts = (label.split("\n", 1)[0].split("|") + ["", "", ""])[:3]
    return parts[0], parts[1], parts[2]


@dataclass
class Trace:
    """Alloc/free events of one step: block ids, bytes, and the phase each event happened in."""

    start: dict[int, int] = field(default_factory=dict)  # block -> bytes alive before the step
    events: list[tuple[int, int, str]] = field(default_factory=list)  # (block or -1, bytes now, phase)
    bucket: dict[int, str] = field(default_factory=dict)  # block -> attribution bucket
    origin: dict[int, str] = field(default_factory=dict)  # block -> phase it was allocated in
    labelled: int = 0  # allocator events stamped by this step's hooks (GPU)


# --- static memory: parameters, gradients, optimizer state ---------------------------------------


def static_tensors(trainer) -> dict[str, list[torch.Tensor]]:
    """This rank's parameters, gradients (``grad``/``main_grad``, megatron DDP's contiguous buffers)
    and optimizer state (torch Adam(W) states; megatron's fp32 main params, also under
    DistributedOptimizer and ChainedOptimizer)."""
    params = [p for c in trainer.chunks for p in c.parameters()]
    grads = [g for p in params for g in (p.grad, getattr(p, "main_grad", None)) if isinstance(g, torch.Tensor)]
    for chunk in trainer.chunks:
        for name in ("buffers", "expert_parallel_buffers"):
            buffers = getattr(chunk, name, None)  # DDP's list (nn.Module.buffers is a method)
            for buf in buffers if isinstance(buffers, list) else []:
                params += [t for t in [getattr(buf, "param_data", None)] if isinstance(t, torch.Tensor)]
                grads += [t for t in [getattr(buf, "grad_data", None)] if isinstance(t, torch.Tensor)]
    state: list[torch.Tensor] = []
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for per_param in getattr(inner, "state", {}).values():
            state += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
        for name in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            for group in getattr(opt, name, None) or []:
                state += [t for t in group if isinstance(t, torch.Tensor)]
    return {"parameters": params, "gradients": grads, "optimizer_state": state}


def _by_address(tensors: dict[str, list[torch.Tensor]]) -> dict[int, str]:
    """CUDA storage base address -> bucket (parameters win over gradients over optimizer state);
    host tensors (Adam's ``step`` counters) are not the allocator's."""
    out: dict[int, str] = {}
    for bucket in STATIC:
        for t in tensors[bucket]:
            ptr = t.untyped_storage().data_ptr() if t.is_cuda else 0
            if ptr:
                out.setdefault(ptr, bucket)
    return out


# --- CPU: storages saved for backward, gradients, optimizer state ---------------------------------


class SavedTensorRecorder:
    """A ``Trace`` from tensors' storages: tracked by identity, freed when their finalizer runs.

    ``first_forward``: bytes by kind of the storages saved during the first forward of each model
    chunk, alive at its end: what ``ActivationLedger`` measures, recorded by these hooks.
    """

    def __init__(self, tracker: PhaseTracker, static: dict[str, list[torch.Tensor]]):
        self.tracker, self.trace = tracker, Trace()
        self._ids = itertools.count()
        self._live: dict[int, list] = {}  # storage._cdata -> [block, weakref, nbytes]
        self._finalizers: list = []
        self.first_forward: dict[str, int] = {k: 0 for k in KINDS}
        self._roots_seen: set[int] = set()
        self._root: int | None = None  # the chunk whose first forward is running
        self._saved: dict[int, weakref.ref] = {}  # its saved blocks
        self._param_ptrs = {t.untyped_storage().data_ptr() for t in static["parameters"]}
        for bucket in STATIC:
            for t in static[bucket]:
                self.track(t.untyped_storage(), bucket, BEFORE, start=True)

    def track(self, storage: torch.UntypedStorage, bucket: str, phase: str, start: bool = False) -> int | None:
        key = storage._cdata
        if key in self._live or not storage.data_ptr():
            return self._live[key][0] if key in self._live else None
        blk, nbytes = next(self._ids), storage.nbytes()
        self._live[key] = [blk, weakref.ref(storage), nbytes]
        self._finalizers.append(weakref.finalize(storage, self._freed, key))
        self.trace.bucket[blk], self.trace.origin[blk] = bucket, phase
        if start:
            self.trace.start[blk] = nbytes
        else:
            self.trace.events.append((blk, nbytes, phase))
        return blk

    def _freed(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.trace.events.append((entry[0], 0, split_label(self.tracker.label())[0]))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage are not memory here
            return t
        if storage.data_ptr() not in self._param_ptrs:
            phase, kind, _ = split_label(self.tracker.label())
            blk = self.track(storage, kind if kind in KINDS else TRANSIENT, phase)
            if self._root is not None and blk is not None:
                self._saved[blk] = weakref.ref(storage)
        return t

    def on_root(self, root: int, entering: bool) -> None:
        if entering:
            self._root = None if root in self._roots_seen else root
            self._roots_seen.add(root)
            self._saved = {}
        elif self._root == root:
            for blk, ref in self._saved.items():
                storage, kind = ref(), self.trace.bucket[blk]
                if storage is not None and kind in KINDS:
                    self.first_forward[kind] += storage.nbytes()
            self._root, self._saved = None, {}

    def grad_hook(self, param: torch.Tensor) -> None:
        self.track(param.grad.untyped_storage(), "gradients", split_label(self.tracker.label())[0])

    def on_label(self, label: str) -> None:
        """At each phase change: a marker event, and storages resized in place (output-discarding
        checkpoints free an output with ``resize_(0)`` and restore it for the recompute)."""
        phase = split_label(label)[0]
        for entry in list(self._live.values()):
            storage = entry[1]()
            if storage is not None and storage.nbytes() != entry[2]:
                entry[2] = storage.nbytes()
                self.trace.events.append((entry[0], entry[2], phase))
        self.trace.events.append((-1, 0, phase))

    def close(self) -> None:
        for fin in self._finalizers:
            fin.detach()
        self._finalizers, self._live = [], {}


def record_cpu(trainer) -> tuple[Trace, dict]:
    """One ``trainer.step()`` traced through its saved tensors, gradients and optimizer state."""
    tracker = PhaseTracker(trainer.chunks)
    recorder = SavedTensorRecorder(tracker, static_tensors(trainer))
    tracker.on_change, tracker.on_root = recorder.on_label, recorder.on_root
    params = [p for c in trainer.chunks for p in c.parameters() if p.requires_grad]
    handles = [p.register_post_accumulate_grad_hook(recorder.grad_hook) for p in params]
    start = time.perf_counter()
    try:
        with tracker.installed(trainer), torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
            trainer.step()
    finally:
        for h in handles:
            h.remove()
        recorder.close()
    return recorder.trace, {"profiled_step_s": time.perf_counter() - start,
                            "ledger_bytes_by_kind": recorder.first_forward}


# --- GPU: the caching allocator's trace ----------------------------------------------------------


def _round(nbytes: int) -> int:
    """The allocator's block rounding (512 bytes): trace entries carry the requested size."""
    return max(512, -(-nbytes // 512) * 512) if nbytes else 0


def allocator_trace(start: dict, end: dict, token: str, static_start: dict[int, str],
                    static_end: dict[int, str], device: int) -> tuple[Trace, int]:
    """A ``Trace`` from two ``_snapshot()``s: live blocks before the step, then the recorded
    alloc/free_requested events (the events ``allocated_bytes`` counts). Returns (trace, frees of
    unknown blocks: non-zero means the history overflowed and the replay is not exact)."""
    trace, ids, live = Trace(), itertools.count(), {}
    for seg in start["segments"]:
        if seg.get("device", device) != device:
            continue
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated":
                b = next(ids)
                live[blk["address"]], trace.start[b] = b, blk["size"]
                trace.bucket[b], trace.origin[b] = static_start.get(blk["address"], TRANSIENT), BEFORE
    phase, unmatched, trace.labelled = BEFORE, 0, 0
    for e in end["device_traces"][device]:
        if e["action"] not in ("alloc", "free_requested"):
            continue
        label_phase, kind, token_ = split_label(e.get("user_metadata") or "")
        if token_ == token:
            phase = label_phase
            trace.labelled += 1
        else:
            kind = TRANSIENT  # not stamped by this step's hooks: keep the last known phase
        if e["action"] == "alloc":
            b = next(ids)
            live[e["addr"]] = b
            trace.bucket[b], trace.origin[b] = (kind if kind in KINDS else TRANSIENT), phase
            trace.events.append((b, _round(e["size"]), phase))
        elif (b := live.pop(e["addr"], None)) is not None:
            trace.events.append((b, 0, phase))
        else:
            unmatched += 1
    for addr, b in live.items():  # allocated during the step and still alive: static memory?
        if trace.origin[b] != BEFORE and addr in static_end:
            trace.bucket[b] = static_end[addr]
    return trace, unmatched


def record_gpu(trainer, snapshot_path: Path | None = None) -> tuple[Trace, dict]:
    """One ``trainer.step()`` traced by the caching allocator (history on for this step only), with
    the numbers the replay is checked against (``max_memory_allocated``, bytes alive at the start).
    ``snapshot_path``: also write the step's snapshot there as ``torch.cuda.memory._dump_snapshot``
    does (a pickle of ``_snapshot()``), the file PyTorch's viewer (pytorch.org/memory_viz) opens."""
    device = torch.cuda.current_device()
    tracker = PhaseTracker(trainer.chunks, stamp=True)
    torch.cuda.synchronize()
    start = torch.cuda.memory._snapshot()
    static_start = _by_address(static_tensors(trainer))
    allocated_at_start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history("all", context=None, max_entries=MAX_ENTRIES, clear_history=True)
    try:
        t0 = time.perf_counter()
        with tracker.installed(trainer):
            trainer.step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        end = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(None)
    peak_allocated = torch.cuda.max_memory_allocated()
    if snapshot_path is not None:
        with open(snapshot_path, "wb") as f:
            pickle.dump(end, f)
    trace, unmatched = allocator_trace(start, end, tracker.token, static_start,
                                       _by_address(static_tensors(trainer)), device)
    info = {"profiled_step_s": elapsed, "max_memory_allocated_bytes": peak_allocated,
            "allocated_at_start_bytes": allocated_at_start, "start_bytes": sum(trace.start.values()),
            "unmatched_frees": unmatched, "trace_entries": len(end["device_traces"][device]),
            "labelled_events": trace.labelled,
            "largest_other_at_start": sorted((n for b, n in trace.start.items() if trace.bucket[b] == TRANSIENT),
                                             reverse=True)[:5]}
    return trace, info
