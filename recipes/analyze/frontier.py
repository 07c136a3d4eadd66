"""The whole trade-off before a run: recompute x offload x micro-batch size on one GPU profile.

    python -m recipes plan --budget-gib 70 model=mla size=h200_long cluster.gpu=h100_sxm

For a model, a layout and a budget, every micro-batch size that divides the data-parallel rank's share
of the (fixed) global batch is planned over recompute x offload (``recipes.analyze.plan``), each point
priced as a whole step: the bare step's FLOPs at the profile's bf16 rate (times ``STEP_MFU`` and the
GEMM efficiency at the micro-batch's rows, ``Profile.efficiency``: a small micro-batch runs its matmuls
slower), plus a fixed cost a micro-batch (more for MoE layers), plus the plan's replays (at the same efficiency) and offload's
exposed copies. The output: the frontier of predicted peak against step time (a table and a PNG), the
fastest fitting point first, and the top three with one Hydra sweep line that runs exactly them (one
config a point in ``DIR/points/point/``, selected by ``+point=``) under the budget's cap. ``DIR/plan.json``
keeps the prediction; ``python -m recipes advise DIR`` then says whether the measured order matched
(``recipes.analyze.confirm``).

An offload plan's price rests on its copies hiding behind compute, which moves with the host link's pace
beside compute: one H100 ran the offload pick 1.26 s a step off its price, 22% of its 5.8 s of copies,
and 9% slower than the recompute-only runner-up. Where an offload point's predicted gain over the best
recompute-only point is within ``OFFLOAD_UNCERTAINTY`` of its copy time, the recompute-only point ranks
first.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from recipes.analyze.plan import _extends, _order, buys_nothing, overrides_of, plan
from recipes.config import typed
from recipes.errors import ConfigError
from recipes.hardware import Profile, check_budget, cluster_of, resolve_profile
from recipes.measure.flops import step_flops
from recipes.predict.estimate import num_microbatches
from recipes.predict.fit import allocator_overrides
from recipes.recompute import moe_pattern
from recipes.validate.run import output_problem

#: The bare step's share of the bf16 peak at full GEMM rate (dense steps at the h200 size: 50.0% on an
#: H200, 48.3% on an H100; MLA 45%, MoE 36%): it sets the step's scale, not the order of the options.
STEP_MFU = 0.5
#: What each micro-batch costs beyond its FLOPs (launches, the loss, the pipeline's per-micro-batch
#: work), seconds: a larger micro-batch pays it fewer times.
MICROBATCH_S = 0.002
#: And each MoE layer a micro-batch, seconds: the router, the permutation and the experts' GEMMs one
#: expert at a time are many small kernels. Fitted to the H200's MoE at the h200 size (2026-12-06 and
#: -07: 7.5-9 ms more a micro-batch over 8 MoE layers, docs/evidence/planner-h200*.md); with it the
#: H100's MoE long steps (not fitted) went from 11% to 6% under their measured time.
MOE_LAYER_MICROBATCH_S = 0.001
#: The share of an offload point's copy time its price may be off by (the H100's 22%, rounded up).
OFFLOAD_UNCERTAINTY = 0.25
TOP = 3
#: Fitting frontier points the table shows (the plot shows every one).
FRONTIER_ROWS = 10


def micro_batch_sizes(cfg: dict) -> list[int]:
    """Micro-batch sizes that divide one data-parallel rank's share of the global batch."""
    cfg = typed(cfg)
    t, launch, par = cfg.train, cfg.launcher, cfg.parallel
    world = launch.nproc_per_node * launch.nnodes
    dp = max(1, world // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size
                          * par.context_parallel_size))
    share = (t.global_batch_size or t.micro_batch_size * dp) // dp
    return [b for b in range(1, share + 1) if share % b == 0]


def gemm_rows(cfg: dict) -> int:
    """Rows (tokens) of one micro-batch's GEMMs on a rank: micro-batch x sequence over context parallel."""
    cfg = typed(cfg)
    return cfg.train.micro_batch_size * cfg.train.seq_length // cfg.parallel.context_parallel_size


