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
Offload's copies: ``recipes.predict.copies``.
"""


from __future__ import annotations

import statistics

from recipes.build.resolve import resolve_swiglu_fusion
from recipes.config import EstimateConfig, typed
from recipes.measure.flops import layer_forward_flops, replayed_layer_flops
from recipes.predict.replay import Timeline, stream_pace
from recipes.recompute import ATTENTION_KIND, LABELS, gdn_pattern, labels_of, moe_pattern, replays_without_output


def layer_forward_s(cfg: dict, tflops: float, module_times: dict | None = None) -> float:
    """One average layer's forward time for one micro-batch: measured, where a point timed its layers
    (on its step timeline, the median of its layers' forwards as the GPU reached them,
    ``layer_spans``; else the mean of the module-time pass's stream times), else at ``tflops``
    achieved TFLOP/s per GPU (its matmul FLOPs, ``recipes.measure.flops``; TP splits them)."""
    cfg = typed(cfg)
    spans = layer_spans(module_times, ("",))[""]
    if spans:
        return statistics.median(end - start for start, end, _, _ in spans) / 1e3
    measured = ((module_times or {}).get("forward_ms") or {}).get("")
    if measured:
        return sum(measured) / len(measured) / 1e3
    layer = layer_forward_flops(cfg)
    flops = sum(layer.get(k, 0.0) for k in ("attn_proj", "core_attn", "mlp", "moe"))
    return flops / cfg.parallel.tensor_model_parallel_size / (tflops * 1e12)


def activation_kernels(model: dict) -> int:
    """Kernels the MLP's activation runs on CUDA: one fused, five unfused SwiGLU, three unfused GeLU
    (``model.bias_activation_fusion`` null: auto)."""
    return 1 if resolve_swiglu_fusion(model, on_gpu=True) else (5 if model["gated_linear_unit"] else 3)


def elementwise_replays(cfg: dict) -> tuple[float, float]:
    """(checkpoint regions, kernels) the run's elementwise labels replay per layer and micro-batch
    (``Label.elementwise``; model=gdn and partial MoE: the average layer, the share of layers it covers)."""
    cfg = typed(cfg)
    labels, m = set(labels_of(cfg)), cfg.model
    act = activation_kernels(m)
    regions, kernels = 0.0, 0.0
    for name, label in LABELS.items():
        if name in labels and label.elementwise:
            label_regions, label_kernels = label.elementwise
            share = sum(label.covers(m)) / m["num_layers"]
            regions += share * label_regions
            kernels += share * (act if label_kernels is None else label_kernels)
    return regions, kernels


def host_bound(cfg: dict) -> bool:
    """A step the host's launch rate bounds: MoE (routing, permutation, many small kernels) and
    MLA; the GPU idles there for a third of a bare MoE step (docs/evidence/h200.md)."""
    cfg = typed(cfg)
    return any(moe_pattern(cfg.model)) or ATTENTION_KIND[cfg.model.family] == "mla"


def measured_replay_s(cfg: dict, module_times: dict) -> dict[str, float]:
    """Seconds one micro-batch's replay of each matmul label (and ``full``, its layers as ``cfg``'s
    recompute method and count say) takes on the rank that timed its modules
    (``recipes.measure.moduletime``): the forward times of the modules the label's checkpoint runs, in
    the layers it covers. A label whose modules were not timed, or that covers no layer, is left out
    (priced by its FLOPs)."""
    cfg = typed(cfg)
    fwd, numbers = module_times.get("forward_ms") or {}, module_times.get("layers") or []
    m = cfg.model

    def total(plus: tuple, minus: tuple, covers) -> float | None:
        if not numbers or any(name not in fwd for name in plus):
            return None
        ms = sum(sum(fwd[n][i] for n in plus) - sum((fwd.get(n) or [0.0] * len(numbers))[i] for n in minus)
                 for i, number in enumerate(numbers) if covers(number - 1, i))
        return max(ms, 0.0) / 1e3

    out = {"full": total(("",), (), _full_covers(cfg, numbers))}
    for name, label in LABELS.items():  # the matmul labels in the layers they cover: Label.timed less Label.untimed
        covers = label.covers(m)
        if label.timed and any(covers):
            out[name] = total(label.timed, label.untimed_modules(cfg), lambda g, _, covers=covers: covers[g])
    return {label: s for label, s in out.items() if s is not None}


def _full_covers(cfg: dict, numbers: list[int]):
    """Which of a rank's layers (megatron's layer numbers, in order) full recompute replays: all of them
    (uniform), or the first ``recompute_num_layers`` of each model chunk (block; a chunk is a run of
    consecutive layer numbers)."""
    rc = cfg.recompute
    if rc["recompute_method"] != "block":
        return lambda g, i: True
    position, k = [], rc["recompute_num_layers"] or 0
    for i, number in enumerate(numbers):
        position.append(position[-1] + 1 if i and number == numbers[i - 1] + 1 else 0)
    return lambda g, i: position[i] < k


def _placements(cfg: dict) -> list[tuple[tuple, tuple, str, str, float | None, object, str]] | None:
    """The run's recompute as (replayed, not replayed, at, function, kernels, covers(global layer, index),
    region kind) pieces, for ``timeline_recompute_costs``: a matmul label replays the forwards of its
    ``Label.timed`` modules less its ``untimed`` ones at each module of its ``Label.at`` (whose backward
    start runs it); an elementwise label replays no module but its ``at`` function there, a region of
    ``kernels`` kernels (``Label.elementwise``; None: the MLP activation's) besides its bytes. The kind
    of region: ``recipes.measure.regions``. None where a label has no place on the timeline (no
    ``at``: ``gdn_norm_out``; GDN layers)."""
    cfg = typed(cfg)
    rc, m = cfg.recompute, cfg.model
    if any(gdn_pattern(m)):
        return None
    if rc["recompute_granularity"] == "full":
        return [(("",), (), "", "", None, None, "checkpoint")]  # covers: _full_covers, which needs the rank's layer numbers
    if rc["recompute_granularity"] != "selective":
        return []
    labels = [LABELS.get(name) for name in rc["recompute_modules"]]
    if any(label is None or not label.at for label in labels):
        return None
    out = []
    for label in labels:
        covers = label.covers(m)
        kind = "without_output" if replays_without_output(label.name, rc) else "checkpoint"
        regions, kernels = label.elementwise or (1, None)
        kernels = None if kernels is None else kernels / regions
        out += [(label.timed, label.untimed_modules(cfg), at, function, kernels,
                 lambda g, i, covers=covers: covers[g], kind) for at, function in label.at]
    return out


def _elementwise_host_ms(tl: Timeline, number: int, function: str, k: int, kernels: float, launch_ms: float) -> float:
    """Host ms an elementwise region's ``function`` (``Label.at``: a timed module, a norm, its host time
    on the timeline; or a ``recipes.measure.regions.REGION_FUNCTIONS`` label, its host time in the pass)
    takes (its ``k``-th micro-batch): as measured where the pass measured regions (a norm's forward on
    the timeline, the experts' activation in the pass: on one H200 a norm took about 56 us and
    megatron's compiled SwiGLU about 240), else ``kernels`` x ``launch_ms`` (an eager op's host cost,
    an order of magnitude)."""
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


def host_wait_ms(module_times: dict | None) -> float | None:
    """The median over a point's processes of how long its measured steps' host waited for the GPU at
    the grad-norm read (``Timeline.host_wait_ms``), or None where no process recorded it (older
    records): the margin added host work is priced against."""
    waits = sorted(tl.host_wait_ms for tl in _timelines(module_times) if tl.host_wait_ms is not None)
    return waits[len(waits) // 2] if waits else None


def paced_timelines(module_times: dict | None, numbers: list[int]) -> list[Timeline]:
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
    measured it: ``recipes.measure.regions``; where it did not, ``estimate.replay_region_ms``),
    its forward's part where the region's first module starts (where the pass measured that part);
    an elementwise replay as host work (a region and its function: as measured, ``_elementwise_host_ms``,
    else its kernels at ``estimate.launch_us``) and GPU work (its share of ``elementwise_s``, the elementwise labels' bytes
    a micro-batch). Each timeline's GPU work is read at the pace the point's stream times give
    (``replay.stream_pace``; a process without one takes its point's others'). One price a process
    whose timeline the point kept, sorted; None where the point has no timeline or a label has no
    place on it."""
    cfg = typed(cfg)
    pieces, numbers = _placements(cfg), module_times.get("layers") or []
    timelines = paced_timelines(module_times, numbers)
    if not timelines or pieces is None or not numbers:
        return None
    est, default = cfg.estimate, EstimateConfig()
    region_ms = est.get("replay_region_ms", default.replay_region_ms)
    launch_ms = est.get("launch_us", default.launch_us) / 1e3
    act = activation_kernels(cfg.model)
    costs = []
    for tl in timelines:
        inserted: dict[int, list[float]] = {}
        elementwise = []
        for replayed, inside, at, function, kernels, covers, kind in pieces:
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
                ahead = min((tl.region_forward_ms or {}).get(kind, 0.0), region)
                starts = tl.where(number, replayed[0] if replayed else function, "pre") or \
                    tl.where(number, at, "pre")
                if ahead and len(starts) == len(spots):  # the region's forward machinery, where it runs
                    for j in starts:
                        inserted.setdefault(j, [0.0, 0.0])[0] += ahead
                    region -= ahead
                for k, j in enumerate(spots):
                    host, gpu = region, 0.0
                    for n, f in enumerate(forwards):
                        if len(f) == len(spots):
                            sign = 1.0 if n < len(replayed) else -1.0
                            host, gpu = host + sign * f[k][0], gpu + sign * f[k][1]
                    if not replayed:  # elementwise: one kernel for a norm, the activation's for moe_act
                        host += _elementwise_host_ms(tl, number, function, k, act if kernels is None else kernels,
                                                     launch_ms)
                        elementwise.append(j)
                    slot = inserted.setdefault(j, [0.0, 0.0])
                    slot[0], slot[1] = slot[0] + max(host, 0.0), slot[1] + max(gpu, 0.0)
        microbatches = max(len(tl.where(numbers[0], "", "bwd")), 1)
        for j in elementwise:
            inserted[j][1] += elementwise_s * 1e3 * microbatches / len(elementwise)
        costs.append(tl.added({j: (h, g) for j, (h, g) in inserted.items()}) / 1e3)
    return sorted(costs)


