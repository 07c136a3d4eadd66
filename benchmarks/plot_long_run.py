"""The long run's record through its kill: loss and tokens/s per logged step, and the summary table.

Reads what ``benchmarks/gpu_long_run.sh`` leaves in DOCS: ``progress.jsonl`` (one row per
``train.log_interval`` steps, appended across the kill and the resume), ``long-result.json`` (the
long run's measured window) and ``8step-result.json`` (an 8-step sweep point with the same
settings). Writes ``DOCS/long-run.png`` and prints the summary.

    python benchmarks/plot_long_run.py results/long-run --kill-at 1150   # benchmarks/gpu_long_run.sh's folder
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from recipes.files import PROGRESS_FILE  # noqa: E402
from recipes.results import load_result, worst_row  # noqa: E402


def segments(rows: list[dict]) -> list[list[dict]]:
    """The progress rows cut where the step goes back (a process resumed from a checkpoint)."""
    out: list[list[dict]] = []
    for row in rows:
        if not out or row["step"] <= out[-1][-1]["step"]:
            out.append([])
        out[-1].append(row)
    return out


def steady_tokens_per_s(rows: list[dict]) -> float:
    """The median tokens/s of the logged intervals (a checkpoint save or a validation falls in a few
    intervals only, so the median is the steady state)."""
    return statistics.median(r["tokens_per_s"] for r in rows[1:] or rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("docs", type=Path)
    parser.add_argument("--kill-at", type=int, required=True)
    args = parser.parse_args()
    rows = [json.loads(line) for line in (args.docs / PROGRESS_FILE).read_text().splitlines() if line]
    parts = segments(rows)
    long_result = load_result(args.docs / "long-result.json")
    long_row = worst_row(long_result)
    short_row = worst_row(load_result(args.docs / "8step-result.json"))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_speed) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for i, part in enumerate(parts):
        name = "first process" if i == 0 else f"resumed ({i})"
        steps = [r["step"] for r in part]
        ax_loss.plot(steps, [r["loss"] for r in part], lw=1, label=f"train loss, {name}")
        val = [(r["step"], r["val_loss"]) for r in part if r.get("val_loss") is not None]
        if val:
            ax_loss.plot(*zip(*val), "o", ms=3, label=f"validation loss, {name}")
        ax_speed.plot(steps, [r["tokens_per_s"] for r in part], lw=1, label=name)
    for ax in (ax_loss, ax_speed):
        ax.axvline(args.kill_at, color="red", ls="--", lw=1)
    ax_loss.text(args.kill_at, ax_loss.get_ylim()[1], " kill -9", color="red", va="top")
    if len(parts) > 1:
        ax_loss.axvline(parts[1][0]["step"], color="gray", ls=":", lw=1)
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel("loss")
    ax_loss.legend(fontsize=8)
    ax_speed.axhline(short_row.tokens_per_s, color="black", ls=":", lw=1, label="8-step sweep point")
    ax_speed.set_ylabel("tokens/s (per logged interval)")
    ax_speed.set_xlabel("step")
    ax_speed.legend(fontsize=8)
    fig.suptitle(f"{long_row.model}, {long_row.recompute}: {rows[-1]['total']} steps, killed at {args.kill_at}, resumed")
    fig.tight_layout()
    fig.savefig(args.docs / "long-run.png", dpi=110)

    resumed = re.findall(r"resuming from \S+ \(step (\d+)\)", _read(args.docs / "console-2.txt"))
    print(f"steps logged: {len(rows)} rows in {len(parts)} processes; killed after step {args.kill_at}; "
          + (f"resumed from the checkpoint of step {resumed[0]} ({args.kill_at - int(resumed[0])} steps "
             "trained again)" if resumed else "not resumed"))
    if len(parts) > 1:  # the steps both processes trained: the same data, the same schedule
        first = {r["step"]: r for r in parts[0]}
        both = [(first[r["step"]], r) for r in parts[1] if r["step"] in first]
        if both:
            worst = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in both)
            print(f"steps trained twice (before the kill, after the resume): {len(both)} logged; "
                  f"largest relative loss difference {worst:.2e}; lr equal: "
                  f"{all(a['lr'] == b['lr'] for a, b in both)}")
    last = rows[-1]
    val = [r for r in rows if r.get("val_loss") is not None]
    print(f"final: step {last['step']}, loss {last['loss']:.4f}, lr {last['lr']:.3e}"
          + (f", validation loss {val[-1]['val_loss']:.4f} at step {val[-1]['step']}" if val else ""))
    print()
    print("| tokens/s | value | vs the 8-step point |")
    print("|---|---|---|")
    reference = short_row.tokens_per_s
    for what, value in (("8-step sweep point, measured window", reference),
                        (f"long run, measured window (steps {_window(long_result)})",
                         long_row.tokens_per_s),
                        ("long run, median of logged intervals after the resume", steady_tokens_per_s(parts[-1]))):
        print(f"| {what} | {value:,.0f} | {value / reference:.3f} |")


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _window(result: dict) -> str:
    span = next((r.get("window") for r in result.get("ranks") or [] if r.get("window")), None)
    return f"{span[0]}-{span[1]}" if span else "?"


if __name__ == "__main__":
    main()
