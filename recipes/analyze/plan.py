"""One planner over recompute and activation offload: every combination, priced in seconds per step.

Recompute buys memory with replayed forward work; offload buys it with copies to host memory that
run beside compute. ``plan`` predicts, for a per-rank budget, every recompute option x every offload
option megatron-core allows together (``recipes.offload.rule_problem``: no expert offload inside a
whole-``moe`` recompute, no offload with full recompute, ...), its peak with the allocator's slack
(``recipes.predict.fit``), and its added step time in one unit: the replayed FLOPs at the achieved
rate, plus the copy time compute does not hide (``recipes.predict.cost``). The choice is the
fitting combination predicted fastest (ties: no offload, the guide's recompute order, fewer
modules); the runner-up is the next one, and both are worth one sweep to confirm.

The rate and the link: ``estimate.mfu`` x ``measure.peak_tflops`` and ``estimate.host_link_gb_s``
before a run; a measured sweep's own achieved TFLOP/s and recorded link bandwidth when it has them,
and its base point's module forward times (``measure.module_times``), which price the matmul labels'
and full recompute's replays as measured, or, where the base point recorded its step's timeline,
every recompute option on that timeline (host time included: ``recipes.predict.replay``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from recipes.config import EstimateConfig, MeasureConfig, OffloadConfig, RecomputeConfig, typed
from recipes.errors import ConfigError
from recipes.files import GIB
from recipes.hardware import Profile, check_cluster, cluster_of, resolve_profile
from recipes.offload import offload_config, option_modules, rule_problem
from recipes.offload import options_for as offload_options
from recipes.predict.copies import exposed_transfer_s, offload_overhead, offload_positions, timeline_offload_costs
from recipes.predict.cost import has_timeline, host_wait_ms, layer_forward_s, recompute_by_process_s
from recipes.predict.estimate import held_host_bytes, num_microbatches, predict
from recipes.predict.fit import FITS, TIGHT, allocator_overrides, fits, slack_for, verdict
from recipes.recompute import LABELS, guide_order, is_full, option_of, options_for, recompute_config, selective_labels
from recipes.validate.offload import host_memory_problem
from recipes.validate.recompute import layers_per_chunk

#: Added step times closer than this (seconds) are a tie: the simpler plan wins.
SAME_TIME_S = 1e-4
#: Labels that replay elementwise work only (no matmul): priced as memory traffic and their replays.
ELEMENTWISE = frozenset(name for name, label in LABELS.items() if label.elementwise)


#: The share of the HBM's spec bandwidth elementwise replays run at (3000 of the H200's 4800 GB/s).
HBM_SHARE = 3000.0 / 4800.0


def on_hardware(cfg: dict, profile: Profile, cluster: dict | None = None) -> dict:
    """``cfg`` with the profile's figures where the config keeps the schema's defaults (an explicit
    ``estimate.*`` or ``measure.peak_tflops`` wins): the bf16 peak, the host link, the HBM bandwidth, a
    measured offload manager's cost a group; and the cluster's GPUs per node and nodes."""
    cfg = typed(cfg)
    est, default, measure = cfg.estimate, EstimateConfig(), cfg.measure
    if measure.peak_tflops == MeasureConfig().peak_tflops:
        measure = replace(measure, peak_tflops=float(profile.bf16_tflops))
    if est.host_link_gb_s == default.host_link_gb_s:
        est = replace(est, host_link_gb_s=float(profile.host_link_gb_s))
    if est.hbm_gb_s == default.hbm_gb_s:
        est = replace(est, hbm_gb_s=round(profile.hbm_gb_s * HBM_SHARE, 1))
    if profile.offload_ms_per_group is not None and est.offload_ms_per_group == default.offload_ms_per_group:
        est = replace(est, offload_ms_per_group=profile.offload_ms_per_group)
    out = replace(cfg, estimate=est, measure=measure)
    if cluster:
        out = replace(out, launcher=replace(cfg.launcher, nproc_per_node=cluster["gpus_per_node"],
                                            nnodes=cluster["nodes"]))
    return out


def rates(cfg: dict, tflops: float | None = None, link_gb_s: float | None = None) -> tuple[float, float]:
    """(achieved TFLOP/s per GPU, host-link GB/s): given, else the config's ``estimate`` assumptions."""
    cfg = typed(cfg)
    return tflops or cfg.estimate.mfu * cfg.measure.peak_tflops, link_gb_s or cfg.estimate.host_link_gb_s