def bare_step_s(cfg: dict, profile: Profile) -> float:
    """One rank's step with nothing recomputed or offloaded: its model FLOPs at ``STEP_MFU`` of the
    profile's bf16 rate, at the GEMM efficiency of its micro-batch, plus ``MICROBATCH_S`` a micro-batch
    and ``MOE_LAYER_MICROBATCH_S`` a micro-batch for each of the rank's MoE layers."""
    cfg = typed(cfg)
    m, par = num_microbatches(cfg), cfg.parallel
    flops = step_flops(cfg, m)["model"] / (par.tensor_model_parallel_size * par.pipeline_model_parallel_size)
    rate = profile.bf16_tflops * 1e12 * STEP_MFU * profile.efficiency(gemm_rows(cfg))
    moe_layers = sum(moe_pattern(cfg.model)) / par.pipeline_model_parallel_size
    return flops / rate + m * (MICROBATCH_S + moe_layers * MOE_LAYER_MICROBATCH_S)


def frontier(cfg: dict, budget_gib: float, profile: Profile | None = None, why: str = "given") -> dict:
    """Every (micro-batch, recompute, offload) point: predicted peak, fit, step time; the Pareto frontier
    of peak against step time, and the ranking (fastest fitting first, an offload point behind the best
    recompute-only one where its gain is within its price's uncertainty)."""
    cfg = typed(cfg)  # a stored result's config: upgraded to today's schema
    if profile is None:
        profile, why = resolve_profile(cfg)
    check_budget(budget_gib, profile)
    cluster = cluster_of(cfg, profile)
    cfg = replace(cfg, launcher=replace(cfg.launcher, nproc_per_node=cluster["gpus_per_node"], nnodes=cluster["nodes"]))
    global_batch_size = cfg.train.global_batch_size or cfg.train.micro_batch_size
    points, plans = [], {}
    for mb in micro_batch_sizes(cfg):
        trial = replace(cfg, train=replace(cfg.train, micro_batch_size=mb, global_batch_size=global_batch_size))
        p = plan(trial, budget_gib, profile=profile)
        plans[mb] = p
        eff = profile.efficiency(gemm_rows(trial))
        bare = bare_step_s(trial, profile)
        for row in p["rows"]:
            points.append({**row, "micro_batch_size": mb, "bare_step_s": bare,
                           "step_s": bare + row["recompute_s"] / eff + row["offload_s"],
                           "uncertainty_s": OFFLOAD_UNCERTAINTY * row["offload_copy_s"]})
    ranked = rank_points(points, cfg.model.family)
    first = next(iter(plans.values()))
    return {"budget_gib": budget_gib, "profile": profile.name, "profile_text": profile.describe(),
            "profile_gpu": profile.gpu, "profile_why": why, "cluster": first["cluster"],
            "global_batch_size": global_batch_size,
            "micro_batch_sizes": list(plans), "points": points, "frontier": pareto(points),
            "ranked": ranked, "top": ranked[:TOP], "note": _note(ranked)}


def rank_points(points: list[dict], family: str | None) -> list[dict]:
    """Fitting points, fastest first (ties as the planner orders them, then the larger micro-batch); an
    offload point goes behind every recompute-only point it leads by no more than its uncertainty."""
    fitting = distinct(sorted((r for r in points if r["fits"]),
                              key=lambda r: (round(r["step_s"] / 1e-4), *_order(r, family)[1:], -r["micro_batch_size"])))
    out: list[dict] = []
    for r in fitting:
        if r in out:
            continue
        if r["offload"] != "none":
            close = [a for a in fitting if a["offload"] == "none" and a not in out
                     and 0 <= a["step_s"] - r["step_s"] <= r["uncertainty_s"]]
            for a in close:
                out.append({**a, "preferred_over": {"overrides": point_overrides(r), "lead_s": a["step_s"] - r["step_s"],
                                                    "uncertainty_s": r["uncertainty_s"]}})
        out.append(r)
    seen, ranked = set(), []
    for r in out:  # a recompute-only point moved ahead is not repeated where it stood
        key = (r["micro_batch_size"], overrides_of(r))
        if key not in seen:
            seen.add(key)
            ranked.append(r)
    return ranked


def distinct(ranked: list[dict]) -> list[dict]:
    """``ranked`` without points that only add cost: those doing all an earlier point of the same
    micro-batch does and more (more labels or modules, ``plan._extends``), the same peak and time as an
    earlier one (``full/block`` over every layer is ``full``), and any beside a point of the same
    micro-batch that neither recomputes nor offloads."""
    out: list[dict] = []
    for r in ranked:
        same = [o for o in out if o["micro_batch_size"] == r["micro_batch_size"]]
        if not any(_extends(r, o) or buys_nothing(o) or (abs(o["step_s"] - r["step_s"]) < 1e-4
                   and abs(o["predicted_peak_gib"] - r["predicted_peak_gib"]) < 1e-3) for o in same):
            out.append(r)
    return out


