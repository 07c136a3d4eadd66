"""What activation offload's copies add to a step, in seconds: the planner's price of an offload option.

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
dense offload points one H200 measured, docs/offload.md), which also lengthens the layers the copies
hide under. Where the base point measured the manager's host work (``offload_ms``),
``timeline_offload_costs`` adds what the step's timeline does not hide of it (an MoE step's host does
not lead its GPU).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from recipes.config import EstimateConfig, typed
from recipes.measure.flops import layer_forward_flops, output_projection_flops
from recipes.offload import MODULES
from recipes.predict.cost import layer_spans, paced_timelines


def timeline_offload_costs(terms_per_layer: list[dict[str, int]], module_times: dict | None) -> list[float] | None:
    """Seconds per step the offload manager's host work adds, from the base point's timeline: each
    moved group's host cost as the pass measured it (``offload_ms``: a group's and each of its
    tensors', ``recipes.measure.regions.offload_host_ms``; a copied ledger term counts as a tensor),
    half where its module's forward ends (the commit) and half where its backward begins (the reload),
    in every micro-batch. It costs step time where the host does not lead the GPU: in a dense h200
    step's forward, and an MoE step's. ``terms_per_layer``: the prediction's ``host_terms_per_layer``
    for this rank's layers. One price a process, sorted; None where the point did not measure it
    (an older record) or a point has no mark on the timeline."""
    numbers = (module_times or {}).get("layers") or []
    timelines = paced_timelines(module_times, numbers)
    if not timelines or len(numbers) != len(terms_per_layer) or any(tl.offload_ms is None for tl in timelines):
        return None
    costs = []
    for tl in timelines:
        group, tensor = tl.offload_ms["group"], tl.offload_ms["tensor"]
        host: dict[int, float] = defaultdict(float)  # ms after each mark
        for number, points in zip(numbers, terms_per_layer):
            for point, n in points.items():
                at = MODULES[point].mark if point in MODULES else None
                ends, starts = (tl.where(number, at, "end"), tl.where(number, at, "bwd")) if at else ([], [])
                if not ends or len(ends) != len(starts):
                    return None
                for j in ends + starts:
                    host[j] += (group + n * tensor) / 2
        costs.append(tl.added({j: (ms, 0.0) for j, ms in host.items()}) / 1e3)
    return sorted(costs)


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
    matmul FLOPs (``layer_forward_flops``): its ``OffloadModule.span`` between the boundaries of QKV,
    core attention, the projection, then the MLP (the norms take none); in an MoE layer FC1 then the
    activation and FC2."""
    cfg = typed(cfg)
    layer = layer_forward_flops(cfg)
    proj = output_projection_flops(cfg) if layer.get("core_attn") else 0.0
    qkv, core = max(layer.get("attn_proj", 0.0) - proj, 0.0), layer.get("core_attn", 0.0)
    mlp = layer.get("mlp", 0.0) + layer.get("moe", 0.0)
    total = (qkv + core + proj + mlp) or 1.0
    a, b, c = qkv / total, (qkv + core) / total, (qkv + core + proj) / total
    glu = 2 if cfg.model.gated_linear_unit else 1
    fc1 = c + (1 - c) * glu / (glu + 1)
    bounds = {"start": 0.0, "qkv": a, "core_attn": b, "attention": c, "fc1": fc1, "end": 1.0}
    return {name: (bounds[m.span[0]], bounds[m.span[1]]) for name, m in MODULES.items() if m.span}


def offload_positions(cfg: dict, module_times: dict | None = None) -> dict[str, tuple[float, float]]:
    """``flop_positions``, with each point's module as the base point's step timeline has it, where it
    has one (the median over layers and micro-batches of where the GPU reached the module's forward
    start and end, as shares of its layer's forward, ``layer_spans``; points sharing a mark, the
    experts' FC1 and activation, split its span by their FLOPs)."""
    cfg = typed(cfg)
    flops = flop_positions(cfg)
    out = dict(flops)
    marks = {m.mark for name, m in MODULES.items() if m.mark and name in flops}
    measured = {}
    for module, spans in layer_spans(module_times, tuple(sorted(marks))).items():
        shares = [((a - lo) / (hi - lo), (b - lo) / (hi - lo)) for lo, hi, a, b in spans if hi > lo]
        if shares:
            measured[module] = tuple(statistics.median(x) for x in zip(*shares))
    for mark, (lo, hi) in measured.items():
        points = {name: flops[name] for name, m in MODULES.items() if m.mark == mark and name in flops}
        first, last = min(a for a, _ in points.values()), max(b for _, b in points.values())
        for name, (a, b) in points.items():  # each point's FLOP share of the mark's measured span
            out[name] = (lo if a == first else lo + (hi - lo) * (a - first) / ((last - first) or 1.0),
                         hi if b == last else lo + (hi - lo) * (b - first) / ((last - first) or 1.0))
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