def fewest_block_layers(cfg: dict, rc: Any, budget_gib: float) -> tuple[RecomputeConfig, dict]:
    """full/block with the fewest layers per stage (recompute_num_layers) whose predicted peak fits.
    Its peak falls linearly in the layers recomputed (H200, Run E: 4 of 8 layers land on the midpoint
    of the control and uniform full recompute in every family), and so does its replay; when no count
    fits, every layer."""
    cfg = typed(cfg)
    rc = rc if isinstance(rc, RecomputeConfig) else replace(cfg.recompute, **rc)
    for k in range(1, layers_per_chunk(cfg) + 1):
        trial = replace(rc, recompute_num_layers=k)
        p = predict(replace(cfg, recompute=trial), "cuda")
        if fits(p["peak_bytes"] / GIB, budget_gib, p["allocator_slack"]):
            break
    return trial, p


#: The shares of offload groups the planner tries below 1 (megatron's ``activation_offload_fraction``).
OFFLOAD_FRACTIONS = (0.25, 0.5, 0.75)


def smallest_offload_fraction(cfg: dict, budget_gib: float) -> tuple[float, dict] | None:
    """For an offload plan that fits moving every group: the smallest ``activation_offload_fraction``
    (of ``OFFLOAD_FRACTIONS``) that still fits, with its prediction; fewer groups moved cost less host
    time and link. None when none smaller fits."""
    cfg = typed(cfg)
    for fraction in OFFLOAD_FRACTIONS:
        trial = replace(cfg, offload=replace(cfg.offload, activation_offload_fraction=fraction))
        p = predict(trial, "cuda")
        if fits(p["peak_bytes"] / GIB, budget_gib, p["allocator_slack"]):
            return fraction, p
    return None


def elementwise_bytes(cfg: dict) -> int:
    """What the recompute option's elementwise labels (no matmul to replay) rematerialize per
    micro-batch: the bytes they save, against the same config without them, offload off."""
    cfg = typed(cfg)
    labels = selective_labels(option_of(cfg)) or frozenset()
    if not labels & ELEMENTWISE:
        return 0
    plain = replace(cfg, offload=replace(cfg.offload, fine_grained_activation_offloading=False, offload_modules=[]))
    rc = replace(cfg.recompute, recompute_modules=[x for x in cfg.recompute.recompute_modules if x not in ELEMENTWISE])
    without = predict(replace(plain, recompute=rc), "cuda")["activation_bytes"]
    return max(0, without - predict(plain, "cuda")["activation_bytes"])