def _note(ranked: list[dict]) -> str | None:
    moved = [r for r in ranked[:TOP] if "preferred_over" in r]
    if not moved:
        return None
    o = moved[0]["preferred_over"]
    return (f"{o['overrides']} is predicted {o['lead_s'] * 1e3:.0f} ms faster than {point_overrides(moved[0])}, "
            f"within its offload price's uncertainty ({o['uncertainty_s'] * 1e3:.0f} ms: {OFFLOAD_UNCERTAINTY:.0%} of its "
            "copy time): the recompute-only point ranks ahead")


def pareto(points: list[dict]) -> list[dict]:
    """The points no other point beats on both predicted peak and step time, fastest first."""
    out, lowest = [], float("inf")
    for r in sorted(points, key=lambda r: (r["step_s"], r["predicted_peak_gib"])):
        if r["predicted_peak_gib"] < lowest - 1e-9:
            out.append(r)
            lowest = r["predicted_peak_gib"]
    return out


def point_overrides(row: dict) -> str:
    """A point's overrides: the plan row's, its micro-batch size and its allocator setup."""
    extra = allocator_overrides(row.get("offload", "none") != "none")
    return f"{overrides_of(row)} train.micro_batch_size={row['micro_batch_size']}" + (f" {extra}" if extra else "")


def point_config(row: dict, global_batch_size: int) -> str:
    """A Hydra config selecting one point (``+point=NAME``, package _global_)."""
    lines = ["# @package _global_", "defaults:", f"  - override /recompute: {row['recompute']}"]
    if row.get("offload", "none") != "none":
        lines.append(f"  - override /offload: {row['offload']}")
    lines.append(f"train:\n  micro_batch_size: {row['micro_batch_size']}\n  global_batch_size: {global_batch_size}")
    if row.get("recompute_num_layers"):
        lines.append(f"recompute:\n  recompute_num_layers: {row['recompute_num_layers']}")
    if row.get("activation_offload_fraction") is not None:
        lines.append(f"offload:\n  activation_offload_fraction: {row['activation_offload_fraction']:g}")
    if row.get("offload", "none") != "none":
        lines.append("measure:\n  expandable_segments: true")
    return "\n".join(lines) + "\n"


def write_confirm(f: dict, base: list[str], sweep_dir: Path) -> str:
    """Write the top points' configs and ``plan.json`` under ``sweep_dir``; the one sweep line that runs
    exactly them under the budget's cap, and advise on it."""
    names = [f"p{i + 1}" for i in range(len(f["top"]))]
    point_dir = sweep_dir / "points" / "point"
    point_dir.mkdir(parents=True, exist_ok=True)
    for name, row in zip(names, f["top"]):
        (point_dir / f"{name}.yaml").write_text(point_config(row, f["global_batch_size"]))
    keep = ("recompute", "offload", "recompute_num_layers", "activation_offload_fraction", "micro_batch_size",
            "predicted_peak_gib", "fits", "step_s", "uncertainty_s")
    record = {k: f[k] for k in ("budget_gib", "profile", "profile_text", "profile_gpu", "cluster", "note")}
    record["top"] = [{"point": n, **{k: r[k] for k in keep if k in r}} for n, r in zip(names, f["top"])]
    (sweep_dir / "plan.json").write_text(json.dumps(record, indent=2) + "\n")
    return (f"python train.py -m --config-dir {sweep_dir / 'points'} +point={','.join(names)} {' '.join(base)} "
            f"measure.memory_budget_gib={f['budget_gib']:g} hydra.sweep.dir={sweep_dir}")


def row_text(r: dict) -> str:
    return (f"  mb {r['micro_batch_size']:<3} {overrides_of(r)[:70]:<70} {r['predicted_peak_gib']:7.2f} "
            f"{'fits' if r['fits'] else 'tight' if r.get('tight') else 'over':>5} {r['step_s'] * 1e3:9.0f}")


