"""Resolve recompute labels against the built model: no label may be accepted and ignored.

megatron-core decides at build time, module by module, whether a label applies (attributes such as
``Attention.checkpoint_core_attention`` or ``TransformerLayer.recompute_mlp``) and silently does
nothing where it does not. ``resolve_labels`` reads those attributes back, so the worker can refuse
a label that wraps no module before training. ``labels_disabled`` flips them off for one
micro-batch, which gives each run its own in-process control ledger: the bytes a label saves are
measured inside the run, not inferred.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from recipes.recompute import LABELS


class LabelError(ValueError):
    """A requested label wraps nothing in the built model."""


def _flag_owners(chunks: list[torch.nn.Module], label: str) -> list[tuple[str, torch.nn.Module, str]]:
    """(module name, module, attribute) for every module that carries one of the label's flags."""
    owners = []
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if type(module).__name__ == "TransformerBlock":
                continue  # its checkpoint_core_attention only forwards a hint to TE attention
            record = LABELS[label]
            if record.owner_attr and getattr(module, record.owner_attr, None) is None:
                continue  # e.g. an MoE layer without shared experts keeps shared_experts_recompute
            for attr in record.flags:
                if isinstance(module.__dict__.get(attr), bool):
                    owners.append((name, module, attr))
    return owners


def resolve_labels(chunks: list[torch.nn.Module], labels: list[str]) -> dict[str, dict]:
    """For each requested selective label: how many modules it wraps here, and which."""
    resolved = {}
    for label in labels:
        if label not in LABELS:
            raise LabelError(f"recompute label {label!r} is not supported here")
        on = [(n, a) for n, m, a in _flag_owners(chunks, label) if getattr(m, a)]
        resolved[label] = {"wraps": len(on), "modules": [f"{n}.{a}" for n, a in on[:6]]}
    return resolved


def check_resolved(resolved: dict[str, dict]) -> None:
    """Refuse labels that wrap nothing (megatron would accept them and recompute nothing)."""
    empty = [label for label, info in resolved.items() if info["wraps"] == 0]
    if empty:
        reasons = "; ".join(f"{label}: {LABELS[label].wraps_nothing}" for label in empty)
        raise LabelError(f"recompute label(s) {', '.join(empty)} wrap no module in this model "
                         f"(a silent no-op): {reasons}")


@contextlib.contextmanager
def labels_disabled(chunks: list[torch.nn.Module], labels: list[str]) -> Iterator[None]:
    """Turn the given labels' flags off (the matched control) for the duration of the block."""
    flipped = []
    for label in labels:
        for _, module, attr in _flag_owners(chunks, label):
            if getattr(module, attr):
                setattr(module, attr, False)
                flipped.append((module, attr))
    try:
        yield
    finally:
        for module, attr in flipped:
            setattr(module, attr, True)


@contextlib.contextmanager
def recompute_disabled(chunks: list[torch.nn.Module], config) -> Iterator[None]:
    """The model's whole recompute option off for the block, as if built with ``recompute=none``:
    every selective label's flags (``labels_disabled``) and full recompute, which megatron's
    ``TransformerBlock`` reads from the shared ``TransformerConfig`` at each forward
    (``config.recompute_granularity == 'full'``). A step inside and one outside then differ only by
    the recompute, in one process at one host pace (what a paired step-time comparison needs)."""
    full = config.recompute_granularity == "full"
    if full:
        config.recompute_granularity = None
    try:
        with labels_disabled(chunks, list(LABELS)):
            yield
    finally:
        if full:
            config.recompute_granularity = "full"


def label_findings(result: dict, labels: list[str]) -> list[str]:
    """Per label: did its checkpoint regions run and recompute, and what did it save vs control?

    Fills ``result["labels"][label]`` with the counts and saved bytes, and returns warnings for
    labels that ran but saved (almost) nothing, so the user sees it (e.g. core_attn under SDPA).
    """
    warnings = []
    ledger = result.get("ledger") or {}
    control = ledger.get("control_total_bytes")
    total = ledger.get("total_bytes")
    alone = ledger.get("without_label_total_bytes") or {}
    for label in labels:
        info = result["labels"].setdefault(label, {})
        counts = (result.get("checkpoints") or {}).get(label, {"forward": 0, "recompute": 0})
        info.update(forward=counts["forward"], recompute=counts["recompute"])
        if control is not None and total is not None:
            base = alone.get(label, control)  # this label switched off, the others kept on
            info["saved_bytes"] = base - total
            info["saved_fraction_of_control"] = (base - total) / control if control else 0.0
        if counts["forward"] == 0 or counts["recompute"] == 0:
            warnings.append(f"{label}: wraps {info.get('wraps', 0)} module(s) but ran "
                            f"{counts['forward']} forward / {counts['recompute']} recompute region(s)")
        elif info.get("saved_fraction_of_control", 1.0) < 0.01:
            warnings.append(f"{label}: recomputed {counts['recompute']} region(s) per step but saved "
                            f"{info.get('saved_bytes', 0) / 2**20:.2f} MiB "
                            f"({info['saved_fraction_of_control']:.1%} of the control's activations): "
                            "it costs time for nothing here (e.g. fused/SDPA attention already "
                            "rematerializes its internals)")
        info["flagged"] = any(w.startswith(label + ":") for w in warnings)
    return warnings