def price(cfg: dict, p: dict, tflops: float, link_gb_s: float, remat_bytes: int = 0,
          module_times: dict | None = None) -> dict:
    """A predicted config's added step time: recompute's replay (``remat_bytes``: what its elementwise
    labels rematerialize, ``elementwise_bytes``; ``module_times``: a measured point's module forward
    times, which price the labels they cover and time the layer forwards offload's copies hide
    behind) and offload's (reloads waited for, the copies' overhead), in seconds."""
    cfg = typed(cfg)
    layers = cfg.model.num_layers // cfg.parallel.pipeline_model_parallel_size
    m, hbm = num_microbatches(cfg), cfg.estimate.hbm_gb_s
    replay, by_process = recompute_by_process_s(cfg, tflops, layers, m, remat_bytes, hbm, module_times)
    # the base point's processes price it apart where their host pace differs: shown beside the median
    spread = (by_process[0], by_process[-1]) if by_process and by_process[-1] - by_process[0] > 1e-6 else None
    # the rates are what a step that hides the manager's host work pays (fitted to dense steps); where
    # the base point measured that work, its timeline adds what the step does not hide (MoE's)
    host = (timeline_offload_costs(p.get("host_terms_per_layer") or [], module_times)
            if any(p["host_bytes_per_layer"]) else None)
    copies = exposed_transfer_s(p["offload_groups_per_layer"], layer_forward_s(cfg, tflops, module_times), link_gb_s,
                                m, offload_positions(cfg, module_times), *offload_overhead(cfg.estimate))
    overhead = copies["overhead_s"] + (host[len(host) // 2] if host else 0.0)
    return {"recompute_s": replay, "offload_s": copies["exposed_s"] + overhead,
            "offload_copy_s": copies["copy_s"], "offload_stall_s": copies["exposed_s"],
            "offload_overhead_s": overhead,
            "offload_groups": m * sum(p.get("host_groups_per_layer") or []),
            "offload_gib": m * sum(p["host_bytes_per_layer"]) / GIB,
            "cost_s": replay + copies["exposed_s"] + overhead,
            **({"recompute_spread_s": spread} if spread else {}),
            **({"offload_host_s": host[len(host) // 2]} if host else {})}


def price_config(cfg: dict, tflops: float, link_gb_s: float, module_times: dict | None = None) -> dict:
    """One config as it is (its offload fraction, its block layer count): predicted peak and added
    step time at these rates (and measured module times), as ``plan`` prices its rows."""
    cfg = typed(cfg)  # a stored result's config: upgraded to today's schema
    p = predict(cfg, "cuda")
    return {"predicted_peak_gib": p["peak_bytes"] / GIB,
            **price(cfg, p, tflops, link_gb_s, elementwise_bytes(cfg), module_times)}


def plan(cfg: dict, budget_gib: float, tflops: float | None = None, link_gb_s: float | None = None,
         module_times: dict | None = None, profile: Profile | None = None) -> dict:
    """Every allowed (recompute, offload) combination for ``cfg``'s model and layout: predicted peak,
    fit, added step time; the fastest fitting combination and the runner-up. ``module_times``: a
    measured point's (``recipes.measure.moduletime``), pricing the replays it covers. An offload plan
    whose host copies need more memory per node than the host has (``offload.host_memory_gib``, else
    the cluster's, ``recipes.hardware.cluster_of``; never this machine's) is set aside in ``over_host``, as
    the validator would refuse it. ``profile``: the GPU's (``recipes.hardware``; default: resolved from
    ``cfg``), whose figures price the plans where the config does not set its own."""
    cfg = typed(cfg)  # a stored result's config: upgraded to today's schema
    if profile is None:
        profile, why = resolve_profile(cfg)
    else:
        why = "given"
    cluster = cluster_of(cfg, profile)
    check_cluster(cfg, cluster)
    cfg = on_hardware(cfg, profile, cluster)
    cfg = replace(cfg, offload=replace(cfg.offload, host_memory_gib=cluster["host_memory_gib"]))
    tflops, link_gb_s = rates(cfg, tflops, link_gb_s)
    model, pp = cfg.model, cfg.parallel.pipeline_model_parallel_size
    keep = {k: getattr(cfg.offload, k) for k in ("min_offloaded_tensor_size", "activation_offload_fraction",
                                                 "host_memory_gib", "emulate_on_cpu")}
    rows, refused, over_host = [], [], []
    for rc_option in options_for(model):
        labels = None if is_full(rc_option) else selective_labels(rc_option)
        recompute = replace(cfg.recompute, **recompute_config(rc_option))  # its own recompute.mlp_replays_fc2
        remat = elementwise_bytes(replace(cfg, recompute=recompute)) if labels else 0
        for off_option in offload_options(model):
            modules = option_modules(off_option)
            problem = rule_problem(modules, labels, model, pp) if modules else None
            if problem:
                refused.append({"recompute": rc_option, "offload": off_option, "why": problem[1]})
                continue
            trial = replace(cfg, recompute=recompute, offload=OffloadConfig(**{**offload_config(off_option), **keep}),
                            measure=replace(cfg.measure, expandable_segments=bool(modules)
                                            or cfg.measure.expandable_segments))
            try:
                if rc_option == "full/block":
                    rc, p = fewest_block_layers(trial, trial.recompute, budget_gib)
                    trial = replace(trial, recompute=rc)
                else:
                    p = predict(trial, "cuda")
            except ConfigError as err:
                refused.append({"recompute": rc_option, "offload": off_option, "why": err.problem})
                continue
            fraction = keep["activation_offload_fraction"]
            if modules and fraction == 1.0 and fits(p["peak_bytes"] / GIB, budget_gib, p["allocator_slack"]):
                smaller = smallest_offload_fraction(trial, budget_gib)
                if smaller:
                    fraction, p = smaller
                    trial = replace(trial, offload=replace(trial.offload, activation_offload_fraction=fraction))
            planned = held_host_bytes(p)
            host = host_memory_problem(trial, planned)
            if host:  # the validator would refuse it at launch
                over_host.append({"recompute": rc_option, "offload": off_option, "why": host[1], "fix": host[2],
                                  "host_gib": planned * cfg.launcher.nproc_per_node / GIB})
                continue
            peak, slack = p["peak_bytes"] / GIB, p["allocator_slack"]
            mark = verdict(peak, budget_gib, slack)
            rows.append({"recompute": rc_option, "offload": off_option, "predicted_peak_gib": peak,
                         "fits": mark == FITS, "tight": mark == TIGHT, "host_gib": planned / GIB,
                         **price(trial, p, tflops, link_gb_s, remat, module_times),
                         **({"recompute_num_layers": trial.recompute.recompute_num_layers}
                            if rc_option == "full/block" else {}),
                         **({"activation_offload_fraction": fraction} if modules and fraction < 1.0 else {})})
    wait = host_wait_ms(module_times)
    return rank({"budget_gib": budget_gib, "family": cfg.model.family, "tflops": tflops, "host_link_gb_s": link_gb_s,
                 "profile": profile.name, "profile_text": profile.describe(), "profile_why": why, "cluster": cluster,
                 "module_times": bool(module_times), "timeline": has_timeline(module_times),
                 "allocator_slack": slack_for(cfg), "rows": rows, "refused": refused, "over_host": over_host,
                 **({"host_wait_ms": wait} if wait is not None else {})})


def rank(p: dict) -> dict:
    """``p`` with its choice (the fastest fitting row) and runner-up (the next that is not the choice and more)."""
    ranked = sorted((r for r in p["rows"] if r["fits"]), key=lambda r: _order(r, p.get("family")))
    p["choice"] = ranked[0] if ranked else None
    if p["choice"] is not None and buys_nothing(p["choice"]):  # every other plan only adds cost
        p["runner_up"] = None
    else:
        p["runner_up"] = next((r for r in ranked[1:] if not _extends(r, p["choice"])), None)
    return p


def buys_nothing(row: dict) -> bool:
    """A plan that neither recomputes nor offloads (``none``, or ``control`` with no labels)."""
    return selective_labels(row["recompute"]) == frozenset() and row.get("offload", "none") == "none"


def plan_key(row: dict) -> tuple:
    """(recompute option, offload option, offload fraction) of a plan row, to match a measured point."""
    return row["recompute"], row.get("offload", "none"), row.get("activation_offload_fraction", 1.0)


def without_measured_ooms(p: dict, ooms: set[tuple]) -> dict:
    """``p`` re-ranked with the rows a sweep ran out of memory on (``plan_key``s, under the budget's cap
    or on a GPU of its size) marked not fitting: what the allocator needed is measured, not predicted."""
    for row in p["rows"]:
        if plan_key(row) in ooms:
            row.update(fits=False, tight=False, measured_oom=True)
    return rank(p)


def _extends(row: dict, choice: dict) -> bool:
    """A row that does all the choice does and more (more labels or modules): not an alternative."""
    mine, theirs = selective_labels(row["recompute"]), selective_labels(choice["recompute"])
    if mine is None or theirs is None:
        return False
    return mine >= theirs and set(option_modules(row["offload"])) >= set(option_modules(choice["offload"]))


def _order(row: dict, family: str | None) -> tuple:
    """Fastest first; within the same time, no offload, then the guide's recompute order for the
    family, fewer modules."""
    return (round(row["cost_s"] / SAME_TIME_S), row["offload"] != "none", guide_order(row["recompute"], family),
            len(option_modules(row["offload"])))


def overrides_of(row: dict) -> str:
    """The command-line overrides that select a plan row or a predicted option (its layout too, in a
    sweep over layouts)."""
    n = row.get("recompute_num_layers")
    text = f"recompute={row['recompute']}" + (f" recompute.recompute_num_layers={n}" if n else "")
    text += f" offload={row['offload']}" if row.get("offload", "none") != "none" else ""
    f = row.get("activation_offload_fraction")
    text += f" offload.activation_offload_fraction={f:g}" if f is not None else ""
    return text + (f" {row['parallel']}" if row.get("parallel") else "")


def describe(row: dict) -> str:
    """``recompute=X offload=Y: 21.30 GiB, +4.1 ms per step (replay 1.4 ms, offload 2.7 ms: ...)``; a replay
    priced on several processes' timelines also gives their range (``replay 86.0 ms, 71.2-107.8 by process``)."""
    spread = row.get("recompute_spread_s")
    by_process = f", {spread[0] * 1e3:.1f}-{spread[1] * 1e3:.1f} by process" if spread else ""
    return (f"{overrides_of(row)}: {row['predicted_peak_gib']:.2f} GiB, +{row['cost_s'] * 1e3:.1f} ms per step "
            f"(replay {row['recompute_s'] * 1e3:.1f} ms{by_process}, offload {row['offload_s'] * 1e3:.1f} ms: copies of "
            f"{row['offload_copy_s'] * 1e3:.1f} ms, {row['offload_stall_s'] * 1e3:.1f} ms of them waited for, "
            f"and their overhead {row['offload_overhead_s'] * 1e3:.1f} ms)")


def confirm_commands(base: str, rows: list[dict], budget_gib: float, sweep_dir: str = "multirun/confirm") -> list[str]:
    """Commands that run each row into one sweep directory with the allocator capped at the budget (a
    plan whose allocator needs more, fragmentation included, stops as oom), then advise on it."""
    cap = f"measure.memory_budget_gib={budget_gib:g}"
    return ([f"python train.py -m {base} {overrides_of(r)} {allocator_overrides(r.get('offload', 'none') != 'none')} "
             f"{cap} hydra.sweep.dir={sweep_dir}".replace("  ", " ") for r in rows] + [f"python -m recipes advise {sweep_dir} --budget-gib {budget_gib:g}"])


def explain_plan(p: dict | None, base: str, measured: frozenset = frozenset()) -> list[str]:
    """The planner's lines: the fastest fitting recompute x offload combination, the runner-up and the
    commands that confirm both in one sweep (``measured``: overrides a sweep already ran)."""
    if not p:
        return []
    fitting = sorted((r for r in p["rows"] if r["fits"]), key=lambda r: r["cost_s"])
    lines = [f"Plan over recompute x offload ({len(p['rows']) + len(p.get('over_host') or [])} combinations "
             "megatron-core allows, "
             f"{len(fitting)} fit; {len(p['refused'])} refused by its rules), added step time at "
             f"{p['tflops']:.0f} TFLOP/s" + (" (replays on the base point's measured step timeline, host "
                                              "time included)" if p.get("timeline") else
                                              " (replays at the base point's measured module times)"
                                              if p.get("module_times") else "")
             + f" and a {p['host_link_gb_s']:g} GB/s host link:"]
    if p.get("profile_text"):
        lines.append(f"  GPU profile {p['profile_text']} ({p['profile_why']})")
    if p.get("cluster"):
        lines.append("  " + cluster_text(p["cluster"]))
    if p.get("host_wait_ms") is not None:  # the margin the timeline's host work is priced against
        lines.append(f"  the base point's steps waited {p['host_wait_ms']:.1f} ms for the GPU at the grad-norm read: "
                     "host work a plan adds beyond that lengthens its step, and is priced so")
    over = p.get("over_host") or []
    if over:  # the one that needs the least host memory says what the host lacks
        least = min(over, key=lambda r: r["host_gib"])
        lines.append(f"  {len(over)} offload plan{'s' if len(over) > 1 else ''} set aside for the host's memory; the "
                     f"smallest, recompute={least['recompute']} offload={least['offload']}: {least['why']}; "
                     f"fix: {least['fix']}")
    c, runner = p["choice"], p["runner_up"]
    if c is None:
        near = min(p["rows"], key=lambda r: r["predicted_peak_gib"], default=None)
        return lines + ["  nothing fits" + (f"; closest {describe(near)}" if near else "")]
    lines.append(f"  choice:    {describe(c)}")
    if buys_nothing(c):  # no runner-up: every other plan only adds cost
        lines.append(f"  recompute={c['recompute']} fits the budget with the allocator's slack: no recompute or "
                     "offload is needed, and every other plan only adds step time")
        if plan_key(c)[:2] not in measured:
            lines.append("Confirm it under the budget's cap:")
            lines += ["  " + cmd for cmd in confirm_commands(base, [c], p["budget_gib"])]
    elif runner:
        lines.append(f"  runner-up: {describe(runner)}")
        todo = [r for r in (c, runner) if plan_key(r)[:2] not in measured]
        if todo:
            lines.append("Confirm " + ("both" if len(todo) == 2 else "it") + " in one sweep directory:")
            lines += ["  " + cmd for cmd in confirm_commands(base, todo, p["budget_gib"])]
            if any(r.get("offload", "none") != "none" for r in todo):
                lines.append("  (offload leaves more of the allocator's memory unusable than recompute does: its "
                             "plans were judged with the slack measured for them, up to 21% over the predicted "
                             "peak, run with expandable segments, and each runs capped at the budget, where one "
                             "that does not fit stops as oom; docs/offload.md)")
    return lines


def cluster_text(cluster: dict) -> str:
    """``cluster: h100_sxm, 8 GPUs a node x 32 nodes, 1907 GiB host memory a node (cluster.host_memory_gib)``."""
    return (f"cluster: {cluster['gpu']}, {cluster['gpus_per_node']} GPU{'s' if cluster['gpus_per_node'] > 1 else ''} "
            f"a node x {cluster['nodes']} node{'s' if cluster['nodes'] > 1 else ''}, "
            f"{cluster['host_memory_gib']:g} GiB host memory a node ({cluster['host_memory_from']})")
