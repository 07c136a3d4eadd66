"""Compare the points of a sweep: a table per point and rank, deltas against the control, a plot.

    python -m recipes report multirun/moe/defaults        # or: make report [DIR=...]

Also runs at the end of every ``-m`` sweep (``ReportCallback``, registered in conf/config.yaml).
Writes ``report.md``, ``report.csv`` and ``report.png`` (peak memory against step time, Pareto
frontier marked) into the sweep directory, and logs the table and plot to W&B in the sweep's group
when the sweep ran with ``logger=wandb``: one ``report`` run per sweep directory (its id is derived from
the directory), so a re-run updates that run instead of adding one. The guide asks for per-rank allocated/reserved peaks, so
every rank gets a row; the worst rank (highest peak allocated) is the one that decides fit.

Memory is the allocator's peak allocated on a GPU. A CPU run has no allocator peaks, so there the
memory axis is the activation ledger (bytes saved for backward in one micro-batch), labelled so.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from recipes.analyze.logger import sweep_group, usable_logger
from recipes.analyze.pareto import plot_pareto, point_rows
from recipes.analyze.sweep import find_results, match_key, merge_repeats, write_manifest
from recipes.files import MIB
from recipes.recompute import recompute_order
from recipes.results import (
    NOT_MEASURED,  # config sections that do not change a measurement
    RankRow,
    first_sentence,
    result_rows,
)

#: The guide's controls, in order of preference for the deltas (the control itself is compared
#: with ``none``: their difference is the noise floor of the measurement).
CONTROLS = ("control", "none")
#: (key, markdown header, format); columns with no value in any row are left out.
COLUMNS = [
    ("point", "point", "{}"),
    ("rank_label", "rank", "{}"),
    ("status", "status", "{}"),
    ("peak_allocated_gib", "peak alloc GiB", "{:.2f}"),
    ("peak_reserved_gib", "peak reserved GiB", "{:.2f}"),
    ("fragmentation_gib", "frag GiB", "{:.2f}"),
    ("d_peak", "peak vs control", "{}"),
    ("ledger_mib", "ledger MiB", "{:.2f}"),
    ("d_ledger_pct", "ledger vs control", "{:+.1f}%"),
    ("host_mib", "host MiB", "{:.2f}"),
    ("profile_peak_mib", "profiled peak MiB", "{:.2f}"),
    ("step_ms", "step ms", "{:.1f}"),
    ("step_noise", "step noise", "{:+.0%}"),
    ("step_spread", "spread over processes", "{:+.0%}"),
    ("d_time_pct", "time vs control", "{:+.1f}%"),
    ("reload_wait_ms", "reload wait ms", "{:.1f}"),
    ("gpu_ms", "GPU busy ms", "{:.1f}"),
    ("gpu_spread", "GPU busy spread", "{:+.1%}"),
    ("d_gpu_pct", "GPU busy vs control", "{:+.1f}%"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
    ("mfu", "MFU", "{:.1%}"),
]
CSV_KEYS = ["point", "rank", "worst", "status", "model", "attention", "recompute", "control",
            "peak_allocated_gib", "peak_reserved_gib", "fragmentation_gib", "activation_gib",
            "d_peak_gib", "d_peak_pct", "ledger_bytes", "ledger_mib", "d_ledger_pct", "profile_peak_mib",
            "step_ms", "step_noise", "repeats", "step_spread", "d_time_ms", "d_time_pct", "tokens_per_s", "mfu", "error", "run_dir"]
#: In report.csv only when some row has them (the GPU's busy time: measure.gpu_time, traced steps;
#: activation offload's host copies, and the time compute waited for their reloads on a GPU).
GPU_CSV_KEYS = ["gpu_ms", "gpu_spread", "d_gpu_pct"]
OFFLOAD_CSV_KEYS = ["host_mib", "moved_mib_per_step", "reload_wait_ms"]
#: Step noise = median / fastest timed step - 1; above this, step-time deltas are contention, not recompute.
NOISY_STEPS = 0.25

def _row(r: RankRow, name: str) -> dict:
    """A report row: the rank's ``RankRow`` numbers under the report's keys (deltas are added later)."""
    return {
        "point": name, "model": r.model, "attention": r.attention, "recompute": r.recompute, "offload": r.offload,
        "run_dir": r.run_dir,
        "point_status": r.point_status, "rank": r.rank, "worst": r.worst, "status": r.status, "error": r.error,
        "device": r.device, "peak_allocated_gib": r.peak_allocated_gib, "peak_reserved_gib": r.peak_reserved_gib,
        "fragmentation_gib": r.fragmentation_gib, "activation_gib": r.activation_gib,
        "ledger_bytes": r.ledger_bytes, "ledger_mib": r.ledger_mib,
        "profile_peak_mib": r.profile_peak_bytes / MIB if r.profile_peak_bytes is not None else None,
        "step_ms": r.step_ms, "step_noise": r.step_noise, "repeats": r.repeats, "step_spread": r.step_time_spread,
        "tokens_per_s": r.tokens_per_s, "mfu": r.mfu, "gpu_ms": r.gpu_ms, "gpu_spread": r.gpu_busy_spread,
        "host_mib": r.host_mib, "reload_wait_ms": r.reload_wait_ms,
        "moved_mib_per_step": r.moved_bytes_per_step / MIB if r.moved_bytes_per_step is not None else None,
    }


def _pct(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return (value / base - 1.0) * 100.0


def _add_deltas(row: dict, control: dict) -> None:
    """Memory and time of ``row`` against the same rank of its matched control."""
    row["control"] = control["point"]
    if row["status"] != "ok" or control["status"] != "ok":
        return
    if row.get("peak_allocated_gib") is not None and control.get("peak_allocated_gib") is not None:
        row["d_peak_gib"] = row["peak_allocated_gib"] - control["peak_allocated_gib"]
        row["d_peak_pct"] = _pct(row["peak_allocated_gib"], control["peak_allocated_gib"])
        row["d_peak"] = f"{row['d_peak_gib']:+.2f} GiB ({row['d_peak_pct']:+.1f}%)"
    row["d_ledger_pct"] = _pct(row.get("ledger_bytes"), control.get("ledger_bytes"))
    if row.get("step_ms") is not None and control.get("step_ms") is not None:
        row["d_time_ms"] = row["step_ms"] - control["step_ms"]
        row["d_time_pct"] = _pct(row["step_ms"], control["step_ms"])
    row["d_gpu_pct"] = _pct(row.get("gpu_ms"), control.get("gpu_ms"))


def _flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in (config or {}).items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def point_names(results: list[dict]) -> list[str]:
    """Each result's name, plus ``key=value`` for the settings that tell apart points of the same
    name (``model/attention/recompute`` is the name; a sweep over other options, e.g.
    ``train.global_batch_size=2,8``, would otherwise print identical rows)."""
    names = [r.get("name") for r in results]
    for name in set(names):
        same = [i for i, n in enumerate(names) if n == name]
        flats = [{k: v for k, v in _flat(results[i].get("config")).items()
                  if k.split(".")[0] not in NOT_MEASURED and k != "measure.repeat"} for i in same]
        varied = sorted({k for f in flats for k in f if any(g.get(k) != f.get(k) for g in flats)})
        if len(same) > 1 and varied:
            for i, f in zip(same, flats):
                names[i] = f"{name} " + " ".join(f"{k}={f.get(k)}" for k in varied)
    return names


def rank_rows(results: list[dict]) -> list[dict]:
    """One row per point and rank (a point with no rank result gets one row), in the guide's order,
    with deltas against the matched control (same config but recompute; ``control``, else ``none``)."""
    rows: list[dict] = []
    results = merge_repeats(results)
    for result, name in zip(results, point_names(results)):
        keys = {"_key": match_key(result), "_family_key": match_key(result, ("recompute", "offload", "attention"))}
        ranks = result_rows(result)
        for r in ranks:
            row = {**_row(r, name), **keys}
            mark = "*" if r.worst and len(ranks) > 1 else ""
            row["rank_label"] = f"{r.rank}{mark}" if r.rank is not None else ""
            rows.append(row)
    keys = list(dict.fromkeys(r["_key"] for r in rows))
    rows.sort(key=lambda r: (keys.index(r["_key"]), recompute_order(r["recompute"]), r["point"] or "",
                             r["rank"] if r["rank"] is not None else -1))
    for row in rows:
        control = _control_row(row, rows)
        if control is not None:
            _add_deltas(row, control)
    return rows


def _control_row(row: dict, rows: list[dict]) -> dict | None:
    for label in CONTROLS:
        same = [r for r in rows if r["_key"] == row["_key"] and r["recompute"] == label
                and r.get("offload", "none") == "none" and r["point"] != row["point"] and r["status"] == "ok"]
        if same:
            return next((r for r in same if r["rank"] == row["rank"]), next((r for r in same if r["worst"]), same[0]))
    return None


def control_gap_pct(rows: list[dict]) -> float | None:
    """How far ``control`` measured from ``none`` in step time, in percent (largest over configs):
    the same computation in separate processes, so the sweep's noise floor between processes."""
    gaps = [abs(r["d_time_pct"]) for r in rows if r["recompute"] == "control" and r.get("d_time_pct") is not None]
    return max(gaps) if gaps else None


