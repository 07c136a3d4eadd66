"""The ``python -m recipes estimate`` command: one prediction printed by layer and kind, every recompute
option ranked by its peak (``--all``), or every run under a directory predicted beside its measurement
(``--compare``).

    python -m recipes estimate model=moe recompute=selective/moe_act size=h200 [--budget-gib 80] [--all]
    make estimate ARGS="model=moe size=h200 --all --budget-gib 80"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recipes.errors import ConfigError
from recipes.files import GIB, UnreadableFile
from recipes.hardware import check_budget, check_cluster, cluster_of, resolve_profile
from recipes.predict.compare import compare_result, format_comparison, mean_share
from recipes.predict.estimate import held_host_bytes, predict, predict_options
from recipes.predict.fit import ALLOCATOR_SLACK, FITS, OVER, TIGHT, verdict, with_slack
from recipes.recipe import at_full_depth, compose_recipe
from recipes.recompute import KINDS
from recipes.results import load_result
from recipes.validate.offload import FEWER_COPIES


def _fmt(nbytes: float, unit: float = 2**20) -> str:
    return "." if nbytes == 0 else f"{nbytes / unit:.1f}" if nbytes >= unit / 10 else "<0.1"


def routing_line(p: dict) -> str | None:
    """How an expert-parallel prediction priced the routed rows (None without EP)."""
    share = p.get("routed_share")
    if share is None:
        return None
    if isinstance(share, list):
        return f"expert parallel: routed rows as recorded, {mean_share(share):.3f}x balanced on average over the layers"
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


def host_line(p: dict, cluster: dict) -> str | None:
    """The host memory verdict of an offload prediction on ``cluster`` (``recipes.hardware.cluster_of``):
    its copies per node against the node's memory, as the validator refuses the run before launch."""
    if not p.get("host_bytes"):
        return None
    rank, gpus, host = held_host_bytes(p), cluster["gpus_per_node"], cluster["host_memory_gib"]
    per_node = rank * gpus / GIB
    head = (f"host memory: the copies hold {per_node:.1f} GiB a node ({rank / GIB:.2f} a rank x {gpus} "
            f"GPU{'s' if gpus > 1 else ''}), of {host:g} GiB ({cluster['host_memory_from']}): ")
    if per_node <= host:
        return head + "fits"
    return head + f"does NOT fit; fix: {FEWER_COPIES}, or, if the nodes have more, set cluster.host_memory_gib to it"


def budget_line(peak_gib: float, budget_gib: float, slack: float = ALLOCATOR_SLACK) -> str:
    """The fit verdict for a budget, with the allocator's slack (recipes.predict.fit: ``slack_for``)."""
    need = with_slack(peak_gib, slack)
    head = f"budget {budget_gib:g} GiB (what PyTorch may reserve), needs {need:.1f} GiB with {slack:.1%} allocator slack: "
    return head + {FITS: f"fits ({budget_gib - need:.1f} GiB to spare)",
                   TIGHT: f"TIGHT: fits only without the slack ({need - budget_gib:.1f} GiB short): it may run out of memory",
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


def compare_command(directory: str) -> int:
    """``--compare DIR``: every result.json under DIR predicted beside its measurement. A file that is
    not a run's result, or whose config cannot be priced, is named and skipped; the rest are compared."""
    root = Path(directory)
    if not root.is_dir():
        print(f"error: --compare {directory}: not a directory (give a run or sweep directory, e.g. "
              "multirun/<sweep>/<overrides>)", file=sys.stderr)
        return 2
    rows = []
    for p in sorted(root.rglob("result.json")):
        try:
            rows += compare_result(load_result(p), p.parent.name)
        except UnreadableFile as err:  # BadResult: named, and the other results still compared
            print(f"warning: skipped {err}", file=sys.stderr)
        except (ConfigError, KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as err:
            print(f"warning: skipped {p}: its config cannot be priced ({type(err).__name__}: {err}); "
                  "move it away, or re-run its point with today's code", file=sys.stderr)
    if not rows:
        print(f"error: no completed result.json under {directory}: run a sweep there first "
              "(python train.py -m ...)", file=sys.stderr)
        return 2
    print(format_comparison(rows))
    return 0


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
    args = parser.parse_intermixed_args(argv)  # overrides on either side of an option
    if args.compare:
        return compare_command(args.compare)
    title = " ".join(args.overrides) or "(defaults)"
    try:  # recipe=<name>: its published layout and depth (recipes.recipe), whatever GPUs are here
        cfg, notes = compose_recipe(at_full_depth(args.overrides), on_gpu=True)
        for note in notes:
            print(f"[recipe] {note}")
        if args.budget_gib is None and (cfg.get("recipe") or (cfg.get("cluster") or {}).get("gpu")):
            args.budget_gib = resolve_profile(cfg)[0].budget_gib
        if args.budget_gib is not None:  # the GPU the budget is judged for (recipes.hardware)
            profile, why = resolve_profile(cfg)
            check_budget(args.budget_gib, profile)
            print(f"[gpu] {profile.describe()} ({why})")
            cluster = cluster_of(cfg, profile)
            check_cluster(cfg, cluster)
        if args.all:
            done, refused = predict_options(cfg, args.device)
            print(format_options(done, refused, title, args.budget_gib))
        else:
            p = predict(cfg, args.device)
            print(format_prediction(p, title, args.budget_gib, args.terms))
            host = host_line(p, cluster) if args.budget_gib is not None else None
            if host:
                print(host)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
