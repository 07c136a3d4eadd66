"""Activation offload in the estimator: what leaves the device and what the host holds.

Memory. Each offload module (``recipes.offload.MODULES``) is the point megatron wraps in a saved-tensor
hook context; the ledger terms saved inside it (``recipes.predict.activations``) are the ones it
moves. ``point_of`` names each term's point from the code that saves it (``OffloadModule.saves``: the
input norm's tensors for ``attn_norm``, core attention's for ``core_attn``, the projection's input for
``attn_proj``, the expert activation's for ``moe_act``...). A moved term leaves the device (the manager drops its
reference once copied, and releases the point's input explicitly) and its elements go to the host:
a saved view is copied as its own elements (core attention's v is a view of the fused QKV output;
the GLU's gate half of FC1's output), while the device frees the whole storage. Two points can copy
one tensor: under fused attention core attention's output is also the projection's input, so with
``core_attn`` alone it stays on the device (the projection still holds it) and with ``attn_proj`` it
is copied twice and freed. Tensors below ``offload.min_offloaded_tensor_size`` elements stay.

The plan (megatron's ``post_warmup_callback``): after its first step the manager keeps the last
layer's group of each module on the device, so that the first backward does not wait for a copy; a
chunk moves its other layers' groups (modeled per model chunk, as measured for one pipeline stage).

What the copies and the recompute cost a step's time is ``recipes.predict.cost``.
"""

from __future__ import annotations

from recipes.config import typed
from recipes.offload import MODULES, modules_of
from recipes.predict.dims import Dims, Term

#: A host term: (kind, what, bytes kept on the device before offload, bytes copied to the host, the
#: offload module whose group copies it).
HostTerm = tuple[str, str, int, int, str]

def point_of(term: Term, d: Dims, gdn_layer: bool) -> str | None:
    """The offload module whose point saves this term (the first whose ``OffloadModule.saves`` says so),
    or None (saved outside every point). In a GatedDeltaNet layer only the norms' points (``needs``
    any) are modeled."""
    for name, module in MODULES.items():
        if module.saves and (module.needs == "any" or not gdn_layer) and module.saves(term, d):
            return name
    return None


def _element_bytes(what: str, d: Dims) -> int:
    for tag, size in (("(fp32)", 4), ("(int64)", 8), ("(bool)", 1), ("(int32)", 4)):
        if tag in what:
            return size
    return d.e


def host_copy_bytes(term: Term, d: Dims) -> int:
    """What copying this saved term writes to the host. The manager copies every *save* of a tensor
    (a tensor two ops save is copied twice), and a saved view as its own elements."""
    _, what, nbytes = term
    if what == "v" and nbytes:  # a view of the fused QKV output (standard attention)
        return d.e * d.s * d.b * d.ng * d.dv if d.attention_kind != "mla" else nbytes
    if what == "expert fc1 output" and d.model.gated_linear_unit:  # the gate half (chunk's view)
        return nbytes // 2
    if d.attention_kind == "mla":
        if what == "qkv input (norm output)":  # saved by both of MLA's down-projections (q and kv)
            return 2 * nbytes
        if what in ("kv_up input (kv_compressed)", "kv_layernorm input (kv_compressed)"):  # kv_combined's view
            return d.e * d.s_sp * d.b * d.model.kv_lora_rank
    rms_cpu = d.device == "cpu" and d.model.normalization == "RMSNorm"
    if rms_cpu and what.endswith(("norm input", "norm rstd (fp32)")):  # composite: pow and mul save x; rsqrt, mul rstd
        return 2 * nbytes
    if what in ("softmax output", "probabilities") and not d.model.attention_dropout:
        return 2 * nbytes  # softmax saves its output and, without dropout between, the matmul with v again
    return nbytes


def stays_on_device(term: Term, d: Dims) -> bool:
    """A moved term whose storage something else still holds: copied, not freed."""
    what = term[1]
    if what == "causal mask (bool)":  # one mask, cached by the core-attention module for every layer
        return True
    return what == "permuted probs" and "moe_act" in d.labels  # the moe_act checkpoint keeps its inputs


def _context_copied(layer: list[Term]) -> bool:
    """Fused attention: the output projection's input is core attention's output, no term of its own."""
    return not any(t[1] == "linear_proj input (context)" for t in layer)


#: Terms that are several saved tensors of one size: the manager weighs each against its minimum.
_TENSORS_IN_TERM = {"RoPE cos, sin (q and k)": 4}


