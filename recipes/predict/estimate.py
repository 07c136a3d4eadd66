"""Predict before you run: activation, parameter, gradient and optimizer bytes per rank.

    python -m recipes estimate model=moe recompute=selective/moe_act size=h200 [--budget-gib 80] [--all]

Composed with the same Hydra groups as training. Per pipeline rank it adds up one micro-batch's
saved-for-backward bytes by module kind (``recipes.predict.activations``: derived term by term from the code
that runs and checked against ``recipes.measure.ledger`` by ``tests/test_estimate.py``), the micro-batches
1F1B keeps in flight on that stage, parameters, gradients and optimizer state, and a transient
allowance, into a predicted peak. ``predict(cfg)`` is the API for other code; ``rank_options``
ranks every recompute option of the family, before any run (predicted, never measured). The command
is ``recipes.predict.estimate_command``, what a rank holds besides activations ``recipes.predict.static``,
and the prediction beside a run's measurement ``recipes.predict.compare``. Configurations it does not
model (Transformer Engine, context parallel, the alltoall dispatcher, another family...) are refused by
name with a ``ConfigError``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from fractions import Fraction

from recipes.build.parallel import pipeline_schedule
from recipes.config import compose_config, typed
from recipes.errors import ConfigError
from recipes.files import GIB
from recipes.offload import modules_of
from recipes.predict.activations import embedding_terms, global_layer_terms, head_terms, is_moe_layer, layer_terms
from recipes.predict.copies import exposed_transfer_s, flop_positions, offload_overhead
from recipes.predict.cost import layer_forward_s
from recipes.predict.dims import Dims, Term, dims, validate_for
from recipes.predict.fit import slack_for
from recipes.predict.gdn_terms import is_gdn_layer
from recipes.predict.offload import HostTerm, chunk_offload
from recipes.predict.static import static_bytes
from recipes.recompute import (
    FAMILIES,
    KINDS,
    MLP_KIND,
    chunk_layers,
    gdn_pattern,
    moe_pattern,
    options_for,
    recompute_config,
)


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
    cfg = typed(cfg)
    par, rc = cfg.parallel, cfg.recompute
    num_chunks = par.pipeline_model_parallel_size * (par.virtual_pipeline_model_parallel_size or 1)
    mine = chunk_layers(cfg.model, par)[index]
    n = len(mine)
    per = [d] * n if shares is None else [replace(d, routed_share=f if d.ep > 1 else 1) for f in shares]
    extra = embedding_terms(d) if index == 0 else []
    host: list[list[HostTerm]] = []
    groups: list[list[str]] = []
    if not d.full:
        layers = [global_layer_terms(per[i], mine[i]) for i in range(n)]
        layers, host, groups = chunk_offload(cfg, d, layers, list(mine), gdn_pattern(cfg.model))
    else:  # a checkpoint keeps its chunk's input (1/tp of it when distributed over TP)
        k = rc.recompute_num_layers
        hidden = d.e * d.s_sp * d.b * d.h // (d.tp if rc.distribute_saved_activations else 1)
        ckpt = [("other", "full recompute checkpoint input", hidden)]
        if rc.recompute_method == "uniform":
            layers = [ckpt if i % k == 0 else [] for i in range(n)]
        else:  # block: the first k layers are checkpointed one by one, the rest keep everything
            layers = [ckpt if i < k else global_layer_terms(per[i], mine[i]) for i in range(n)]
        if d.rope and d.attention_kind != "mla":  # GPTModel's rotary freqs, one storage for all checkpoints
            extra.append(("other", "rotary freqs (fp32, checkpoint input)", 4 * d.s * d.rope))
    if index == num_chunks - 1:
        extra += head_terms(d)
    return Chunk(index, layers, extra, host, groups)


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
        loss = (d.e * sb * d.model.vocab_size // d.tp if d.e < 4 else 0) + d.e * sb * d.h
    return max(loss, remat + 2 * biggest - head_freed)


def num_microbatches(cfg: dict) -> int:
    cfg = typed(cfg)
    t, par, launch = cfg.train, cfg.parallel, cfg.launcher
    world = launch.nproc_per_node * launch.nnodes
    dp = max(1, world // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size
                          * par.context_parallel_size))
    gbs = t.global_batch_size or t.micro_batch_size * dp
    return max(1, gbs // (t.micro_batch_size * dp))


def moe_imbalance(cfg: dict) -> float:
    """The routed share to price an expert-parallel rank at before any run: ``estimate.moe_imbalance``
    (a bound for the worst EP rank), 1 without expert parallel. Results recorded before the field
    existed get its default."""
    cfg = typed(cfg)
    if MLP_KIND.get(cfg.model.family) != "moe" or cfg.parallel.expert_model_parallel_size == 1:
        return 1.0
    return float(cfg.estimate.moe_imbalance)


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
    cfg = typed(cfg)  # a stored result's config: upgraded to today's schema
    if routed_share is None:
        routed_share = moe_imbalance(cfg)
    per_layer = isinstance(routed_share, list)
    if per_layer and stage is None:
        raise ValueError("per-layer routed shares belong to one pipeline stage: give stage")
    d = dims(cfg, device, 1 if per_layer else routed_share)
    par = cfg.parallel
    pp, vpp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    m_count = num_microbatches(cfg)
    stages = []
    for st in range(pp):
        n = cfg.model.num_layers // (pp * (vpp or 1))
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
        rc = cfg.recompute
        block = d.full and rc.recompute_method == "block" and rc.recompute_num_layers < len(
            chunks[-1].layers)
        head_freed = _sum(head_terms(d)) if has_head else 0
        last = chunk_layers(cfg.model, par)[chunks[-1].index][-1]  # its backward runs first
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
        est = cfg.estimate
        tflops, link = est.mfu * cfg.measure.peak_tflops, est.host_link_gb_s
        overhead = offload_overhead(est)
        pick = {**pick, "offload_transfer": {**exposed_transfer_s(pick["offload_groups_per_layer"], layer_forward_s(
            cfg, tflops), link, m_count, flop_positions(cfg), *overhead), "tflops": tflops,
            "host_link_gb_s": link, "s_per_group": overhead[0], "s_per_gib": overhead[1]}}
    ep = par.expert_model_parallel_size > 1 and MLP_KIND.get(cfg.model.family) == "moe"
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
    cfg = typed(cfg)
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
    cfg = typed(cfg)
    m, par = cfg.model, cfg.parallel
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
    vpp, split, pattern = par.virtual_pipeline_model_parallel_size or 1, chunk_layers(m, par), moe_pattern(m)
    moe_layers = sum(pattern[i] for v in range(vpp) for i in split[v * pp + st["stage"]])
    if moe_layers:
        ep = par.expert_model_parallel_size
        tokens = cfg.train.seq_length * cfg.train.micro_batch_size // (
            par.tensor_model_parallel_size if par.sequence_parallel else 1)
        routed = tokens * m.moe_router_topk  # the EP group's tokens x top-k / EP: expected, every EP rank alike
        parts.append(f"each expert rank's {m.num_moe_experts // ep} experts receive ~{routed} routed tokens per "
                     f"micro-batch in each of its {moe_layers} MoE layers (balanced routing assumed: a hot expert "
                     "rank holds more)")
    return "; ".join(parts)


def predict_options(cfg: dict, device: str = "cuda") -> tuple[list[tuple[str, dict]], list[tuple[str, str]]]:
    """Every recompute option of the family: (predictions sorted by peak, refused with the reason)."""
    cfg = typed(cfg)  # a stored result's config: upgraded to today's schema
    done, refused = [], []
    if cfg.model.family not in FAMILIES:
        dims(cfg, device)  # refuses the family by name
    # the config as given is refused with the controller's message: each option's refusal below only
    # says why that option does not apply, and a bad model would make every option "not applicable"
    validate_for(cfg, device)
    for option in options_for(cfg.model):
        trial = replace(cfg, recompute=replace(cfg.recompute, **recompute_config(option)))
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
