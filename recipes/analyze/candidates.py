"""A sweep's points as the advisor weighs them: measured candidates (each point's worst rank and its
deltas against the control), predicted ones for the options the sweep did not run, the planner's
plan over recompute x offload at the sweep's measured rates, and what drives the peak."""

from __future__ import annotations

from pathlib import Path

from recipes.analyze.plan import fewest_block_layers, plan, without_measured_ooms
from recipes.analyze.report import rank_rows
from recipes.analyze.sweep import find_results, merge_repeats
from recipes.errors import ConfigError
from recipes.files import GIB
from recipes.measure.timeline import first_label_to_try, top_contributors
from recipes.offload import offload_config
from recipes.offload import option_of as offload_option_of
from recipes.predict.compare import recorded_shares
from recipes.predict.estimate import predict, predict_options
from recipes.predict.fit import with_slack
from recipes.recompute import NO_RECOMPUTE, recompute_config, recompute_order
from recipes.results import deciding_rank, recompute_of, worst_row

#: Fragmentation is flagged when reserved - allocated is at least this fraction of reserved ...
FRAG_FRACTION = 0.10
#: ... and at least this many GiB (small gaps are the allocator's normal rounding).
FRAG_MIN_GIB = 0.5


def measured_candidates(sweep_dir: Path) -> list[dict]:
    """One candidate per point: its worst numbers over ranks and its deltas against the control."""
    rows = rank_rows(find_results(sweep_dir))
    points: dict[str, dict] = {}
    for r in rows:
        c = points.setdefault(r["run_dir"] or r["point"], {  # two points may share a name, not a directory
            "point": r["point"], "model": r["model"], "attention": r["attention"], "recompute": r["recompute"],
            "offload": r.get("offload") or "none", "status": r["point_status"] or r["status"], "source": "measured", "key": r["_key"],
            "family_key": r["_family_key"], "ranks": [], "error": r.get("error"),
        })
        c["ranks"].append({k: r.get(k) for k in ("rank", "status", "device", "peak_allocated_gib",
                                                  "peak_reserved_gib", "fragmentation_gib", "ledger_bytes")})
        if r["worst"] or r["rank"] is None:  # the worst rank's time and deltas speak for the point
            c.update({k: r.get(k) for k in ("step_ms", "step_noise", "step_spread", "control", "d_peak_gib", "d_peak_pct",
                                            "d_ledger_pct", "d_time_pct", "worst_rank", "gpu_ms", "gpu_spread",
                                            "d_gpu_pct") if r.get(k) is not None})
            c["worst_rank"] = r["rank"]
    for c in points.values():
        for key in ("peak_allocated_gib", "peak_reserved_gib", "ledger_bytes"):  # the worst over ranks
            values = [x[key] for x in c["ranks"] if x.get(key) is not None]
            c[key] = max(values) if values else None
    return list(points.values())


def _layout(result: dict) -> str:
    """The parallel layout a point ran, as the override that selects it: ``parallel=ep2``, or the
    sizes where they were set by hand (``parallel.tensor_model_parallel_size=2`` keeps ``single``)."""
    par = (result.get("config") or {}).get("parallel") or {}
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
            "context_parallel_size", "expert_model_parallel_size")
    choice = (result.get("choices") or {}).get("parallel") or "single"
    hand = [f"parallel.{k}={par[k]}" for k in keys if (par.get(k) or 1) > 1]
    return " ".join(hand) if choice == "single" and hand else f"parallel={choice}"


def _groups(results: list[dict]) -> dict[tuple, dict]:
    """One completed result per (model, attention, layout) of the sweep: the config to predict the
    recompute options from, without activation offload (a point without it where there is one; else an
    offload point's config with its offload off, as the predicted rows' commands run them)."""
    groups: dict[tuple, dict] = {}
    for r in sorted(results, key=lambda r: offload_option_of(r.get("config") or {}) != "none"):
        ch = r.get("choices") or {}
        if r.get("status") == "ok" and r.get("config"):
            groups.setdefault((ch.get("model"), ch.get("attention"), _layout(r)), r)
    return {key: _without_offload(r) for key, r in groups.items()}


def _without_offload(result: dict) -> dict:
    cfg = result["config"]
    if offload_option_of(cfg) == "none":
        return result
    off = offload_config("none")
    keys = ("fine_grained_activation_offloading", "offload_modules")
    return {**result, "config": {**cfg, "offload": {**cfg["offload"], **{k: off[k] for k in keys}}}}