def _movable(term: Term, d: Dims, min_elements: int) -> bool:
    """A saved term the manager copies: it holds bytes and each of its tensors reaches
    ``min_offloaded_tensor_size`` elements."""
    elements = host_copy_bytes(term, d) // _element_bytes(term[1], d) // _TENSORS_IN_TERM.get(term[1], 1)
    return term[2] > 0 and elements >= min_elements


def _moved_groups(d: Dims, layers: list[list[Term]], gdn: list[bool], wanted: set[str], kept: dict,
                  min_elements: int, fraction: float) -> set[tuple[int, str]]:
    """The (layer, module) groups the manager moves after its warm-up: every group with bytes to move
    but each module's last one, less ``activation_offload_fraction``'s share: megatron disables the
    last ``int(n * (1 - fraction))`` eligible groups in forward order (``post_warmup_callback``),
    keeping the earliest offloaded, whose memory stays free longest."""
    groups = []
    for i, layer in enumerate(layers):
        context_copied = _context_copied(layer)
        for term in layer:  # a layer's terms in forward order: each module's point once
            point = point_of(term, d, gdn[i])
            if (point in wanted and kept.get(point) != i and (i, point) not in groups
                    and _movable(term, d, min_elements)):
                groups.append((i, point))
                # fused attention: the projection's group copies core attention's output, right after
                if (point == "core_attn" and context_copied and "attn_proj" in wanted
                        and kept.get("attn_proj") != i):
                    groups.append((i, "attn_proj"))
    disabled = int(len(groups) * (1 - fraction))
    return set(groups[:len(groups) - disabled])


def offload_layers(d: Dims, layers: list[list[Term]], gdn: list[bool], modules: list[str],
                   min_elements: int, fraction: float = 1.0) -> tuple[list[list[Term]], list[list[HostTerm]]]:
    """One chunk's layers with the offloaded terms off the device, and each layer's host terms.

    Per module, every layer with its point except the chunk's last one (the manager keeps that)."""
    wanted = set(modules)
    has = {m: [i for i, layer in enumerate(layers) if any(point_of(t, d, gdn[i]) == m for t in layer)]
           for m in wanted}
    kept = {m: idx[-1] for m, idx in has.items() if idx}
    moved = _moved_groups(d, layers, gdn, wanted, kept, min_elements, fraction)
    out_layers, hosts = [], []
    for i, layer in enumerate(layers):
        device, host = [], []
        context_copied = _context_copied(layer)
        for term in layer:
            point = point_of(term, d, gdn[i])
            copy = host_copy_bytes(term, d)
            if (i, point) not in moved or not _movable(term, d, min_elements):
                device.append(term)
                continue
            shared_context = point == "core_attn" and term[1] == "output" and context_copied
            if stays_on_device(term, d) or shared_context and (i, "attn_proj") not in moved:
                device.append(term)  # e.g. the projection still holds core attention's output
                host.append((term[0], term[1], 0, copy, point))
                continue
            host.append((term[0], term[1], term[2], copy, point))
            if shared_context:  # the projection copies it again before it is released
                host.append((term[0], "linear_proj input (core attention's output)", 0, copy, "attn_proj"))
        out_layers.append(device)
        hosts.append(host)
    return out_layers, hosts


def group_points(d: Dims, layers: list[list[Term]], gdn: list[bool], modules: list[str]) -> list[list[str]]:
    """Per layer, the offload points of ``modules`` it has, in forward order: each is a group of
    megatron's manager (hooks that commit and reload it), moved or kept. Fused attention saves no
    projection input of its own, yet its projection is a group."""
    out = []
    for i, layer in enumerate(layers):
        has = {point_of(t, d, gdn[i]) for t in layer}
        if "core_attn" in has and _context_copied(layer):
            has.add("attn_proj")
        out.append([p for p in MODULES if p in modules and p in has])  # MODULES: in forward order
    return out


def chunk_offload(cfg: dict, d: Dims, layers: list[list[Term]], global_layers: list[int],
                  gdn_pattern: list[int]) -> tuple[list[list[Term]], list[list[HostTerm]], list[list[str]]]:
    """``offload_layers`` for a run config's ``offload`` group (the layers unchanged without it), and
    each layer's groups (``group_points``)."""
    cfg = typed(cfg)
    modules = modules_of(cfg)
    if not modules:
        return layers, [[] for _ in layers], [[] for _ in layers]
    gdn = [bool(gdn_pattern[g]) for g in global_layers]
    return (*offload_layers(d, layers, gdn, modules, cfg.offload.min_offloaded_tensor_size,
                            cfg.offload.activation_offload_fraction), group_points(d, layers, gdn, modules))
