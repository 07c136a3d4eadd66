"""Predict before you run: activation, parameter, gradient and optimizer bytes per rank.

    python -m recipes estimate model=moe recompute=selective/moe_act size=h200 [--budget-gib 80] [--all]
    make estimate ARGS="model=moe size=h200 --all --budget-gib 80"

Composed with the same Hydra groups as training. Per pipeline rank it adds up one micro-batch's
saved-for-backward bytes by module kind (``recipes.predict.activations``: derived term by term from the code
that runs and checked against ``recipes.measure.ledger`` by ``tests/test_estimate.py``), the micro-batches
1F1B keeps in flight on that stage, parameters, gradients and optimizer state, and a transient
allowance, into a predicted peak. ``predict(cfg)`` is the API for other code; ``rank_options``
ranks every recompute option of the family, before any run (predicted, never measured).
Configurations it does not model (Transformer Engine, context parallel, the alltoall dispatcher,
another family...) are refused by name with a ``ConfigError``.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from fractions import Fraction

from recipes.build.model import resolve_precision
from recipes.build.parallel import pipeline_schedule
from recipes.config import EstimateConfig, compose_config, upgrade
from recipes.errors import ConfigError
from recipes.files import GIB
from recipes.offload import modules_of
from recipes.predict.activations import (
    Dims,
    Term,
    balanced_rows,
    dims,
    embedding_terms,
    global_layer_terms,
    head_terms,
    is_gdn_layer,
    is_moe_layer,
    layer_terms,
    validate_for,
)
from recipes.predict.cost import exposed_transfer_s, flop_positions, layer_forward_s, offload_overhead
from recipes.predict.fit import ALLOCATOR_SLACK, FITS, OVER, TIGHT, slack_for, verdict, with_slack
from recipes.predict.offload import HostTerm, chunk_offload
from recipes.recipe import GPU_BUDGET_GIB, at_full_depth, compose_recipe
from recipes.recompute import (
    ATTENTION_KIND,
    FAMILIES,
    KINDS,
    MLP_KIND,
    chunk_layers,
    gdn_pattern,
    moe_pattern,
    options_for,
    recompute_config,
)
from recipes.results import result_rows


@dataclass
class Chunk:
    """One model chunk (virtual stage) on a rank: its layers' terms and its other terms."""

    index: int  # global chunk index: virtual stage * pp + pipeline stage
    layers: list[list[Term]]  # what stays on the device
    extra: list[Term]
    host: list[list[HostTerm]] = field(default_factory=list)  # per layer: what offload copied to the host
    groups: list[list[str]] = field(default_factory=list)  # per layer: its offload groups' points, in order

    def offload_groups(self) -> list[list[tuple[str, int]]]:
        """Per layer, each offload group's point and the bytes it copies (0: kept on the device)."""
        return [[(point, sum(t[3] for t in host if t[4] == point)) for point in points]
                for points, host in zip(self.groups, self.host)]

    def host_by_kind(self) -> dict[str, int]:
        totals = dict.fromkeys(KINDS, 0)
        for kind, _, _, copied, _ in [t for layer in self.host for t in layer]:
            totals[kind] += copied
        return totals

    def by_kind(self) -> dict[str, int]:
        totals = dict.fromkeys(KINDS, 0)
        for kind, _, nbytes in [t for layer in self.layers for t in layer] + self.extra:
            totals[kind] += nbytes
        return totals


def build_chunk(cfg: dict, d: Dims, index: int, shares: list | None = None) -> Chunk:
    """The terms of model chunk ``index`` (0 holds the embedding, the last the loss). Chunk
    ``index`` holds global layers ``chunk_layers(...)[index]`` (megatron's layer offset), which says which
    layers are GatedDeltaNet or attention, MoE or dense (``global_layer_terms``). ``shares``: each layer's
    routed share (EP: the rows a run recorded), else ``d.routed_share`` for every layer."""
    par, rc = cfg["parallel"], cfg["recompute"]
    num_chunks = par["pipeline_model_parallel_size"] * (par["virtual_pipeline_model_parallel_size"] or 1)
    mine = chunk_layers(cfg["model"], par)[index]
    n = len(mine)
    per = [d] * n if shares is None else [replace(d, routed_share=f if d.ep > 1 else 1) for f in shares]
    extra = embedding_terms(d) if index == 0 else []
    host: list[list[HostTerm]] = []
    groups: list[list[str]] = []
    if not d.full:
        layers = [global_layer_terms(per[i], mine[i]) for i in range(n)]
        layers, host, groups = chunk_offload(cfg, d, layers, list(mine), gdn_pattern(cfg["model"]))
    else:  # a checkpoint keeps its chunk's input (1/tp of it when distributed over TP)
        k = rc["recompute_num_layers"]
        hidden = d.e * d.s_sp * d.b * d.h // (d.tp if rc["distribute_saved_activations"] else 1)
        ckpt = [("other", "full recompute checkpoint input", hidden)]
        if rc["recompute_method"] == "uniform":
            layers = [ckpt if i % k == 0 else [] for i in range(n)]
        else:  # block: the first k layers are checkpointed one by one, the rest keep everything
            layers = [ckpt if i < k else global_layer_terms(per[i], mine[i]) for i in range(n)]
        if d.rope and d.attention_kind != "mla":  # GPTModel's rotary freqs, one storage for all checkpoints
            extra.append(("other", "rotary freqs (fp32, checkpoint input)", 4 * d.s * d.rope))
    if index == num_chunks - 1:
        extra += head_terms(d)
    return Chunk(index, layers, extra, host, groups)