def is_gpu(device: str | None) -> bool:
    """A rank's recorded ``device`` (``torch.cuda.get_device_name()`` or ``cpu``) names a GPU."""
    return device not in (None, "cpu")


def _on_gpu(result: dict) -> bool:
    """Whether a run ran on GPUs: from its ranks' ``device``, whatever their status (a GPU sweep whose
    points all ran out of memory is still a GPU sweep); results without it, from allocator numbers."""
    ranks = result.get("ranks") or []
    return any(is_gpu(r.get("device")) or r.get("memory") for r in ranks)


def predicted_candidates(sweep_dir: Path, budget_gib: float | None = None) -> list[dict]:
    """recipes.predict.estimate's rows for options of the sweep's families that it did not measure.

    ``source: "predicted"``: listed as worth measuring, never chosen. Memory is the predicted peak
    per rank with the allocator's slack (GPU sweeps, judged like the measured reserved peaks) or the
    predicted activation bytes (CPU sweeps, to match the ledger). With a budget, an unmeasured
    ``full/block`` on a GPU sweep is priced at the fewest layers that fit it."""

    results = find_results(sweep_dir)
    measured = {((r.get("choices") or {}).get("model"), (r.get("choices") or {}).get("attention"), _layout(r),
                 recompute_of(r)) for r in results if offload_option_of(r.get("config") or {}) == "none"}
    layouts = {_layout(r) for r in results}
    rows = []
    for (model, attention, layout), r in _groups(results).items():
        gpu = _on_gpu(r)
        try:
            done, _ = predict_options(r["config"], "cuda" if gpu else "cpu")
        except ConfigError:  # a family or feature the estimator does not model: nothing predicted
            continue
        # a sweep over layouts: each predicted row names the layout it prices (and runs it)
        where = {"parallel": layout} if len(layouts) > 1 else {}
        for option, p in done:
            if (model, attention, layout, option) in measured:
                continue
            extra = {}
            if option == "full/block" and gpu and budget_gib is not None:
                rc, p = fewest_block_layers(r["config"], recompute_config(option), budget_gib)
                extra = {"recompute_num_layers": rc["recompute_num_layers"]}
            # on a GPU sweep the measured points are judged on reserved: so are the predictions
            nbytes = with_slack(p["peak_bytes"], p["allocator_slack"]) if gpu else p["activation_bytes"]
            name = f"{model} {attention} {option}" + (f" {layout}" if where else "")
            rows.append({"point": name, "model": model, "attention": attention,
                         "recompute": option, "status": "predicted", "source": "predicted",
                         "memory_gib": nbytes / GIB, **where, **extra})
    return rows


def predicted_next_to_measured(sweep_dir: Path) -> list[dict]:
    """For each measured point: the estimator's prediction for its config beside the measurement.

    The prediction is of the worst rank's pipeline stage; under expert parallel at the routing that
    rank recorded (else balanced), as ``estimate --compare`` prices it, with the before-a-run bound
    for the worst EP rank (``estimate.moe_imbalance``) beside it. A point run in several processes is
    one row (``merge_repeats``: its highest peak)."""

    results = merge_repeats(find_results(sweep_dir))
    layouts = {_layout(r) for r in results}
    rows = []
    for r in results:
        if r.get("status") != "ok" or not r.get("config") or not r.get("ranks"):
            continue
        gpu = _on_gpu(r)
        device = "cuda" if gpu else "cpu"
        worst = worst_row(r)
        rank = next((x for x in r["ranks"] if x.get("rank") == worst.rank), {})
        try:
            ledger_share, peak_share = recorded_shares(r["config"], device, rank)
            stage = worst.coords.get("pp") if ledger_share else None
            p = predict(r["config"], device, stage=stage, routed_share=ledger_share or 1)
            peak = p if peak_share is None else predict(r["config"], device, stage=stage, routed_share=peak_share)
            bound = predict(r["config"], device) if p["routed_share"] is not None else None
        except ConfigError:
            continue
        name = r.get("name") + (f" {_layout(r)}" if len(layouts) > 1 else "")
        row = {"point": name, "predicted_ledger_bytes": p["activation_bytes"],
               "measured_ledger_bytes": worst.ledger_bytes}
        if gpu:
            row["predicted_peak_gib"] = peak["peak_bytes"] / GIB
            row["measured_peak_gib"] = worst.peak_allocated_gib
            if bound is not None:
                row["bound_peak_gib"] = bound["peak_bytes"] / GIB
                row["routing"] = "recorded" if ledger_share else "balanced"
        rows.append(row)
    return rows


