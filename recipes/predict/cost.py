"""What recompute and activation offload add to a step's time, in seconds: the planner's price of each.

Recompute. ``recompute_s`` prices a recompute option by the forward FLOPs it replays at an achieved
rate, and an elementwise replay by its bytes, checkpoint regions and (host-bound step) kernel
launches. A GPU point that timed its layers' modules (``recipes.measure.moduletime``) prices its
matmul labels and full recompute by what their modules' forward took instead (``measured_replay_s``):
a GEMM replays at its own rate, not the step's average, and a host-bound module at its host time. A
point that also recorded its step's timeline (``module_times["marks"]``) prices the whole option on
it (``timeline_recompute_costs``, ``recipes.predict.replay``): each replayed forward's host and GPU
time inserted where backward runs it, so a replay costs its GPU time where the host leads the GPU,
its host time where the GPU waits for the host, and between the two where the lead is short.

Offload (what moves: ``recipes.predict.offload``). Copies run on their own streams beside compute.
Compute never waits for a copy out (megatron's d2h stream waits for compute, not the reverse): a
group's copy out, ready where its module's forward ends, queues behind the earlier ones. In backward
each group's end (moved or kept) issues the next reload, the last group moved first, which cannot
start before its copy out has finished; the group's module waits for it where its backward begins
(attention's after the MLP's, in the same layer). ``exposed_transfer_s`` plays those queues per
micro-batch and group, from a link bandwidth, each layer's forward time (its FLOPs at the achieved
rate, or as measured; backward twice that) and where each group's module sits in it
(``offload_positions``: by FLOPs, or on the base point's step timeline), for the stall no compute
hides. To that it adds what the copies cost a step that hides them: a time per group moved (a
layer's module: the manager's Python, event records and stream waits each group commit and reload)
and per GiB moved (``estimate.offload_ms_per_group``, ``estimate.offload_ms_per_gib``; fitted to the
dense offload points one H200 measured, docs/offload-log.md), which also lengthens the layers the copies
hide under. Where the base point measured the manager's host work (``offload_ms``),
``timeline_offload_costs`` adds what the step's timeline does not hide of it (an MoE step's host does
not lead its GPU).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from recipes.build.model import resolve_swiglu_fusion
from recipes.config import EstimateConfig
from recipes.measure.flops import layer_forward_flops, mlp_replays_fc2, output_projection_flops, replayed_layer_flops
from recipes.predict.replay import Timeline, stream_pace
from recipes.recompute import ATTENTION_KIND, gdn_pattern, labels_of, moe_pattern, replays_without_output


def layer_forward_s(cfg: dict, tflops: float, module_times: dict | None = None) -> float:
    """One average layer's forward time for one micro-batch: measured, where a point timed its layers
    (on its step timeline, the median of its layers' forwards as the GPU reached them,
    ``layer_spans``; else the mean of the module-time pass's stream times), else at ``tflops``
    achieved TFLOP/s per GPU (its matmul FLOPs, ``recipes.measure.flops``; TP splits them)."""
    spans = layer_spans(module_times, ("",))[""]
    if spans:
        return statistics.median(end - start for start, end, _, _ in spans) / 1e3
    measured = ((module_times or {}).get("forward_ms") or {}).get("")
    if measured:
        return sum(measured) / len(measured) / 1e3
    layer = layer_forward_flops(cfg)
    flops = sum(layer.get(k, 0.0) for k in ("attn_proj", "core_attn", "mlp", "moe"))
    return flops / cfg["parallel"]["tensor_model_parallel_size"] / (tflops * 1e12)


#: What each elementwise label (no matmul) replays per layer it covers and micro-batch, on CUDA with the
#: local spec (counted from megatron-core 0.19.2 and recipes/build): (checkpoint regions, kernels; None:
#: the activation's, one fused or five unfused). ``layernorm``: the input and pre-MLP norms, two
#: ``CheckpointWithoutOutput`` regions of one kernel each (torch's RMSNorm is one fused kernel on CUDA,
#: ``_fused_rms_norm``; the CPU's composite runs six). ``moe_act``: one region, the experts' activation x
#: probs (unfused: silu, the GLU's offset add, the product, the probs product in fp32, the cast back).
#: ``gdn_norm_out``: one region, the gated output norm (norm, silu of the gate, product, cast; approximate).
ELEMENTWISE_REPLAYS = {"layernorm": (2, 2), "moe_act": (1, None), "gdn_norm_out": (1, 4)}


def activation_kernels(model: dict) -> int:
    """Kernels the MLP's activation runs on CUDA: one fused, five unfused SwiGLU, three unfused GeLU
    (``model.bias_activation_fusion`` null: auto)."""
    return 1 if resolve_swiglu_fusion(model, on_gpu=True) else (5 if model["gated_linear_unit"] else 3)


def elementwise_replays(cfg: dict) -> tuple[float, float]:
    """(checkpoint regions, kernels) the run's elementwise labels replay per layer and micro-batch
    (``ELEMENTWISE_REPLAYS``; model=gdn and partial MoE: the average layer)."""
    labels, m = set(labels_of(cfg)), cfg["model"]
    share = {"layernorm": 1.0, "moe_act": sum(moe_pattern(m)) / m["num_layers"],
             "gdn_norm_out": sum(gdn_pattern(m)) / m["num_layers"]}
    act = activation_kernels(m)
    regions, kernels = 0.0, 0.0
    for label, (label_regions, label_kernels) in ELEMENTWISE_REPLAYS.items():
        if label in labels:
            regions += share[label] * label_regions
            kernels += share[label] * (act if label_kernels is None else label_kernels)
    return regions, kernels


def host_bound(cfg: dict) -> bool:
    """A step the host's launch rate bounds: MoE (routing, permutation, many small kernels) and
    MLA; the GPU idles there for a third of a bare MoE step (docs/h200-results.md)."""
    return any(moe_pattern(cfg["model"])) or ATTENTION_KIND[cfg["model"]["family"]] == "mla"


#: MLA's attention modules outside its ``mla_up_proj`` checkpoint: the rest of ``self_attention``'s
#: forward is the up projections, RoPE and the q/k/v assembly the label replays.
MLA_OUTSIDE_UP_PROJ = ("self_attention.core_attention", "self_attention.linear_proj",
                       "self_attention.linear_q_proj", "self_attention.linear_q_down_proj",
                       "self_attention.linear_kv_down_proj", "self_attention.q_layernorm",
                       "self_attention.kv_layernorm")


def measured_replay_s(cfg: dict, module_times: dict) -> dict[str, float]:
    """Seconds one micro-batch's replay of each matmul label (and ``full``, its layers as ``cfg``'s
    recompute method and count say) takes on the rank that timed its modules
    (``recipes.measure.moduletime``): the forward times of the modules the label's checkpoint runs, in
    the layers it covers. A label whose modules were not timed is left out (priced by its FLOPs)."""
    fwd, numbers = module_times.get("forward_ms") or {}, module_times.get("layers") or []
    m = cfg["model"]
    moe, gdn = moe_pattern(m), gdn_pattern(m)

    def total(plus: tuple, minus: tuple, covers) -> float | None:
        if not numbers or any(name not in fwd for name in plus):
            return None
        ms = sum(sum(fwd[n][i] for n in plus) - sum((fwd.get(n) or [0.0] * len(numbers))[i] for n in minus)
                 for i, number in enumerate(numbers) if covers(number - 1, i))
        return max(ms, 0.0) / 1e3

    out = {"full": total(("",), (), _full_covers(cfg, numbers)),
           "mlp": total(("mlp",), () if mlp_replays_fc2(cfg) else ("mlp.linear_fc2",), lambda g, _: not moe[g]),
           "moe": total(("mlp",), (), lambda g, _: moe[g]),
           "shared_experts": total(("mlp.shared_experts",), (), lambda g, _: moe[g])}
    if ATTENTION_KIND[m["family"]] == "mla":
        out["mla_up_proj"] = total(("self_attention",), MLA_OUTSIDE_UP_PROJ, lambda g, _: True)
    out["core_attn"] = total(("self_attention.core_attention",), (), lambda g, _: not gdn[g])
    return {label: s for label, s in out.items() if s is not None}


def _full_covers(cfg: dict, numbers: list[int]):
    """Which of a rank's layers (megatron's layer numbers, in order) full recompute replays: all of them
    (uniform), or the first ``recompute_num_layers`` of each model chunk (block; a chunk is a run of
    consecutive layer numbers)."""
    rc = cfg["recompute"]
    if rc["recompute_method"] != "block":
        return lambda g, i: True
    position, k = [], rc["recompute_num_layers"] or 0
    for i, number in enumerate(numbers):
        position.append(position[-1] + 1 if i and number == numbers[i - 1] + 1 else 0)
    return lambda g, i: position[i] < k


#: Where each label's replay runs, for ``timeline_recompute_costs``: (modules whose forward it replays,
#: modules inside those it does not replay, the module at whose backward start it runs, which layers,
#: the kind of region: ``recipes.measure.regions``); an elementwise label's replay is (no module: its
#: bytes and kernels, ``ELEMENTWISE_REPLAYS``) at each position it names. ``layernorm``'s norms are
#: replayed where the attention's and the MLP's backward begin (megatron registers their recompute on
#: those modules' outputs).
def _placements(cfg: dict) -> list[tuple[tuple, tuple, str, object, str]] | None:
    """The run's recompute as (replayed, not replayed, at, covers(global layer, index), region kind)
    pieces; None where a label has no place on the timeline (``gdn_norm_out``, GDN layers)."""
    rc, m = cfg["recompute"], cfg["model"]
    moe, gdn = moe_pattern(m), gdn_pattern(m)
    if any(gdn):
        return None
    every = lambda g, i: True  # noqa: E731
    if rc["recompute_granularity"] == "full":
        return [(("",), (), "", None, "checkpoint")]  # covers: _full_covers, which needs the rank's layer numbers
    if rc["recompute_granularity"] != "selective":
        return []
    spec = {"mlp": [(("mlp",), () if mlp_replays_fc2(cfg) else ("mlp.linear_fc2",), "mlp", lambda g, i: not moe[g])],
            "moe": [(("mlp",), (), "mlp", lambda g, i: moe[g])],
            "shared_experts": [(("mlp.shared_experts",), (), "mlp.shared_experts", lambda g, i: moe[g])],
            "mla_up_proj": [(("self_attention",), MLA_OUTSIDE_UP_PROJ, "self_attention.core_attention", every)],
            "core_attn": [(("self_attention.core_attention",), (), "self_attention.core_attention", every)],
            "layernorm": [((), (), "self_attention", every), ((), (), "mlp", every)],
            "moe_act": [((), (), "mlp.experts", lambda g, i: moe[g])]}
    if any(label not in spec for label in rc["recompute_modules"]):
        return None
    return [(*piece, "without_output" if replays_without_output(label, rc) else "checkpoint")
            for label in rc["recompute_modules"] for piece in spec[label]]


#: The function an elementwise region replays, by where it runs: a timed module (a norm; its host time
#: on the timeline) or a ``recipes.measure.regions.REGION_FUNCTIONS`` label (its host time in the pass).
ELEMENTWISE_FUNCTION = {"self_attention": "input_layernorm", "mlp": "pre_mlp_layernorm", "mlp.experts": "moe_act"}


def _elementwise_host_ms(tl: Timeline, number: int, at: str, k: int, kernels: int, launch_ms: float) -> float:
    """Host ms the function of an elementwise region replayed at ``at`` takes (its ``k``-th micro-batch):
    as measured where the pass measured regions (a norm's forward on the timeline, the experts'
    activation in the pass: on one H200 a norm took about 56 us and megatron's compiled SwiGLU about
    240), else ``kernels`` x ``launch_ms`` (an eager op's host cost, an order of magnitude)."""
    function = ELEMENTWISE_FUNCTION[at]
    if tl.region_ms is not None:
        if function in tl.region_function_ms:
            return tl.region_function_ms[function]
        spans = tl.forward(number, function)
        if k < len(spans):
            return spans[k][0]
    return kernels * launch_ms


def _timelines(module_times: dict | None) -> list[Timeline]:
    """The step timelines a point's module times hold: one a process (``merge_module_times`` keeps a
    repeated point's as a list), failed passes left out."""
    marks = (module_times or {}).get("marks")
    return [t for t in map(Timeline.of, marks if isinstance(marks, list) else [marks]) if t]


def has_timeline(module_times: dict | None) -> bool:
    """Whether a point's module times hold a step timeline the replays can be priced on."""
    return bool(_timelines(module_times))


def _paced_timelines(module_times: dict | None, numbers: list[int]) -> list[Timeline]:
    """The point's timelines, each with its GPU work read at the pace its stream times give
    (``replay.stream_pace``; a process without one takes its point's others')."""
    timelines = _timelines(module_times)
    forward_ms = (module_times or {}).get("forward_ms") or {}
    paces = [stream_pace(tl, forward_ms, numbers) for tl in timelines]
    known = sorted(p for p in paces if p is not None)
    fallback = known[len(known) // 2] if known else 1.0
    return [tl.scaled(fallback if p is None else p) for tl, p in zip(timelines, paces)]


def timeline_recompute_costs(cfg: dict, module_times: dict, elementwise_s: float = 0.0) -> list[float] | None:
    """Seconds per step the run's recompute adds, from the base point's timeline
    (``recipes.predict.replay``): each replayed forward (its modules' host and GPU time in that layer)
    inserted where its backward runs it, with a checkpoint region's host cost (of its kind, as the pass
    measured it: ``recipes.measure.regions``; before 2026-12-04 19:30 UTC ``estimate.replay_region_ms``);
    an elementwise replay as host work (a region and its function: as measured, ``_elementwise_host_ms``,
    else its kernels at ``estimate.launch_us``) and GPU work (its share of ``elementwise_s``, the elementwise labels' bytes
    a micro-batch). Each timeline's GPU work is read at the pace the point's stream times give
    (``replay.stream_pace``; a process without one takes its point's others'). One price a process
    whose timeline the point kept, sorted; None where the point has no timeline or a label has no
    place on it."""
    pieces, numbers = _placements(cfg), module_times.get("layers") or []
    timelines = _paced_timelines(module_times, numbers)
    if not timelines or pieces is None or not numbers:
        return None
    est, default = cfg.get("estimate") or {}, EstimateConfig()
    region_ms = est.get("replay_region_ms", default.replay_region_ms)
    launch_ms = est.get("launch_us", default.launch_us) / 1e3
    act = activation_kernels(cfg["model"])
    costs = []
    for tl in timelines:
        inserted: dict[int, list[float]] = {}
        elementwise = []
        for replayed, inside, at, covers, kind in pieces:
            covers = covers or _full_covers(cfg, numbers)
            for i, number in enumerate(numbers):
                if not covers(number - 1, i):
                    continue
                spots = tl.where(number, at, "bwd")
                forwards = [tl.forward(number, name) for name in replayed + inside]
                if not spots or any(len(f) != len(spots) for f in forwards[:len(replayed)]):
                    return None  # a module the pass did not time
                lighter = _forward_savings(tl, number, replayed, inside, forwards, len(spots))
                for j, saved in lighter.items():
                    slot = inserted.setdefault(j, [0.0, 0.0])
                    slot[0] -= saved
                region = (tl.region_ms or {}).get(kind, region_ms)
                for k, j in enumerate(spots):
                    host, gpu = region, 0.0
                    for n, f in enumerate(forwards):
                        if len(f) == len(spots):
                            sign = 1.0 if n < len(replayed) else -1.0
                            host, gpu = host + sign * f[k][0], gpu + sign * f[k][1]
                    if not replayed:  # elementwise: one kernel for a norm, the activation's for moe_act
                        host += _elementwise_host_ms(tl, number, at, k, act if at == "mlp.experts" else 1,
                                                     launch_ms)
                        elementwise.append(j)
                    slot = inserted.setdefault(j, [0.0, 0.0])
                    slot[0], slot[1] = slot[0] + max(host, 0.0), slot[1] + max(gpu, 0.0)
        microbatches = max(len(tl.where(numbers[0], "", "bwd")), 1)
        for j in elementwise:
            inserted[j][1] += elementwise_s * 1e3 * microbatches / len(elementwise)
        costs.append(tl.added({j: (h, g) for j, (h, g) in inserted.items()}) / 1e3)
    return sorted(costs)


#: The timed module at whose marks each offload point's group commits (its forward's end) and reloads
#: (its backward's start).
OFFLOAD_MARKS = {"qkv_linear": "self_attention.linear_qkv", "core_attn": "self_attention.core_attention",
                 "attn_proj": "self_attention.linear_proj", "attn_norm": "input_layernorm",
                 "mlp_norm": "pre_mlp_layernorm", "expert_fc1": "mlp.experts", "moe_act": "mlp.experts"}


def timeline_offload_costs(terms_per_layer: list[dict[str, int]], module_times: dict | None) -> list[float] | None:
    """Seconds per step the offload manager's host work adds, from the base point's timeline: each
    moved group's host cost as the pass measured it (``offload_ms``: a group's and each of its
    tensors', ``recipes.measure.regions.offload_host_ms``; a copied ledger term counts as a tensor),
    half where its module's forward ends (the commit) and half where its backward begins (the reload),
    in every micro-batch. It costs step time where the host does not lead the GPU: in a dense h200
    step's forward, and an MoE step's. ``terms_per_layer``: the prediction's ``host_terms_per_layer``
    for this rank's layers. One price a process, sorted; None where the point did not measure it
    (before 2026-12-04, 21:10 UTC) or a point has no mark on the timeline."""
    numbers = (module_times or {}).get("layers") or []
    timelines = _paced_timelines(module_times, numbers)
    if not timelines or len(numbers) != len(terms_per_layer) or any(tl.offload_ms is None for tl in timelines):
        return None
    costs = []
    for tl in timelines:
        group, tensor = tl.offload_ms["group"], tl.offload_ms["tensor"]
        host: dict[int, float] = defaultdict(float)  # ms after each mark
        for number, points in zip(numbers, terms_per_layer):
            for point, n in points.items():
                at = OFFLOAD_MARKS.get(point)
                ends, starts = (tl.where(number, at, "end"), tl.where(number, at, "bwd")) if at else ([], [])
                if not ends or len(ends) != len(starts):
                    return None
                for j in ends + starts:
                    host[j] += (group + n * tensor) / 2
        costs.append(tl.added({j: (ms, 0.0) for j, ms in host.items()}) / 1e3)
    return sorted(costs)


def _forward_savings(tl: Timeline, number: int, replayed: tuple, inside: tuple, forwards: list, spots: int
                     ) -> dict[int, float]:
    """Host ms a checkpoint's first forward saves, at the mark before each replayed forward's end:
    megatron runs the region under ``torch.no_grad`` (no autograd graph; the MoE router skips its aux
    loss), so its host time is the no-grad pass's (``Timeline.forward_nograd``), not the training
    pass's. An MoE step's host is behind the GPU, so this is step time: on one H200 (2026-12-04) the
    32 MoE-layer forwards of a step took 54-102 ms of host with grad and 33-63 without. {} where the
    pass recorded no no-grad forward (a point measured before 2026-12-04, 17:30 UTC)."""
    nograd = [tl.forward_nograd(number, name) for name in replayed + inside]
    ends = tl.where(number, replayed[0], "end") if replayed else []
    if not replayed or len(ends) != spots or any(len(g) != spots for g in nograd[:len(replayed)]):
        return {}
    out = {}
    for k in range(spots):
        saved = 0.0
        for n, (f, g) in enumerate(zip(forwards, nograd)):
            if len(f) == spots and len(g) == spots:
                saved += (1.0 if n < len(replayed) else -1.0) * (f[k][0] - g[k])
        if saved > 0:
            out[ends[k] - 1] = saved
    return out


def recompute_s(cfg: dict, tflops: float, layers: int, microbatches: int, elementwise_bytes: int = 0,
                hbm_gb_s: float = 3000.0, module_times: dict | None = None) -> float:
    """Seconds per step the run's recompute replays (``recompute_by_process_s``)."""
    return recompute_by_process_s(cfg, tflops, layers, microbatches, elementwise_bytes, hbm_gb_s, module_times)[0]


def recompute_by_process_s(cfg: dict, tflops: float, layers: int, microbatches: int, elementwise_bytes: int = 0,
                           hbm_gb_s: float = 3000.0,
                           module_times: dict | None = None) -> tuple[float, list[float] | None]:
    """Seconds per step the run's recompute replays: its replayed forward FLOPs at ``tflops``, or
    where a point measured its layers' modules (``module_times``, ``measured_replay_s``) their forward
    times; the elementwise replays (``moe_act``, ``layernorm``, ``gdn_norm_out``: no matmul) as memory
    traffic, reading their inputs and writing the ``elementwise_bytes`` they rematerialize (one
    micro-batch, the rank's layers) at ``hbm_gb_s``, plus ``estimate.replay_region_ms`` a region
    replayed and, in a host-bound step, ``estimate.launch_us`` a kernel replayed
    (``elementwise_replays``). Where the point also recorded its timeline (``marks``), the whole
    recompute is priced on it instead (``timeline_recompute_costs``: host time where the host is
    behind): the median of its processes' prices, returned with them all (an MoE process's host pace
    moves a replay's cost by that much: 71-108 ms for ``full`` in three processes of one H200 point);
    otherwise with None."""
    rc = cfg["recompute"]
    memory = 2 * elementwise_bytes / (hbm_gb_s * 1e9)
    if module_times and module_times.get("marks"):
        costs = timeline_recompute_costs(cfg, module_times, memory)
        if costs:
            return costs[len(costs) // 2], costs
    measured = measured_replay_s(cfg, module_times) if module_times else {}
    timed, rest = 0.0, rc
    if rc["recompute_granularity"] == "full" and "full" in measured:
        timed, rest = measured["full"], {**rc, "recompute_granularity": None}
    elif rc["recompute_granularity"] == "selective":
        covered = [label for label in rc["recompute_modules"] if label in measured]
        timed = sum(measured[label] for label in covered)
        rest = {**rc, "recompute_modules": [x for x in rc["recompute_modules"] if x not in covered]}
    layer = layer_forward_flops(cfg)
    per_layer = sum(layer.get(k, 0.0) for k in ("attn_proj", "core_attn", "mlp", "moe"))
    replay = replayed_layer_flops({**cfg, "recompute": rest}, layer, per_layer)
    replay /= cfg["parallel"]["tensor_model_parallel_size"]
    est, default = cfg.get("estimate") or {}, EstimateConfig()
    regions, kernels = elementwise_replays(cfg)
    per_kernel = est.get("launch_us", default.launch_us) / 1e6 if host_bound(cfg) else 0.0
    overhead = regions * est.get("replay_region_ms", default.replay_region_ms) / 1e3 + kernels * per_kernel
    return microbatches * (timed + layers * (replay / (tflops * 1e12) + overhead) + memory), None


def offload_overhead(estimate: dict) -> tuple[float, float]:
    """``estimate.offload_ms_per_group`` and ``estimate.offload_ms_per_gib`` in seconds."""
    default = EstimateConfig()
    return (estimate.get("offload_ms_per_group", default.offload_ms_per_group) / 1e3,
            estimate.get("offload_ms_per_gib", default.offload_ms_per_gib) / 1e3)


def fit_offload_rates(priced, measured: list[float], a: float, b: float) -> tuple[float, float] | None:
    """Least squares of ``measured`` (added ms) against ``priced(a, b)`` (the same points' prices, ms, at
    ``a`` ms a group and ``b`` ms a GiB): Gauss-Newton from (a, b), since the stall in a price moves with
    them (the overhead lengthens the layers the copies hide under). None where the points cannot tell
    a group from a GiB."""
    h = 1e-4
    for _ in range(30):
        f = priced(a, b)
        ja = [(x - fi) / h for x, fi in zip(priced(a + h, b), f)]
        jb = [(x - fi) / h for x, fi in zip(priced(a, b + h), f)]
        res = [y - fi for y, fi in zip(measured, f)]
        saa, sab, sbb = sum(x * x for x in ja), sum(x * z for x, z in zip(ja, jb)), sum(z * z for z in jb)
        sar, sbr = sum(x * e for x, e in zip(ja, res)), sum(z * e for z, e in zip(jb, res))
        det = saa * sbb - sab * sab
        if abs(det) < 1e-12:
            return None
        da, db = (sar * sbb - sbr * sab) / det, (saa * sbr - sab * sar) / det
        a, b = a + da, b + db
        if abs(da) < 1e-7 and abs(db) < 1e-6:
            break
    return a, b


def flop_positions(cfg: dict) -> dict[str, tuple[float, float]]:
    """Where each offload point's module starts and ends in a layer's forward, as shares of it, by its
    matmul FLOPs (``layer_forward_flops``): the norms take none; QKV, core attention, the projection,
    then the MLP; in an MoE layer FC1 then the activation and FC2 (megatron commits ``expert_fc1``
    after FC1 and ``moe_act`` after FC2)."""
    layer = layer_forward_flops(cfg)
    proj = output_projection_flops(cfg) if layer.get("core_attn") else 0.0
    qkv, core = max(layer.get("attn_proj", 0.0) - proj, 0.0), layer.get("core_attn", 0.0)
    mlp = layer.get("mlp", 0.0) + layer.get("moe", 0.0)
    total = (qkv + core + proj + mlp) or 1.0
    a, b, c = qkv / total, (qkv + core) / total, (qkv + core + proj) / total
    glu = 2 if cfg["model"]["gated_linear_unit"] else 1
    fc1 = c + (1 - c) * glu / (glu + 1)
    return {"attn_norm": (0.0, 0.0), "qkv_linear": (0.0, a), "core_attn": (a, b), "attn_proj": (b, c),
            "mlp_norm": (c, c), "expert_fc1": (c, fc1), "moe_act": (fc1, 1.0)}


def layer_spans(module_times: dict | None, modules: tuple[str, ...]) -> dict[str, list[tuple[float, float, float, float]]]:
    """Each forward of each of ``modules`` on the point's step timelines (each at its stream pace), in
    every layer and micro-batch: when the GPU reached its layer's forward start and end, and its own
    start and end, ms. Empty lists without a timeline or the module's marks."""
    numbers = (module_times or {}).get("layers") or []
    out: dict[str, list] = {module: [] for module in modules}
    for tl in _paced_timelines(module_times, numbers):
        reached = tl.reached()
        for module in modules:
            for n in numbers:
                marks = zip(*(tl.where(n, name, kind) for name, kind in (("", "pre"), ("", "end"), (module, "pre"),
                                                                        (module, "end"))))
                out[module].extend(tuple(reached[j] for j in js) for js in marks)
    return out


def offload_positions(cfg: dict, module_times: dict | None = None) -> dict[str, tuple[float, float]]:
    """``flop_positions``, with each point's module as the base point's step timeline has it, where it
    has one (the median over layers and micro-batches of where the GPU reached the module's forward
    start and end, as shares of its layer's forward, ``layer_spans``; the experts split between FC1
    and the activation by FLOPs)."""
    flops = flop_positions(cfg)
    out = dict(flops)
    measured = {}
    for module, spans in layer_spans(module_times, tuple(sorted(set(OFFLOAD_MARKS.values())))).items():
        shares = [((a - lo) / (hi - lo), (b - lo) / (hi - lo)) for lo, hi, a, b in spans if hi > lo]
        if shares:
            measured[module] = tuple(statistics.median(x) for x in zip(*shares))
    for point, module in OFFLOAD_MARKS.items():
        if module in measured:
            out[point] = measured[module]
    if "mlp.experts" in measured:  # FC1's share of the experts' FLOPs
        lo, hi = measured["mlp.experts"]
        c, fc1 = flops["expert_fc1"]
        split = lo + (hi - lo) * (fc1 - c) / ((1.0 - c) or 1.0)
        out["expert_fc1"], out["moe_act"] = (lo, split), (split, hi)
    return out


def exposed_transfer_s(groups_per_layer: list[list[tuple[str, int]]], forward_s: float, link_gb_s: float,
                       microbatches: int, positions: dict[str, tuple[float, float]],
                       s_per_group: float = 0.0, s_per_gib: float = 0.0) -> dict:
    """Copy time per step, the stall no compute hides, and the copies' overhead, for one chunk's layers:
    each layer's offload groups in forward order, (point, bytes it copies to the host per micro-batch;
    0 for a group the manager keeps), megatron's manager played per group.

    Overhead: ``s_per_group`` a group moved and ``s_per_gib`` a GiB moved (out and back), whatever
    the link; half of a layer's is spent in its forward (the commits), half in its backward (the
    reloads), and lengthens that layer: its forward takes ``forward_s`` plus its half, its backward
    2 x ``forward_s`` plus the other. A group's module spans ``positions[point]`` (start, end) of its
    layer's forward and the mirror of it in backward. Its copy out is ready at the module's end and
    queues on the device-to-host stream; compute never waits for it. Every group's backward end (moved
    or kept) issues the next reload, the last group moved first (megatron's ``bulk_reload``, one a
    hook); a reload starts once the host-to-device stream is free and its copy out is done, and the
    module's backward waits for it."""
    copy = [[n / (link_gb_s * 1e9) for _, n in layer] for layer in groups_per_layer]
    half = [(s_per_group * sum(1 for _, n in layer if n) + s_per_gib * sum(n for _, n in layer) / 2**30) / 2
            for layer in groups_per_layer]
    out_done, free, now = {}, 0.0, 0.0
    for i, layer in enumerate(groups_per_layer):
        f = forward_s + half[i]
        for k, (point, _) in enumerate(layer):
            if copy[i][k]:
                free = max(free, now + positions[point][1] * f) + copy[i][k]
                out_done[i, k] = free
        now += f
    stack = [(i, k) for i, layer in enumerate(groups_per_layer) for k in range(len(layer)) if copy[i][k]]
    stall, link, back = 0.0, 0.0, {}
    for i in reversed(range(len(groups_per_layer))):
        b, start, shift = 2 * forward_s + half[i], now, 0.0
        for k in reversed(range(len(groups_per_layer[i]))):
            lo, hi = positions[groups_per_layer[i][k][0]]
            if copy[i][k]:  # the module's backward begins: wait for its reload
                due = start + shift + (1 - hi) * b
                if (i, k) not in back:  # no hook issued it yet: the tensors reload as they are unpacked
                    stack.remove((i, k))
                    link = back[i, k] = max(due, link, out_done[i, k]) + copy[i][k]
                shift += max(0.0, back[i, k] - due)
            if stack:  # the module's backward ends: the next reload is issued
                g = stack.pop()
                link = max(start + shift + (1 - lo) * b, link, out_done[g]) + copy[g[0]][g[1]]
                back[g] = link
        stall += shift
        now = start + shift + b
    return {"copy_s": 2 * sum(map(sum, copy)) * microbatches, "exposed_s": stall * microbatches,
            "overhead_s": 2 * sum(half) * microbatches}
