"""Compare the points of a sweep: one row per point (worst rank), deltas against the control.

    python -m recipes.report multirun/2026-11-29/10-00-00

Also runs at the end of every ``-m`` sweep (``ReportCallback``, registered in conf/config.yaml).
Writes ``report.md`` and ``report.csv`` into the sweep directory and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from recipes.results import load_result, summary

COLUMNS = [
    ("name", "point", "{}"),
    ("status", "status", "{}"),
    ("peak_allocated_gib", "peak alloc GiB", "{:.2f}"),
    ("peak_reserved_gib", "peak reserved GiB", "{:.2f}"),
    ("fragmentation_gib", "frag GiB", "{:.2f}"),
    ("ledger_mib", "ledger MiB", "{:.1f}"),
    ("d_ledger_pct", "ledger vs control", "{:+.1f}%"),
    ("d_peak_pct", "peak vs control", "{:+.1f}%"),
    ("step_time_s", "step ms", "{:.1f}"),
    ("d_time_pct", "time vs control", "{:+.1f}%"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
    ("mfu", "MFU", "{:.1%}"),
]
#: The guide's controls, in order of preference for the deltas.
CONTROLS = ("control", "none")


def find_results(sweep_dir: Path) -> list[dict]:
    """Every result.json under a sweep directory (one per point), in point order."""
    def order(path: Path):
        head = path.parent.name.split("_", 1)[0]
        return (int(head) if head.isdigit() else 1 << 30, path.parent.name)

    files = sorted(Path(sweep_dir).glob("*/result.json"), key=order)
    if not files and (Path(sweep_dir) / "result.json").exists():
        files = [Path(sweep_dir) / "result.json"]
    return [load_result(f) for f in files]


def _control_for(row: dict, rows: list[dict]) -> dict | None:
    """The control with the same model and attention as ``row`` ("control" first, then "none")."""
    for label in CONTROLS:
        for other in rows:
            if (other["recompute"] == label and other["status"] == "ok"
                    and other["model"] == row["model"] and other["attention"] == row["attention"]):
                return other
    return None


def _pct(value, base):
    if value is None or not base:
        return None
    return (value / base - 1.0) * 100.0


def rows_with_deltas(results: list[dict]) -> list[dict]:
    """Summary rows with ledger/peak/time deltas against the matched control."""
    rows = [summary(r) for r in results]
    for row in rows:
        control = _control_for(row, rows)
        if control is None or row["status"] != "ok":
            continue
        row["d_ledger_pct"] = _pct(row.get("ledger_bytes"), control.get("ledger_bytes"))
        row["d_peak_pct"] = _pct(row.get("peak_allocated_gib"), control.get("peak_allocated_gib"))
        row["d_time_pct"] = _pct(row.get("step_time_s") and row["step_time_s"] * 1e3,
                                 control.get("step_time_s") and control["step_time_s"] * 1e3)
        row["control"] = control["name"]
    for row in rows:
        if row.get("ledger_bytes") is not None:
            row["ledger_mib"] = row["ledger_bytes"] / 2**20
        if row.get("step_time_s") is not None:
            row["step_time_s"] = row["step_time_s"] * 1e3  # shown in ms
    return rows


def format_markdown(rows: list[dict]) -> str:
    """A markdown table of the rows (missing values blank)."""
    cols = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [fmt.format(r[k]) if r.get(k) is not None else "" for k, _, fmt in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_report(sweep_dir: Path) -> str:
    """Write report.md and report.csv for a sweep directory and return the markdown."""
    sweep_dir = Path(sweep_dir)
    results = find_results(sweep_dir)
    if not results:
        raise FileNotFoundError(f"no result.json under {sweep_dir}: run a sweep first "
                                "(python train.py -m ...) or point at its multirun/ directory")
    rows = rows_with_deltas(results)
    md = format_markdown(rows)
    (sweep_dir / "report.md").write_text(f"# Sweep report: {sweep_dir}\n\n{md}\n")
    keys = [c[0] for c in COLUMNS] + [k for k in ("model", "attention", "recompute", "worst_rank") ]
    with open(sweep_dir / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return md


class ReportCallback(Callback):
    """Hydra callback: print and write the sweep report when a multirun ends."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            md = write_report(sweep_dir)
        except FileNotFoundError:
            return
        print(f"\n{md}\n\nreport: {sweep_dir / 'report.md'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a multirun/... directory")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"error: {args.sweep_dir} is not a directory", file=sys.stderr)
        return 2
    try:
        print(write_report(args.sweep_dir))
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