def _gpu_points(results: list[dict]) -> list[dict]:
    return [r for r in results if r.get("status") == "ok" and r.get("config") and _on_gpu(r)]


def _base_point(ok: list[dict]) -> dict:
    """The point the others are priced against: no offload, the least recompute."""
    return min(ok, key=lambda r: (offload_option_of(r["config"]) != "none", recompute_order(recompute_of(r))))


def measured_rates(results: list[dict]) -> tuple[float | None, float | None, dict | None]:
    """What a GPU sweep measured for the planner: the model TFLOP/s per GPU its base point achieved
    (``_base_point``), the slowest host link an offload point recorded, and the module forward times
    the base point's deciding rank recorded (``measure.module_times``; each None when it has none).
    A point run in several processes (``measure.repeat``) counts as one: its processes' medians."""
    points = _gpu_points(results)
    links = [min(link["d2h_gb_s"], link["h2d_gb_s"]) for r in points for rank in r.get("ranks") or []
             if (link := (rank.get("offload") or {}).get("link")) and link.get("d2h_gb_s")]  # every process's
    ok = merge_repeats(points)
    if not ok:
        return None, (min(links) if links else None), None
    base = _base_point(ok)
    times = deciding_rank(base).get("module_times")
    return (worst_row(base).model_tflops_per_gpu, min(links) if links else None,
            times if times and "forward_ms" in times else None)


def sweep_plan(sweep_dir: Path, budget_gib: float) -> dict | None:
    """The planner (``recipes.analyze.plan``) on a GPU sweep's configuration, at the rate the sweep's
    no-recompute point achieved (model TFLOP/s per GPU) and the host link an offload point recorded;
    None for a CPU sweep or one without a completed point."""
    results = find_results(sweep_dir)
    ok = _gpu_points(results)
    if not ok:
        return None
    base = _base_point(ok)
    try:
        p = plan(base["config"], budget_gib, *measured_rates(ok))
    except ConfigError:
        return None
    oom = [r for r in results if r.get("status") == "oom" and r.get("config") and _on_gpu(r)]
    p = without_measured_ooms(p, {(recompute_of(r), offload_option_of(r["config"]),
                                   r["config"]["offload"]["activation_offload_fraction"]) for r in oom})
    p["measured"] = sorted({(recompute_of(r), offload_option_of(r["config"])) for r in ok + oom})
    choices = base.get("choices") or {}
    p["base"] = " ".join(f"{g}={choices[g]}" for g in ("model", "size", "attention", "parallel")
                         if choices.get(g) and not (g == "parallel" and choices[g] == "single"))
    return p


def what_drives_the_peak(sweep_dir: Path) -> dict | None:
    """The guide's first label from the control's peak attribution (recipes.measure.profile), if profiled."""

    for r in sorted(find_results(sweep_dir), key=lambda r: recompute_order(recompute_of(r))):
        if recompute_of(r) in NO_RECOMPUTE and r.get("status") == "ok":
            label, why = first_label_to_try(r)
            if label is None and why.startswith("no peak attribution"):
                continue
            return {"point": r.get("name"), "top": top_contributors(r), "label": label, "why": why}
    return None


def fragmentation(candidates: list[dict]) -> list[dict]:
    """Every rank whose reserved peak is well above its allocated peak (the guide's step 1)."""
    found = []
    for c in candidates:
        for r in c["ranks"]:
            alloc, reserved = r.get("peak_allocated_gib"), r.get("peak_reserved_gib")
            if alloc is None or reserved is None:
                continue
            gap = reserved - alloc
            if gap >= FRAG_MIN_GIB and gap >= FRAG_FRACTION * reserved:
                found.append({"point": c["point"], "recompute": c["recompute"], "rank": r["rank"],
                              "allocated_gib": alloc, "reserved_gib": reserved, "fragmentation_gib": gap,
                              "fraction_of_reserved": gap / reserved})
    return found