def format_markdown(rows: list[dict]) -> str:
    """A markdown table of the rows (missing values blank, empty columns left out)."""
    cols = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [fmt.format(r[k]) if r.get(k) is not None else "" for k, _, fmt in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _notes(rows: list[dict], results: list[dict]) -> list[str]:
    notes = []
    devices = sorted({r.get("device", "?") for res in results for r in res.get("ranks") or []})
    if devices:
        notes.append(f"Device: {', '.join(devices)}. Worst rank (highest peak allocated) marked * "
                     "when a point has several ranks.")
    if any(r.get("step_noise") is not None for r in rows):
        notes.append("step ms = median of the timed steps; step noise = median / fastest - 1.")
    controls = sorted({r["control"] for r in rows if r.get("control")})
    if controls:
        notes.append(f"Deltas are against the matched control ({', '.join(controls)}): same config "
                     "but recompute; the control row itself is compared with none (the noise floor).")
    spreads = [r for r in point_rows(rows) if r.get("step_spread") is not None]
    if spreads:
        counts = sorted({r["repeats"] for r in spreads})
        runs = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
        notes.append(f"Repeated points ran in {runs} processes each (measure.repeat); their step ms is the median "
                     "of the processes' medians and 'spread over "
                     f"processes' is slowest / fastest - 1, up to {max(r['step_spread'] for r in spreads):.1%}.")
    busy = [r for r in point_rows(rows) if r.get("gpu_ms") is not None]
    if busy:
        spread = [r["gpu_spread"] for r in busy if r.get("gpu_spread") is not None]
        notes.append("GPU busy ms = the time a kernel, copy or memset ran in one more step profiled after the timed "
                     "ones (measure.gpu_time): the step's time when the host keeps up, which the host's speed "
                     "does not move" + (f"; over the repeated processes it spread up to {max(spread):.1%}" if spread
                                        else "") + ".")
    floor = control_gap_pct(point_rows(rows))
    if floor is not None:
        notes.append(f"Noise floor: `control` and `none` run the same computation in separate processes and "
                     f"differ by {floor:.1f}% in step time; time deltas within that are not resolved by "
                     "this sweep (step noise only measures the spread inside one process).")
    noisy = [r["point"] for r in point_rows(rows) if (r.get("step_noise") or 0) > NOISY_STEPS]
    if noisy:
        notes.append(f"Step times are noisy (median step over {NOISY_STEPS:.0%} slower than the fastest) for "
                     f"{len(noisy)} point(s): their time deltas measure contention, not recompute; re-run on an "
                     "idle machine (rerun=true), on a shared CPU with OMP_NUM_THREADS=1.")
    for r in point_rows(rows):
        if r["status"] != "ok":
            notes.append(f"`{r['point']}` {r['status']}: {first_sentence(r.get('error'))}")
    return notes


def csv_keys(rows: list[dict]) -> list[str]:
    """report.csv's and the W&B table's columns: every CSV_KEYS, then the GPU busy and offload ones
    some row has."""
    keys = CSV_KEYS + [k for k in GPU_CSV_KEYS + OFFLOAD_CSV_KEYS if any(r.get(k) is not None for r in rows)]
    if any(r.get("offload", "none") != "none" for r in rows):  # the option, beside recompute's
        keys.insert(keys.index("recompute") + 1, "offload")
    return keys


def write_report(sweep_dir: Path, wandb_logger: dict | None = None) -> str:
    """Write report.md, report.csv and report.png for a sweep directory; return the markdown.

    ``wandb_logger`` (a ``logger`` config section) also logs the table and plot to W&B."""
    sweep_dir = Path(sweep_dir)
    results = find_results(sweep_dir)
    if not results:
        raise FileNotFoundError(f"no result.json under {sweep_dir}: run a sweep first "
                                "(python train.py -m sweep=moe) or point at its multirun/ directory")
    rows = rank_rows(results)
    png = plot_pareto(rows, sweep_dir / "report.png", f"{sweep_group(str(sweep_dir))}: memory vs step time")
    md = format_markdown(rows)
    notes = "\n".join(f"- {n}" for n in _notes(rows, results))
    from recipes.measure.timeline import plot_timelines  # lazy: matplotlib; train.py loads this callback on every run

    timelines = plot_timelines(results, sweep_dir / "timelines.png")
    side_by_side = f"\n\n![memory over one step]({timelines.name})" if timelines else ""
    (sweep_dir / "report.md").write_text(
        f"# Sweep report: {sweep_dir}\n\n{md}\n\n{notes}\n\n![memory vs step time]({png.name}){side_by_side}\n")
    with open(sweep_dir / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=csv_keys(rows), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    if wandb_logger and wandb_logger.get("name") == "wandb":
        try:  # the report is on disk: a logging failure is a warning
            log_report_to_wandb(sweep_dir, rows, png, usable_logger(wandb_logger))
        except Exception as err:
            print(f"warning: W&B logging of the report failed ({type(err).__name__}: {err}); the report is "
                  f"in {sweep_dir / 'report.md'}", file=sys.stderr)
    return md


def report_run_id(sweep_dir: Path) -> str:
    """The W&B id of a sweep's ``report`` run: the same for every report of one sweep directory, so
    re-running the report (or the sweep) updates that run (offline copies sync into it) instead of
    adding another."""
    import hashlib

    return "report-" + hashlib.sha1(str(Path(sweep_dir).resolve()).encode()).hexdigest()[:12]


def log_report_to_wandb(sweep_dir: Path, rows: list[dict], png: Path, log: dict) -> None:
    """The table (wandb.Table) and plot (wandb.Image) in the sweep's ``report`` run, in its group."""
    import os

    os.environ.setdefault("WANDB_SILENT", "true")
    # lazy: only with logger=wandb
    import wandb

    run = wandb.init(project=log.get("project"), entity=log.get("entity"), mode=log.get("mode", "offline"),
                     group=log.get("group") or sweep_group(str(sweep_dir)), name="report",
                     job_type="report", dir=str(sweep_dir), id=report_run_id(sweep_dir), resume="allow",
                     reinit="finish_previous")
    try:
        keys = csv_keys(rows)
        data = [[None if r.get(k) is None else (r[k] if isinstance(r[k], (int, float)) else str(r[k]))
                 for k in keys] for r in rows]
        run.log({"report/table": wandb.Table(columns=keys, data=data),
                 "report/memory_vs_time": wandb.Image(str(png))})
    finally:
        run.finish()


def _logger_of(results: list[dict]) -> dict | None:
    return next(((r.get("config") or {}).get("logger") for r in results if (r.get("config") or {}).get("logger")), None)


class ReportCallback(Callback):
    """Hydra callback: print and write the sweep report when a multirun ends."""

    def on_multirun_end(self, config, **kwargs) -> None:
        from omegaconf import OmegaConf

        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            write_manifest(sweep_dir)
        try:
            md = write_report(sweep_dir, OmegaConf.to_container(config.logger, resolve=True))
        except FileNotFoundError:
            return
        except Exception as err:  # the results are safe on disk; a report bug must not fail the sweep
            print(f"warning: no report for {sweep_dir}: {type(err).__name__}: {err} "
                  f"(python -m recipes report {sweep_dir} to retry)")
            return
        print(f"\n{md}\n\nreport: {sweep_dir / 'report.md'} (plot: report.png, csv: report.csv)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a multirun/... sweep directory")
    parser.add_argument("--no-wandb", action="store_true", help="do not log to W&B even if the sweep did")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"error: {args.sweep_dir} is not a directory (give a multirun/<sweep>/<overrides> path)",
              file=sys.stderr)
        return 2
    results = find_results(args.sweep_dir)
    try:
        print(write_report(args.sweep_dir, None if args.no_wandb else _logger_of(results)))
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"\nreport: {args.sweep_dir / 'report.md'} (plot: report.png, csv: report.csv)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