def _forward_savings(tl: Timeline, number: int, replayed: tuple, inside: tuple, forwards: list, spots: int
                     ) -> dict[int, float]:
    """Host ms a checkpoint's first forward saves, at the mark before each replayed forward's end:
    megatron runs the region under ``torch.no_grad`` (no autograd graph; the MoE router skips its aux
    loss), so its host time is the no-grad pass's (``Timeline.forward_nograd``), not the training
    pass's. An MoE step's host is behind the GPU, so this is step time: on one H200 the
    32 MoE-layer forwards of a step took 54-102 ms of host with grad and 33-63 without. {} where the
    pass recorded no no-grad forward (an older record)."""
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
    cfg = typed(cfg)
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
    cfg = typed(cfg)
    rc = cfg.recompute
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
    replay /= cfg.parallel.tensor_model_parallel_size
    est, default = cfg.estimate, EstimateConfig()
    regions, kernels = elementwise_replays(cfg)
    per_kernel = est.get("launch_us", default.launch_us) / 1e6 if host_bound(cfg) else 0.0
    overhead = regions * est.get("replay_region_ms", default.replay_region_ms) / 1e3 + kernels * per_kernel
    return microbatches * (timed + layers * (replay / (tflops * 1e12) + overhead) + memory), None


def layer_spans(module_times: dict | None, modules: tuple[str, ...]) -> dict[str, list[tuple[float, float, float, float]]]:
    """Each forward of each of ``modules`` on the point's step timelines (each at its stream pace), in
    every layer and micro-batch: when the GPU reached its layer's forward start and end, and its own
    start and end, ms. Empty lists without a timeline or the module's marks."""
    numbers = (module_times or {}).get("layers") or []
    out: dict[str, list] = {module: [] for module in modules}
    for tl in paced_timelines(module_times, numbers):
        reached = tl.reached()
        for module in modules:
            for n in numbers:
                marks = zip(*(tl.where(n, name, kind) for name, kind in (("", "pre"), ("", "end"), (module, "pre"),
                                                                        (module, "end"))))
                out[module].extend(tuple(reached[j] for j in js) for js in marks)
    return out