def explain_frontier(f: dict, command: str | None = None) -> str:
    lines = [f"PREDICTED step time and peak per rank over recompute x offload x micro-batch size (global batch "
             f"{f['global_batch_size']}), budget {f['budget_gib']:g} GiB for PyTorch's allocator",
             f"  GPU profile {f['profile_text']} ({f['profile_why']})",
             f"  cluster: {f['cluster']['gpus_per_node']} GPUs a node x {f['cluster']['nodes']} node(s), "
             f"{f['cluster']['host_memory_gib']:g} GiB host memory a node ({f['cluster']['host_memory_from']})",
             f"  {len(f['points'])} points over micro-batch sizes {', '.join(map(str, f['micro_batch_sizes']))}; "
             f"{sum(r['fits'] for r in f['points'])} fit. Frontier of peak against step time (fastest first; the 3 nearest that "
             f"do not fit, then the {FRONTIER_ROWS} fastest that do):",
             f"  {'':6} {'point':<70} {'GiB':>7} {'':>5} {'ms/step':>9}"]
    over, fitting = [r for r in f["frontier"] if not r["fits"]], [r for r in f["frontier"] if r["fits"]]
    lines += [row_text(r) for r in over[-3:] + fitting[:FRONTIER_ROWS]]
    if len(fitting) > FRONTIER_ROWS:
        lines.append(f"  ... {len(fitting) - FRONTIER_ROWS} more, each slower and smaller (plan.png)")
    if not f["top"]:
        return "\n".join(lines + ["Nothing fits: more parallelism, a shorter sequence, or a larger GPU."])
    lines.append("Fastest fitting first:")
    lines += [row_text(r) for r in f["top"]]
    if f.get("note"):
        lines.append(f"  ({f['note']})")
    if command:
        lines += ["Confirm the top three in one sweep, then compare:", f"  {command}",
                  f"  python -m recipes advise {command.rsplit('hydra.sweep.dir=', 1)[1]} --budget-gib {f['budget_gib']:g}"]
    return "\n".join(lines)


def plot(f: dict, path: Path) -> None:
    """Predicted peak against step time: every point, the frontier, the budget, the top three named."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for fits, color in ((True, "tab:green"), (False, "tab:gray")):
        pts = [r for r in f["points"] if r["fits"] == fits]
        ax.scatter([r["step_s"] * 1e3 for r in pts], [r["predicted_peak_gib"] for r in pts], s=12, c=color,
                   label="fits" if fits else "does not fit")
    ax.plot([r["step_s"] * 1e3 for r in f["frontier"]], [r["predicted_peak_gib"] for r in f["frontier"]],
            "k--", lw=1, label="frontier")
    ax.axhline(f["budget_gib"], color="tab:red", lw=1, label=f"budget {f['budget_gib']:g} GiB")
    for i, r in enumerate(f["top"]):
        ax.annotate(str(i + 1), (r["step_s"] * 1e3, r["predicted_peak_gib"]), fontsize=9, weight="bold",
                    xytext=(4, 4), textcoords="offset points")
    ax.set_ylim(0, 2 * f["budget_gib"])  # the region that matters; points far over it are off the chart
    fig.text(0.01, 0.01, "\n".join(f"{i + 1}: mb {r['micro_batch_size']} {overrides_of(r)}"
                                   for i, r in enumerate(f["top"])), fontsize=7, va="bottom")
    fig.subplots_adjust(bottom=0.25)
    ax.set_xlabel("predicted step time (ms)")
    ax.set_ylabel("predicted peak allocated per rank (GiB)")
    ax.set_title(f"{f['profile']}: recompute x offload x micro-batch", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: model=mla size=h200_long cluster.gpu=h100_sxm")
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="what PyTorch's allocator may hold per GPU (default: the profile's GPU, all of it)")
    parser.add_argument("--dir", type=Path, default=None, help="the confirm sweep's directory (default multirun/plan)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_intermixed_args(argv)  # overrides on either side of an option
    from recipes.recipe import at_full_depth, compose_recipe

    try:
        cfg, _ = compose_recipe(at_full_depth(args.overrides), on_gpu=True)
        profile, why = resolve_profile(cfg)
        f = frontier(cfg, profile.budget_gib if args.budget_gib is None else args.budget_gib, profile, why)
        sweep_dir = args.dir or Path("multirun/plan")
        if problem := output_problem(sweep_dir):
            raise ConfigError("--dir", problem[1], "give --dir a writable directory (default multirun/plan)")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    command = write_confirm(f, args.overrides, sweep_dir) if f["top"] else None
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if f["points"]:
        plot(f, sweep_dir / "plan.png")
    if args.json:
        print(json.dumps({k: v for k, v in f.items() if k != "points"}, indent=2, default=str))
    else:
        print(explain_frontier(f, command) + f"\nPlot: {sweep_dir / 'plan.png'}")
    return 0
