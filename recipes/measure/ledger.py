"""What recompute actually did: checkpoint-region counts and the activation ledger.

``CheckpointCounter`` counts, per recompute label, the checkpoint regions that ran forward and the
ones that were recomputed in backward (megatron's ``CheckpointFunction`` and
``CheckpointWithoutOutput``), attributing each region to a label from the megatron function that
opened it. ``ActivationLedger`` records the bytes saved for backward during one forward pass (unique
storages, via ``torch.autograd.graph.saved_tensors_hooks``), attributed to module kinds, read at the
end of the forward so outputs discarded by output-discarding checkpoints count zero. Both work on a
CPU, which is how CPU tests measure what recompute saves.

With activation offload the ledger's bytes are what stays on the device (``bytes_by_kind``); what
offload copied to the host in that forward is ``host_bytes_by_kind`` (by the kind that saved it). The
offload manager's own saved-tensor hooks hide the tensors saved inside an offload point from the
ledger's; an ``OffloadMeter`` (``recipes.measure.offload``) shows them to it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections import Counter
from collections.abc import Iterator

import torch

from recipes.recompute import KINDS, LABELS

#: (file name, function; None: any) of the code that opens full recompute's checkpoints; each label's
#: are its ``Label.sites``.
_FULL_SITE = ("recompute.py", None)
_SKIP_FILES = {"random.py", "function.py", "ledger.py", "contextlib.py"}


def _site_label() -> str:
    """The recompute label of the checkpoint being opened, from the calling megatron frame."""
    sites = {site: name for name, label in LABELS.items() for site in label.sites}
    sites[_FULL_SITE] = "full"
    frame = sys._getframe(2)
    while frame is not None:
        fname = os.path.basename(frame.f_code.co_filename)
        if fname not in _SKIP_FILES:
            func = frame.f_code.co_name
            label = sites.get((fname, func)) or sites.get((fname, None))
            if label:
                return label
        frame = frame.f_back
    return "unknown"


class CheckpointCounter:
    """Counts checkpoint regions per label: ``forward[label]`` and ``recompute[label]``."""

    def __init__(self) -> None:
        self.forward: Counter = Counter()
        self.recompute: Counter = Counter()
        self._undo: list = []

    def install(self) -> CheckpointCounter:
        # lazy: megatron takes seconds to import; tools that never build a model skip it
        from megatron.core.tensor_parallel import random as r

        counter = self
        cf_fwd, cf_bwd = r.CheckpointFunction.forward, r.CheckpointFunction.backward

        def forward(ctx, run_function, distribute_saved_activations, *args):
            ctx._recipes_label = _site_label()
            counter.forward[ctx._recipes_label] += 1
            return cf_fwd(ctx, run_function, distribute_saved_activations, *args)

        def backward(ctx, *grads):
            counter.recompute[getattr(ctx, "_recipes_label", "unknown")] += 1
            return cf_bwd(ctx, *grads)

        cwo = r.CheckpointWithoutOutput
        cwo_ckpt, cwo_recompute = cwo.checkpoint, cwo._recompute

        def checkpoint(self_, run_function, *args):
            self_._recipes_label = _site_label()
            counter.forward[self_._recipes_label] += 1
            return cwo_ckpt(self_, run_function, *args)

        def _recompute(self_, grad):
            if self_.ctx is not None:
                counter.recompute[getattr(self_, "_recipes_label", "unknown")] += 1
            return cwo_recompute(self_, grad)

        r.CheckpointFunction.forward = staticmethod(forward)
        r.CheckpointFunction.backward = staticmethod(backward)
        cwo.checkpoint, cwo._recompute = checkpoint, _recompute
        self._undo = [
            (r.CheckpointFunction, "forward", staticmethod(cf_fwd)),
            (r.CheckpointFunction, "backward", staticmethod(cf_bwd)),
            (cwo, "checkpoint", cwo_ckpt),
            (cwo, "_recompute", cwo_recompute),
        ]
        return self

    def uninstall(self) -> None:
        for owner, name, value in self._undo:
            setattr(owner, name, value)
        self._undo = []

    def reset(self) -> None:
        self.forward.clear()
        self.recompute.clear()

    def as_dict(self) -> dict:
        labels = sorted(set(self.forward) | set(self.recompute))
        return {l: {"forward": self.forward[l], "recompute": self.recompute[l]} for l in labels}


def module_kinds(root: torch.nn.Module) -> dict[int, str]:
    """Map id(module) -> kind: the innermost classified module decides, children inherit.

    A GatedDeltaNet is one ``gdn`` kind with everything inside it (its output norm too, which is
    what ``gdn_norm_out`` discards), as a linear-attention mixer has no separate core attention.
    """
    kinds: dict[int, str] = {}

    def own_kind(name: str, module: torch.nn.Module) -> str | None:
        leaf = name.rsplit(".", 1)[-1]
        cls = type(module).__name__
        if leaf == "core_attention" or cls.endswith("DotProductAttention"):
            return "core_attn"
        if cls == "GatedDeltaNet":
            return "gdn"
        if "norm" in leaf.lower() or "Norm" in cls:
            return "norm"
        if leaf == "self_attention":
            return "attn_proj"
        if leaf == "mlp":
            return "moe" if "MoE" in cls else "mlp"
        if leaf == "embedding":
            return "embedding"
        if leaf == "output_layer":
            return "logits"
        if cls in ("TransformerBlock", "TransformerLayer", "MoETransformerLayer"):
            return "other"
        return None

    def walk(name: str, module: torch.nn.Module, inherited: str) -> None:
        kind = inherited if inherited == "gdn" else (own_kind(name, module) or inherited)
        kinds[id(module)] = kind
        for child_name, child in module.named_children():
            walk(f"{name}.{child_name}" if name else child_name, child, kind)

    walk("", root, "logits")  # the root model computes the loss from the logits
    return kinds


class ActivationLedger:
    """Bytes saved for backward in one forward pass, by module kind (unique storages).

    Use ``with ledger.record(model_chunks):`` around exactly one microbatch's forward; read
    ``ledger.bytes_by_kind`` after the forward and before its backward (``finish()`` does that).
    Parameters (and anything sharing their storage) are not activations and are excluded.
    """

    def __init__(self) -> None:
        self.bytes_by_kind: dict[str, int] = {}
        self.host_bytes_by_kind: dict[str, int] = {}
        # weak references: holding storages would keep alive what autograd frees during the forward
        self._storages: dict[int, tuple[str, weakref.ref]] = {}
        self._stack: list[str] = []

    @contextlib.contextmanager
    def record(self, chunks: list[torch.nn.Module], meter=None) -> Iterator[ActivationLedger]:
        """Record the forward run inside; ``meter``: the run's ``OffloadMeter`` when offload is on."""
        kinds: dict[int, str] = {}
        for chunk in chunks:
            kinds.update(module_kinds(chunk))
        param_ptrs = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
        self._storages, self._stack = {}, []
        self.host_bytes_by_kind = {k: 0 for k in KINDS}

        def pre_hook(module, args):
            kind = kinds.get(id(module))
            if kind is not None:
                self._stack.append(kind)

        def post_hook(module, args, output):
            if id(module) in kinds and self._stack:
                self._stack.pop()

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            known = self._storages.get(ptr)
            known = known[1]() if known is not None else None
            # a freed storage, or one discarded with resize_(0) (output-discarding checkpoints),
            # frees its address: a new storage there is a different one, not a duplicate
            if ptr and ptr not in param_ptrs and (known is None or known.data_ptr() != ptr):
                self._storages[ptr] = (self._stack[-1] if self._stack else "other", weakref.ref(storage))
            return t

        ledger = self

        class Listener:  # tensors saved inside offload points, and the ones copied to the host
            @staticmethod
            def saved(t: torch.Tensor) -> None:
                pack(t)

            @staticmethod
            def offloaded(t: torch.Tensor, nbytes: int) -> None:
                known = ledger._storages.get(t.untyped_storage().data_ptr())
                kind = known[0] if known else "other"
                ledger.host_bytes_by_kind[kind] = ledger.host_bytes_by_kind.get(kind, 0) + nbytes

        handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(pre_hook),
            torch.nn.modules.module.register_module_forward_hook(post_hook),
        ]
        if meter is not None:
            meter.listeners.append(Listener)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield self
        finally:
            for h in handles:
                h.remove()
            if meter is not None:
                meter.listeners.remove(Listener)
        self.finish()

    def finish(self) -> None:
        """Sum live bytes per kind now (discarded outputs have been resized to 0) and drop refs."""
        totals = {k: 0 for k in KINDS}
        for kind, ref in self._storages.values():
            storage = ref()
            totals[kind] = totals.get(kind, 0) + (storage.nbytes() if storage is not None else 0)
        self.bytes_by_kind = totals
        self._storages = {}

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_kind.values())

    @property
    def host_total_bytes(self) -> int:
        return sum(self.host_bytes_by_kind.values())