# --- parameters, gradients, optimizer state ----------------------------------------------------------
def num_parameters(cfg: dict, stage: int) -> tuple[int, int]:
    """(dense, expert) parameters held by pipeline rank ``stage`` (one tensor-parallel rank)."""
    m, par = cfg["model"], cfg["parallel"]
    tp, pp, ep = (par[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                   "expert_model_parallel_size"))
    vpp = par["virtual_pipeline_model_parallel_size"] or 1
    h, heads, V = m["hidden_size"], m["num_attention_heads"], m["vocab_size"]
    norm = (2 if m["normalization"] == "LayerNorm" else 1)
    glu = 2 if m["gated_linear_unit"] else 1
    if ATTENTION_KIND[m["family"]] == "mla":
        dq, ql, kvl = m["qk_head_dim"] + m["qk_pos_emb_head_dim"], m["q_lora_rank"], m["kv_lora_rank"]
        q = (h * ql + ql * heads * dq) // tp if ql else h * heads * dq // tp
        attn = q + (h * (kvl + m["qk_pos_emb_head_dim"]) + kvl * heads * (m["qk_head_dim"] + m["v_head_dim"])
                    + heads * m["v_head_dim"] * h) // tp
        attn += norm * ((ql or 0) + kvl) if m["qk_layernorm"] else 0
    else:
        d, groups = m["kv_channels"] or h // heads, m["num_query_groups"] or heads
        attn = (h * (heads + 2 * groups) * d + heads * d * h) // tp
        attn += 2 * norm * d if m["qk_layernorm"] else 0
    experts, moe_mlp = 0, 0
    if m["num_moe_experts"]:
        fe = m["moe_ffn_hidden_size"] or m["ffn_hidden_size"]
        fs = m["moe_shared_expert_intermediate_size"] or 0
        moe_mlp = m["num_moe_experts"] * h + (glu + 1) * h * fs // tp
        experts = m["num_moe_experts"] // ep * (glu + 1) * h * fe
    mlp = (glu + 1) * h * m["ffn_hidden_size"] // tp
    chunks = [v * pp + stage for v in range(vpp)]
    split = chunk_layers(m, par)
    mine = [i for c in chunks for i in split[c]]  # this rank's global layers
    layers = len(mine)
    num_moe = sum(moe_pattern(m)[i] for i in mine)
    num_gdn = sum(gdn_pattern(m)[i] for i in mine)  # GatedDeltaNet mixers in place of attention
    gdn = 0
    if num_gdn:
        nk, nv, dk, dv = (m[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                         "linear_key_head_dim", "linear_value_head_dim"))
        conv = 2 * nk * dk + nv * dv  # in_proj, depthwise conv, dt_bias + A_log, out_proj; out_norm over dv
        gdn = (h * (conv + nv * dv + 2 * nv) + conv * m["linear_conv_kernel_dim"] + 2 * nv + nv * dv * h) // tp
        gdn += norm * dv
    dense = (layers * 2 * norm * h + (layers - num_moe) * mlp + num_moe * moe_mlp
             + (layers - num_gdn) * attn + num_gdn * gdn)
    if 0 in chunks:
        dense += V // tp * h + (cfg["train"]["seq_length"] * h if m["position_embedding_type"] ==
                                "learned_absolute" else 0)
    if pp * vpp - 1 in chunks:
        dense += norm * h + (V // tp * h if m["untie_embeddings_and_output_weights"] or pp > 1 else 0)
    return dense, num_moe * experts


def static_bytes(cfg: dict, device: str, stage: int = 0) -> dict[str, int]:
    """Parameters, gradients and optimizer state on pipeline rank ``stage``.

    GPU (``train.optimizer=auto``): megatron's DistributedOptimizer with bf16 params: bf16 params,
    fp32 gradient buffer (grad_reduce_in_fp32), fp32 main params + Adam m, v sharded over the
    data-parallel size (expert parameters over the expert-data-parallel size): 6 + 12/dp bytes each.
    CPU (or ``optimizer=adamw``): torch AdamW on the params: params, grads, m, v in the param dtype.
    """
    par, launch = cfg["parallel"], cfg["launcher"]
    world = launch["nproc_per_node"] * launch["nnodes"]
    tp, pp, cp, ep = (par[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                       "context_parallel_size", "expert_model_parallel_size"))
    etp = par["expert_tensor_parallel_size"] or tp
    dp, edp = max(1, world // (tp * pp * cp)), max(1, world // (ep * etp * pp))
    dense, experts = num_parameters(cfg, stage)
    params = dense + experts
    p = 2 if resolve_precision(cfg["train"]["precision"], device == "cuda") == "bf16" else 4
    if device == "cuda" and cfg["train"]["optimizer"] == "auto":
        main = 4 * (dense // dp + experts // edp) if p == 2 else 0
        return {"num_parameters": params, "params": p * params, "grads": 4 * params,
                "optimizer": main + 8 * (dense // dp + experts // edp)}
    return {"num_parameters": params, "params": p * params, "grads": p * params, "optimizer": 2 * p * params}


# --- pipeline schedule, peak, the public API ---------------------------------------------------------
def in_flight_chunks(pp: int, vpp: int | None, stage: int, num_microbatches: int) -> list[int]:
    """Virtual stage of each forward whose activations are alive at this stage's first backward.

    1F1B: min(pp - stage, microbatches) forwards. Interleaved 1F1B (megatron's schedule, micro-batch
    group = pp): 2 (pp - stage - 1) + (vpp - 1) pp warm-up forwards plus one, each through one chunk;
    for stage 0 that is p (1 + (p - 1)/(p v)) micro-batches' worth, the paper's interleaving factor.
    The same bookkeeping the worker records (``recipes.build.parallel.pipeline_schedule``).
    """
    return pipeline_schedule(num_microbatches, pp, stage, vpp or 1)["chunk_order"]


def _sum(terms: list[Term]) -> int:
    return sum(t[2] for t in terms)


def transient_bytes(d: Dims, has_head: bool, last_layer_recomputed: bool = True, head_freed: int = 0,
                    last_gdn: bool = False, last_moe: bool | None = None) -> int:
    """Short-lived memory on top of the saved activations (an approximation, not a ledger term).

    The larger of: the loss (bf16 logits / their gradient next to the fp32 softmax, plus the
    gradient of the output layer's input), and the last layer's backward, which runs while every
    other saved activation is still alive: what its recompute re-materializes, plus gradients of
    its largest saved tensor and of that tensor's input. (Full recompute with the block method
    recomputes the first layers, whose backward runs last, when the others' activations are gone.)
    ``head_freed``: the head's saved bytes (final norm, logits), which the loss and output-layer
    backward have already freed when the last layer's backward runs (measured on the H200: without
    it, full recompute was over-predicted by the logits' size on every family). ``last_gdn``: that
    last layer is a GatedDeltaNet layer (model=gdn); ``last_moe``: it has an MoE MLP (None: the family's kind).
    """
    plain = replace(d, labels=frozenset(), full=False)
    layer = layer_terms(plain, last_gdn, last_moe)
    kept = _sum(layer_terms(d, last_gdn, last_moe)) if not d.full else 0
    remat = max(0, _sum(layer) - kept) if last_layer_recomputed else 0
    biggest = max(t[2] for t in layer)
    loss = 0
    if has_head:
        sb = d.s * d.b
        loss = (d.e * sb * d.model["vocab_size"] // d.tp if d.e < 4 else 0) + d.e * sb * d.h
    return max(loss, remat + 2 * biggest - head_freed)


def num_microbatches(cfg: dict) -> int:
    t, par, launch = cfg["train"], cfg["parallel"], cfg["launcher"]
    world = launch["nproc_per_node"] * launch["nnodes"]
    dp = max(1, world // (par["tensor_model_parallel_size"] * par["pipeline_model_parallel_size"]
                          * par["context_parallel_size"]))
    gbs = t["global_batch_size"] or t["micro_batch_size"] * dp
    return max(1, gbs // (t["micro_batch_size"] * dp))


def moe_imbalance(cfg: dict) -> float:
    """The routed share to price an expert-parallel rank at before any run: ``estimate.moe_imbalance``
    (a bound for the worst EP rank), 1 without expert parallel. Results recorded before the field
    existed get its default."""
    if MLP_KIND.get(cfg["model"]["family"]) != "moe" or cfg["parallel"]["expert_model_parallel_size"] == 1:
        return 1.0
    return float((cfg.get("estimate") or {}).get("moe_imbalance", EstimateConfig.moe_imbalance))


def predict(cfg: dict, device: str = "auto", stage: int | None = None,
            routed_share: float | Fraction | list | None = None) -> dict:
    """Predicted (not measured) memory of one rank for the resolved config ``cfg``.

    ``device``: "cuda" (a GPU run: bf16, fused kernels), "cpu" (the CPU run: fp32) or "auto" (this
    machine, as the run itself resolves ``precision=auto``). ``stage``: the pipeline rank to report
    (default: the one with the highest predicted peak). Activation figures are one micro-batch through
    every model chunk of that rank, exactly what ``recipes.measure.ledger`` measures; the peak multiplies by
    the micro-batches in flight and adds static and transient memory.

    ``routed_share`` (expert parallel only: rows routed to this rank's experts over the balanced
    share, ``recipes.predict.activations.routed_rows``): default the bound ``estimate.moe_imbalance``
    (the worst EP rank, ``moe_imbalance``); a number for every layer; or a list, one per layer of
    ``stage`` in chunk order, as a run records them (``compare_result``). Ignored without EP.
    """
    cfg = upgrade(cfg)  # a stored result's config: today's schema
    if routed_share is None:
        routed_share = moe_imbalance(cfg)
    per_layer = isinstance(routed_share, list)
    if per_layer and stage is None:
        raise ValueError("per-layer routed shares belong to one pipeline stage: give stage")
    d = dims(cfg, device, 1 if per_layer else routed_share)
    par = cfg["parallel"]
    pp, vpp = par["pipeline_model_parallel_size"], par["virtual_pipeline_model_parallel_size"]
    m_count = num_microbatches(cfg)
    stages = []
    for st in range(pp):
        n = cfg["model"]["num_layers"] // (pp * (vpp or 1))
        shares = [routed_share[v * n:(v + 1) * n] if per_layer and st == stage else None for v in range(vpp or 1)]
        chunks = [build_chunk(cfg, d, v * pp + st, shares[v]) for v in range(vpp or 1)]
        chunk_bytes = [_sum([t for layer in c.layers for t in layer] + c.extra) for c in chunks]
        order = in_flight_chunks(pp, vpp, st, m_count)
        by_kind = dict.fromkeys(KINDS, 0)
        for c in chunks:
            for kind, nbytes in c.by_kind().items():
                by_kind[kind] += nbytes
        activation = sum(by_kind.values())
        in_flight = sum(chunk_bytes[v] for v in order)
        static = static_bytes(cfg, d.device, st)
        static_total = static["params"] + static["grads"] + static["optimizer"]
        has_head = any(c.index == pp * (vpp or 1) - 1 for c in chunks)
        rc = cfg["recompute"]
        block = d.full and rc["recompute_method"] == "block" and rc["recompute_num_layers"] < len(
            chunks[-1].layers)
        head_freed = _sum(head_terms(d)) if has_head else 0
        last = chunk_layers(cfg["model"], par)[chunks[-1].index][-1]  # its backward runs first
        transient = transient_bytes(d, has_head, last_layer_recomputed=not block, head_freed=head_freed,
                                    last_gdn=is_gdn_layer(d, last), last_moe=is_moe_layer(d, last))
        host_layers = [sum(t[3] for t in layer) for c in chunks for layer in c.host]
        # one layer's groups come back ahead of its backward while the layer after it still holds
        # its own (megatron prefetches one group ahead): the largest reload sits on top
        transient += max((sum(t[2] for t in layer) for c in chunks for layer in c.host), default=0)
        host_by_kind = dict.fromkeys(KINDS, 0)
        for c in chunks:
            for kind, nbytes in c.host_by_kind().items():
                host_by_kind[kind] += nbytes
        host_chunk = [sum(c.host_by_kind().values()) for c in chunks]
        layers = [layer for c in chunks for layer in c.layers]
        stages.append({
            "stage": st, "num_layers": len(layers),
            "activation_bytes_by_kind": by_kind, "activation_bytes": activation,
            "per_layer": [{k: sum(t[2] for t in layer if t[0] == k) for k in KINDS} for layer in layers],
            "layer_terms": layers[0] if layers else [],
            "outside_layers": [t for c in chunks for t in c.extra],
            "in_flight_microbatches": in_flight / activation if activation else 0.0,
            "in_flight_activation_bytes": in_flight,
            "static": static, "static_bytes": static_total, "transient_bytes": transient,
            "peak_bytes": static_total + in_flight + transient,
            "host_bytes_by_kind": host_by_kind, "host_bytes": sum(host_by_kind.values()),
            "in_flight_host_bytes": sum(host_chunk[v] for v in order),
            "host_bytes_per_layer": host_layers,
            "host_groups_per_layer": [len({t[4] for t in layer if t[3] > 0}) for c in chunks for layer in c.host],
            # each layer's copied ledger terms by offload point (a term is a saved tensor, or a few saved
            # together, as the SwiGLU's): what the manager's host work scales with
            "host_terms_per_layer": [dict(Counter(t[4] for t in layer if t[3] > 0)) for c in chunks for layer in c.host],
            # each layer's offload groups in forward order, moved or kept: what the copies queue by
            "offload_groups_per_layer": [g for c in chunks for g in c.offload_groups()],
        })
    pick = stages[stage] if stage is not None else max(stages, key=lambda s: s["peak_bytes"])
    if pick["host_bytes"]:  # the copies' time per step at the assumed rate and link (estimate.*)
        est = cfg.get("estimate") or {}
        tflops, link = est.get("mfu", 0.38) * cfg["measure"]["peak_tflops"], est.get("host_link_gb_s", 50.0)
        overhead = offload_overhead(est)
        pick = {**pick, "offload_transfer": {**exposed_transfer_s(pick["offload_groups_per_layer"], layer_forward_s(
            cfg, tflops), link, m_count, flop_positions(cfg), *overhead), "tflops": tflops,
            "host_link_gb_s": link, "s_per_group": overhead[0], "s_per_gib": overhead[1]}}
    ep = par["expert_model_parallel_size"] > 1 and MLP_KIND.get(cfg["model"]["family"]) == "moe"
    share = None if not ep else [float(f) for f in routed_share] if per_layer else float(routed_share)
    worst = max(stages, key=lambda s: s["peak_bytes"])
    return {**pick, "predicted": True, "device": d.device, "precision": "bf16" if d.e == 2 else "fp32",
            "num_microbatches": m_count, "stages": stages, "routed_share": share,
            "allocator_slack": slack_for(cfg), "worst_stage": worst["stage"],
            "worst_why": worst_rank_reason(cfg, worst, len(stages))}


def planned_host_bytes(cfg: dict, device: str = "auto") -> int | None:
    """The host memory one rank's activation offload is predicted to hold (its micro-batches in
    flight, the worst pipeline stage), for the validator's host-memory check; None without offload
    or for a configuration the estimator does not model (the run itself then decides)."""
    if not modules_of(cfg):
        return None
    try:
        p = predict(cfg, device)
    except ConfigError:
        return None
    return held_host_bytes(p)


def held_host_bytes(p: dict) -> int:
    """The host memory one rank of a prediction holds for offload: its worst pipeline stage's
    micro-batches in flight."""
    return max(st["in_flight_host_bytes"] for st in p["stages"])


def worst_rank_reason(cfg: dict, st: dict, pp: int) -> str:
    """Why pipeline stage ``st`` holds the most: its largest share (micro-batches in flight under 1F1B,
    static memory, the head) and, for MoE, the routed tokens each expert rank keeps (balanced routing)."""
    m, par = cfg["model"], cfg["parallel"]
    static, flight = st["static_bytes"], st["in_flight_activation_bytes"]
    parts = [f"pipeline stage {st['stage']} of {pp} ({st['num_layers']} layers)"]
    if flight >= static:
        parts.append(f"{st['in_flight_microbatches']:.2f} micro-batches in flight (1F1B: the first stage "
                     f"holds min(PP, micro-batches)) = {flight / GIB:.1f} GiB of activations, more than its "
                     f"{static / GIB:.1f} GiB of parameters, gradients and optimizer state")
    else:
        parts.append(f"parameters, gradients and optimizer state {static / GIB:.1f} GiB "
                     f"({st['static']['num_parameters'] / 1e9:.2f} B parameters on this rank) above "
                     f"{flight / GIB:.1f} GiB of in-flight activations ({st['in_flight_microbatches']:.2f} micro-batches)")
    if st["outside_layers"] and any(t[0] == "logits" for t in st["outside_layers"]):
        parts.append("it also computes the loss over the vocabulary")
    vpp, split, pattern = par["virtual_pipeline_model_parallel_size"] or 1, chunk_layers(m, par), moe_pattern(m)
    moe_layers = sum(pattern[i] for v in range(vpp) for i in split[v * pp + st["stage"]])
    if moe_layers:
        ep = par["expert_model_parallel_size"]
        tokens = cfg["train"]["seq_length"] * cfg["train"]["micro_batch_size"] // (
            par["tensor_model_parallel_size"] if par["sequence_parallel"] else 1)
        routed = tokens * m["moe_router_topk"]  # the EP group's tokens x top-k / EP: expected, every EP rank alike
        parts.append(f"each expert rank's {m['num_moe_experts'] // ep} experts receive ~{routed} routed tokens per "
                     f"micro-batch in each of its {moe_layers} MoE layers (balanced routing assumed: a hot expert "
                     "rank holds more)")
    return "; ".join(parts)


def predict_options(cfg: dict, device: str = "cuda") -> tuple[list[tuple[str, dict]], list[tuple[str, str]]]:
    """Every recompute option of the family: (predictions sorted by peak, refused with the reason)."""
    cfg = upgrade(cfg)
    done, refused = [], []
    if cfg["model"]["family"] not in FAMILIES:
        dims(cfg, device)  # refuses the family by name
    # the config as given is refused with the controller's message: each option's refusal below only
    # says why that option does not apply, and a bad model would make every option "not applicable"
    validate_for(cfg, device)
    for option in options_for(cfg["model"]):
        trial = {**cfg, "recompute": recompute_config(option)}
        try:
            done.append((option, predict(trial, device)))
        except ConfigError as err:
            refused.append((option, err.problem))
    return sorted(done, key=lambda x: x[1]["peak_bytes"]), refused


def rank_options(cfg_or_overrides: dict | list[str], device: str = "cuda") -> list[tuple[str, int]]:
    """PREDICTED peak bytes per rank of each applicable recompute option, smallest first.

    For the advisor, before any run: ``cfg_or_overrides`` is a resolved config dict (as
    ``tests/conftest.py::compose`` returns) or a list of Hydra overrides. Nothing is measured.
    """
    cfg = compose_config(cfg_or_overrides) if isinstance(cfg_or_overrides, list) else cfg_or_overrides
    return [(option, p["peak_bytes"]) for option, p in predict_options(cfg, device)[0]]


def recorded_shares(cfg: dict, device: str, rank: dict) -> tuple[list | None, Fraction | None]:
    """The routed shares a run recorded on one rank (``rank["moe_routing"]``, written by the worker):
    (one per layer of the ledger's micro-batch, the timed steps' worst micro-batch over all layers),
    exact fractions of ``balanced_rows``; (None, None) without expert parallel or a record."""
    routing = rank.get("moe_routing") or {}
    if MLP_KIND.get(cfg["model"]["family"]) != "moe" or cfg["parallel"]["expert_model_parallel_size"] == 1 or not routing:
        return None, None
    balanced = balanced_rows(dims(cfg, device))
    ledger = [Fraction(rows, balanced) for rows in routing.get("ledger_rows") or []] or None
    steps, layers = routing.get("max_rows_per_step") or [], routing.get("layers")
    peak = Fraction(max(steps), balanced * layers) if steps and layers else None
    return ledger, peak


def compare_result(result: dict, name: str | None = None) -> list[dict]:
    """Predicted next to measured for every rank of one run (its merged ``result.json``).

    Under expert parallel each rank is priced at the routing it recorded (``recorded_shares``): its
    ledger at the ledger micro-batch's rows per layer (then exact), its peak at the timed steps'
    worst micro-batch; a rank without a record (results before the worker kept one) at balanced
    routing (share 1), never at the before-a-run bound."""
    result = {**result, "config": upgrade(result["config"])}
    rows = []
    ranks = {r.get("rank", i): r for i, r in enumerate(result.get("ranks") or [])}
    for r in result_rows(result):
        if r.status != "ok" or r.ledger_bytes is None:
            continue
        device = "cpu" if (r.device or "cpu") == "cpu" else "cuda"
        cfg, stage = result["config"], r.coords["pp"]
        ledger_share, peak_share = recorded_shares(cfg, device, ranks.get(r.rank) or {})
        p = predict(cfg, device, stage=stage, routed_share=ledger_share or 1)
        peak = p if peak_share is None else predict(cfg, device, stage=stage, routed_share=peak_share)
        ep = p["routed_share"] is not None
        measured_host = ((ranks.get(r.rank) or {}).get("ledger") or {}).get("host_total_bytes")
        rows.append({"name": name or result.get("name"), "recompute": r.recompute, "rank": r.rank, "device": device,
                     "predicted_host_bytes": p["host_bytes"] if measured_host is not None else None,
                     "measured_host_bytes": measured_host,
                     "predicted_ledger_bytes": p["activation_bytes"], "measured_ledger_bytes": r.ledger_bytes,
                     "predicted_peak_gib": peak["peak_bytes"] / GIB, "measured_peak_gib": r.peak_allocated_gib,
                     "routing": None if not ep else "recorded" if ledger_share else "balanced",
                     "ledger_share": _mean(p["routed_share"]) if ep else None,
                     "peak_share": _mean(peak["routed_share"]) if ep else None})
    return rows


def _mean(share: float | list) -> float:
    return sum(share) / len(share) if isinstance(share, list) else share


def format_comparison(rows: list[dict]) -> str:
    """One line per rank: run names whole and the recompute option of each (a short point directory
    may not hold it). Under expert parallel the last column is the routed share each prediction
    used (ledger / peak)."""
    width = max([len(str(r["name"])) for r in rows] + [3]) + 1
    rc = max([len(str(r.get("recompute"))) for r in rows] + [9]) + 1
    ep = any(r.get("routing") for r in rows)
    lines = [f"{'run':{width}s}{'recompute':{rc}s}{'rank':>5s}{'ledger MiB pred':>16s}{'meas':>10s}{'err':>8s}"
             f"{'peak GiB pred':>15s}{'meas':>8s}{'err':>8s}" + ("  routed share (ledger/peak)" if ep else "")]
    for r in rows:
        pl, ml, pk, mk = (r["predicted_ledger_bytes"], r["measured_ledger_bytes"],
                          r["predicted_peak_gib"], r["measured_peak_gib"])
        peak = f"{pk:15.2f}{mk:8.2f}{(pk - mk) / mk:+8.1%}" if mk else f"{pk:15.2f}{'-':>8s}{'-':>8s}"
        share = ""
        if r.get("routing") == "recorded":
            share = f"  {r['ledger_share']:.3f}x / {r['peak_share']:.3f}x (recorded)"
        elif r.get("routing"):
            share = "  1x (balanced: no routing recorded)"
        host = ""
        if r.get("measured_host_bytes") is not None:
            host = (f"  host MiB {r['predicted_host_bytes'] / 2**20:.1f} predicted / "
                    f"{r['measured_host_bytes'] / 2**20:.1f} measured")
        lines.append(f"{str(r['name']):{width}s}{str(r.get('recompute')):{rc}s}{r['rank']:5d}{pl / 2**20:16.1f}{ml / 2**20:10.1f}"
                     f"{(pl - ml) / ml:+8.1%}" + peak + share + host)
    return "\n".join(lines)


# --- command line -----------------------------------------------------------------------------------
def _fmt(nbytes: float, unit: float = 2**20) -> str:
    return "." if nbytes == 0 else f"{nbytes / unit:.1f}" if nbytes >= unit / 10 else "<0.1"


def routing_line(p: dict) -> str | None:
    """How an expert-parallel prediction priced the routed rows (None without EP)."""
    share = p.get("routed_share")
    if share is None:
        return None
    if isinstance(share, list):
        return f"expert parallel: routed rows as recorded, {_mean(share):.3f}x balanced on average over the layers"
    if share == 1:
        return "expert parallel: routed rows at balanced routing (1x), not a bound on the worst EP rank"
    return (f"expert parallel: the worst EP rank, priced at {share:g}x balanced routing: a BOUND "
            "(estimate.moe_imbalance, measured on two H200s after 6 steps at aux-loss 0.01), not an expectation")


def format_prediction(p: dict, title: str, budget_gib: float | None = None, terms: bool = False) -> str:
    """One option: activations per layer by kind, then the rank's static and peak memory."""
    lines = [f"PREDICTED (not measured) memory per rank: {title}",
             f"device {p['device']} ({p['precision']}), pipeline stage {p['stage']} of {len(p['stages'])}: "
             f"{p['num_layers']} layers, {p['in_flight_microbatches']:.2f} micro-batch(es) in flight "
             f"of {p['num_microbatches']} per step"] + ([routing_line(p)] if routing_line(p) else []) + [
             "", "activations saved for backward, one micro-batch (MiB)",
             f"{'layer':12s}" + "".join(f"{k:>10s}" for k in KINDS) + f"{'total':>10s}"]
    rows, start = [], 0
    for i in range(1, len(p["per_layer"]) + 1):  # collapse runs of identical layers
        if i == len(p["per_layer"]) or p["per_layer"][i] != p["per_layer"][start]:
            label = f"{start}" if i - start == 1 else f"{start}-{i - 1} (x{i - start})"
            rows.append((label, p["per_layer"][start]))
            start = i
    outside = dict.fromkeys(KINDS, 0)
    for kind, _, nbytes in p["outside_layers"]:
        outside[kind] += nbytes
    for label, kinds in rows + [("outside", outside), ("total", p["activation_bytes_by_kind"])]:
        lines.append(f"{label:12s}" + "".join(f"{_fmt(kinds[k]):>10s}" for k in KINDS)
                     + f"{_fmt(sum(kinds.values())):>10s}")
    if terms:
        lines += ["", "terms of layer 0 (MiB)"] + [f"  {kind:10s} {what:55s} {_fmt(n):>9s}"
                                                    for kind, what, n in p["layer_terms"] if n]
    st = p["static"]
    lines += ["", f"{'per rank':34s}{'GiB':>8s}",
              f"{'parameters (%.1f M)' % (st['num_parameters'] / 1e6):34s}{st['params'] / GIB:8.2f}",
              f"{'gradients':34s}{st['grads'] / GIB:8.2f}",
              f"{'optimizer state':34s}{st['optimizer'] / GIB:8.2f}",
              f"{'activations in flight':34s}{p['in_flight_activation_bytes'] / GIB:8.2f}",
              f"{'transient (approximate)':34s}{p['transient_bytes'] / GIB:8.2f}",
              f"{'predicted peak':34s}{p['peak_bytes'] / GIB:8.2f}"]
    if p.get("host_bytes"):
        kinds = ", ".join(f"{k} {v / GIB:.2f}" for k, v in p["host_bytes_by_kind"].items() if v)
        lines += [f"offload: copied to host memory per micro-batch {p['host_bytes'] / GIB:.2f} GiB ({kinds}); "
                  f"held on the host (micro-batches in flight) {p['in_flight_host_bytes'] / GIB:.2f} GiB; "
                  f"moved per step {p['host_bytes'] * p['num_microbatches'] / GIB:.2f} GiB each way "
                  "(each micro-batch keeps its last layer of each offloaded module on the device)"]
        t = p.get("offload_transfer")
        if t:
            lines.append(f"offload time per step: copies {t['copy_s'] * 1e3:.1f} ms; stalled waiting for a "
                         f"reload {t['exposed_s'] * 1e3:.1f} ms at a {t['host_link_gb_s']:g} GB/s link and "
                         f"{t['tflops']:.0f} TFLOP/s (estimate.host_link_gb_s, estimate.mfu); the copies' "
                         f"overhead {t['overhead_s'] * 1e3:.1f} ms ({t['s_per_group'] * 1e3:g} ms a group, "
                         f"{t['s_per_gib'] * 1e3:g} ms a GiB moved: estimate.offload_ms_per_group, "
                         "estimate.offload_ms_per_gib)")
    if len(p["stages"]) > 1:
        lines.append("peak per pipeline stage (GiB): " + ", ".join(
            f"pp{st['stage']} {st['peak_bytes'] / GIB:.1f}" for st in p["stages"]))
    lines.append(f"worst rank: {p['worst_why']}")
    if budget_gib is not None:
        lines.append(budget_line(p["peak_bytes"] / GIB, budget_gib, p["allocator_slack"]))
    return "\n".join(lines)


def budget_line(peak_gib: float, budget_gib: float, slack: float = ALLOCATOR_SLACK) -> str:
    """The fit verdict for a budget, with the allocator's slack (recipes.predict.fit: ``slack_for``)."""
    need = with_slack(peak_gib, slack)
    head = f"budget {budget_gib:g} GiB (what PyTorch may reserve), needs {need:.1f} GiB with {slack:.1%} allocator slack: "
    return head + {FITS: f"fits ({budget_gib - need:.1f} GiB to spare)",
                   TIGHT: f"TIGHT: fits only without the slack ({need - budget_gib:.1f} GiB short): expect an OOM",
                   OVER: f"does NOT fit ({peak_gib - budget_gib:.1f} GiB over)"}[verdict(peak_gib, budget_gib, slack)]


def format_options(done: list[tuple[str, dict]], refused: list[tuple[str, str]], title: str,
                   budget_gib: float | None = None) -> str:
    """Every recompute option, sorted by predicted peak."""
    head = f"{'recompute':32s}{'act/mb GiB':>11s}{'in flight':>11s}{'static':>9s}{'peak GiB':>10s}"
    lines = [f"PREDICTED (not measured) peak per rank, every recompute option: {title}"]
    lines += [routing_line(done[0][1])] if done and routing_line(done[0][1]) else []
    lines += [head + (f"{f'fits {budget_gib:g}?':>10s}" if budget_gib is not None else "")]
    for option, p in done:
        row = (f"{option:32s}{p['activation_bytes'] / GIB:11.2f}{p['in_flight_activation_bytes'] / GIB:11.2f}"
               f"{p['static_bytes'] / GIB:9.2f}{p['peak_bytes'] / GIB:10.2f}")
        if budget_gib is not None:
            row += f"{verdict(p['peak_bytes'] / GIB, budget_gib, p['allocator_slack']):>10s}"
        lines.append(row)
    lines += [f"not applicable: {option} ({why})" for option, why in refused]
    if done and len(done[0][1]["stages"]) > 1:
        lines += ["", "peak per pipeline stage (GiB; every TP/DP/EP rank of a stage alike), worst marked *"]
        lines.append(f"{'recompute':32s}" + "".join(f"{f'pp{s}':>8s}" for s in range(len(done[0][1]["stages"]))))
        for option, p in done:
            lines.append(f"{option:32s}" + "".join(
                f"{s['peak_bytes'] / GIB:7.1f}{'*' if s['stage'] == p['worst_stage'] else ' '}" for s in p["stages"]))
    if done:
        lines += ["", f"worst rank ({done[0][0]}): {done[0][1]['worst_why']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipes estimate", description="Predict per-rank memory before a run. "
        "Positional arguments are the Hydra overrides training takes (model=moe recompute=full ...).")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="memory per GPU PyTorch may reserve (137 on an H200): fits, tight or over, with "
                        "the allocator's slack")
    parser.add_argument("--all", action="store_true", help="every recompute option, sorted by peak")
    parser.add_argument("--device", default="cuda", help="cuda (GPU run, bf16; default), cpu or auto")
    parser.add_argument("--terms", action="store_true", help="list the named terms of one layer")
    parser.add_argument("--compare", metavar="DIR", help="predicted next to measured for every "
                        "result.json under DIR (a run or a sweep); overrides are ignored")
    args = parser.parse_args(argv)
    if args.compare:
        from pathlib import Path

        from recipes.files import UnreadableFile, read_json

        rows = []
        for p in sorted(Path(args.compare).rglob("result.json")):
            try:
                rows += compare_result(read_json(p), p.parent.name)
            except UnreadableFile as err:  # named, and the other results still compared
                print(f"warning: skipped {err}", file=sys.stderr)
        print(format_comparison(rows) if rows else f"no completed result.json under {args.compare}")
        return 0 if rows else 1
    title = " ".join(args.overrides) or "(defaults)"
    try:  # recipe=<name>: its published layout and depth (recipes.recipe), whatever GPUs are here
        cfg, notes = compose_recipe(at_full_depth(args.overrides), on_gpu=True)
        for note in notes:
            print(f"[recipe] {note}")
        if args.budget_gib is None and cfg.get("recipe"):
            args.budget_gib = GPU_BUDGET_GIB[cfg["recipe"]["gpu"]]
        if args.all:
            done, refused = predict_options(cfg, args.device)
            print(format_options(done, refused, title, args.budget_gib))
        else:
            print(format_prediction(predict(cfg, args.device), title, args.budget_gib, args.terms))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
