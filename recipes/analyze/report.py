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
import json
import statistics
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from recipes.analyze.logger import sweep_group, usable_logger
from recipes.files import MIB, UnreadableFile, write_json_atomic
from recipes.measure.profile import plot_timelines
from recipes.recompute import recompute_order
from recipes.results import (
    NOT_MEASURED,  # config sections that do not change a measurement
    RankRow,
    first_sentence,
    gpu_busy_s,
    load_result,
    measured_value,
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


_WARNED: set[Path] = set()


def find_results(sweep_dir: Path) -> list[dict]:
    """Every result.json under a sweep directory (one per point); a run directory also works.

    Ordered by each point's overrides, not its directory name: a short name ends in a hash, which
    would order points at random. Results without recorded overrides (before they were recorded)
    order by the name of the directory they ran in, which spelled the overrides out."""
    files = sorted(Path(sweep_dir).glob("*/result.json"))
    if not files and (Path(sweep_dir) / "result.json").exists():
        files = [Path(sweep_dir) / "result.json"]
    results = []
    for f in files:
        try:
            results.append(load_result(f))
        except UnreadableFile as err:  # a kill mid-write elsewhere, a hand edit: name it, keep the rest
            if f.resolve() not in _WARNED:  # once per file (the advisor reads a sweep several times)
                _WARNED.add(f.resolve())
                print(f"warning: skipped {err}", file=sys.stderr)
    return sorted(results, key=_order)


def _order(result: dict) -> str:
    overrides = result.get("overrides")
    if overrides:
        return "__".join(str(o).replace("/", ".") for o in overrides)
    return Path(result.get("run_dir") or "").name


def write_manifest(sweep_dir: Path) -> Path:
    """``manifest.json``: each point directory's full overrides, name and status (the directory names
    are short; this says what each one ran)."""
    manifest = {}
    for f in sorted(Path(sweep_dir).glob("*/result.json")):
        try:
            r = load_result(f)
        except UnreadableFile as err:
            manifest[f.parent.name] = {"status": "unreadable", "error": str(err)}
            continue
        manifest[f.parent.name] = {"overrides": r.get("overrides"), "name": r.get("name"), "status": r.get("status")}
    path = Path(sweep_dir) / "manifest.json"
    write_json_atomic(path, manifest)
    return path


def _without_repeat(config: dict) -> dict:
    """The config minus ``measure.repeat``: repetitions of a point measure the same thing."""
    if isinstance(config.get("measure"), dict) and "repeat" in config["measure"]:
        config = {**config, "measure": {k: v for k, v in config["measure"].items() if k != "repeat"}}
    return config


def match_key(result: dict, varied: tuple[str, ...] = ("recompute", "offload")) -> str:
    """What must be equal for two points to be compared: everything but the ``varied`` sections
    (recompute and activation offload: the two ways to buy memory, compared against one control)."""
    config = result.get("config")
    if not config:
        choices = result.get("choices", {})
        return "|".join(str(choices.get(k)) for k in ("model", "attention") if k not in varied)
    rest = {k: v for k, v in _without_repeat(config).items() if k not in NOT_MEASURED + varied}
    return json.dumps(rest, sort_keys=True, default=str)


def merge_repeats(results: list[dict]) -> list[dict]:
    """One result per point: completed repetitions of a point (``measure.repeat=0,1,2``, one process
    each) merged. Per rank: step time = the median of the processes' medians, fastest = the fastest
    step of any, ``step_time_spread`` = slowest / fastest process median - 1 (the between-process
    noise that one process cannot show), peaks = the highest, module times (``measure.module_times``:
    what the planner prices replays from) the median of the processes' for each module and layer.
    Failed repetitions stay separate rows."""
    groups: dict[str, list[dict]] = {}
    out: list[dict] = []
    for r in results:
        if r.get("status") == "ok" and r.get("config"):
            groups.setdefault(match_key(r, ()), []).append(r)
        else:
            out.append(r)
    for same in groups.values():
        if len(same) == 1:
            out.append(same[0])
            continue
        merged = {**same[0], "repeats": len(same), "ranks": []}
        for rank in same[0].get("ranks") or []:
            peers = [next((x for x in r.get("ranks") or [] if x.get("rank") == rank.get("rank")), None) for r in same]
            peers = [x for x in peers if x is not None]
            timing = dict(rank.get("timing") or {})
            medians = [x["timing"]["step_time_s"] for x in peers if (x.get("timing") or {}).get("step_time_s")]
            if medians:
                scale = statistics.median(medians) / timing["step_time_s"] if timing.get("step_time_s") else 1.0
                timing.update(step_time_s=statistics.median(medians), step_time_spread=max(medians) / min(medians) - 1,
                              step_time_min_s=min(x["timing"].get("step_time_min_s") or m
                                                  for x, m in zip(peers, medians)), repeats=len(medians))
                for key in ("tokens_per_s", "model_tflops_per_gpu", "hardware_tflops_per_gpu", "mfu"):
                    if timing.get(key) is not None:
                        timing[key] = timing[key] / scale
            busy = [b for b in (gpu_busy_s(x) for x in peers) if b is not None]
            trace = dict(rank.get("trace") or {})
            if len(busy) > 1:
                trace.update(gpu_busy_s=statistics.median(busy), gpu_busy_spread=max(busy) / min(busy) - 1)
            memory = dict(rank.get("memory") or {})
            for key in ("peak_allocated_gib", "peak_reserved_gib"):
                values = [(x.get("memory") or {}).get(key) for x in peers]
                if all(v is not None for v in values) and values:
                    memory[key] = max(values)
            if memory.get("peak_allocated_gib") is not None and memory.get("peak_reserved_gib") is not None:
                memory["fragmentation_gib"] = memory["peak_reserved_gib"] - memory["peak_allocated_gib"]
            times = merge_module_times([x.get("module_times") for x in peers])
            offload = dict(rank.get("offload") or {})
            waits = [w for x in peers if (w := measured_value((x.get("offload") or {}).get("reload_wait_s"))) is not None]
            if len(waits) > 1:
                offload["reload_wait_s"] = statistics.median(waits)
            merged["ranks"].append({**rank, "timing": timing, "memory": memory or rank.get("memory"),
                                    **({"trace": trace} if trace else {}),
                                    **({"offload": offload} if offload else {}),
                                    **({"module_times": times} if times else {})})
        out.append(merged)
    return out


def merge_module_times(peers: list[dict | None]) -> dict | None:
    """One point's module times (``recipes.measure.moduletime``) from its processes: for each module
    and layer, the median of the processes that timed it with the same layers. One process's pass is
    one forward and backward, and an MoE layer's forward (its stream waiting for the host) took 2.9 to
    4.9 ms in three processes of one point on an H200 (docs/offload-log.md); None when none timed them."""
    timed = [t for t in peers if t and "forward_ms" in t]
    if len(timed) < 2:
        return timed[0] if timed else None
    same = [t for t in timed if t.get("layers") == timed[0].get("layers")]
    merged = dict(same[0])
    for key in ("forward_ms", "replay_ms"):
        names = set().union(*((t.get(key) or {}).keys() for t in same))
        merged[key] = {}
        for name in sorted(names):
            rows = [t[key][name] for t in same if name in (t.get(key) or {})]
            merged[key][name] = [statistics.median(values) for values in zip(*rows)]
    marks = [t["marks"] for t in same if t.get("marks")]  # timelines do not merge: priced each, then the median
    if marks:
        merged["marks"] = marks
    return merged


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


def point_rows(rows: list[dict]) -> list[dict]:
    """The rows that decide fit: each point's worst rank (or its only row)."""
    return [r for r in rows if r["worst"] or r["rank"] is None]


def memory_axis(rows: list[dict]) -> tuple[str, str]:
    """The memory a point is judged by: peak allocated (GPU), else the activation ledger (CPU)."""
    if any(r.get("peak_allocated_gib") is not None and r["status"] == "ok" for r in rows):
        return "peak_allocated_gib", "peak allocated GiB (worst rank)"
    return "ledger_mib", "activation ledger MiB (CPU run: no allocator peaks)"


def pareto_front(rows: list[dict], mem_key: str) -> list[dict]:
    """Points no other point beats on both memory and step time, fastest first."""
    pts = [r for r in rows if r["status"] == "ok" and r.get(mem_key) is not None and r.get("step_ms") is not None]
    front = [p for p in pts if not any(
        q[mem_key] <= p[mem_key] and q["step_ms"] <= p["step_ms"]
        and (q[mem_key] < p[mem_key] or q["step_ms"] < p["step_ms"]) for q in pts)]
    return sorted(front, key=lambda p: p["step_ms"])


def short_label(row: dict, rows: list[dict]) -> str:
    """The recompute choice, with model/attention added only when the sweep varies them."""
    parts = [row[k] for k in ("model", "attention") if len({r[k] for r in rows}) > 1]
    return " ".join(str(p) for p in parts + [row["recompute"] or row["point"]])


def plot_pareto(rows: list[dict], path: Path, title: str) -> Path:
    """Peak memory against step time for every measured point, Pareto frontier marked; ``path``."""
    # lazy: only when plotting
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = point_rows(rows)
    mem_key, mem_label = memory_axis(points)
    measured = [r for r in points
                if r["status"] == "ok" and r.get(mem_key) is not None and r.get("step_ms") is not None]
    front = pareto_front(points, mem_key)
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    ax.scatter([r["step_ms"] for r in measured], [r[mem_key] for r in measured], s=36, color="0.55",
               zorder=2, label="measured point")
    ax.plot([r["step_ms"] for r in front], [r[mem_key] for r in front], "-o", color="tab:red", ms=8,
            drawstyle="steps-post", zorder=3, label="Pareto frontier (nothing is both faster and smaller)")
    for group in _near(measured, mem_key):  # one label per cluster: none and control often coincide
        ax.annotate("\n".join(short_label(r, points) for r in group), (group[0]["step_ms"], group[0][mem_key]),
                    textcoords="offset points", xytext=(6, 4), fontsize=8, va="bottom")
    lost = [f"{short_label(r, points)}: {r['status']}" for r in points if r not in measured]
    if lost:
        ax.text(0.99, 0.99, "not plotted\n" + "\n".join(lost), transform=ax.transAxes, ha="right",
                va="top", fontsize=7, color="tab:red", bbox={"fc": "white", "ec": "0.8"})
    ax.set_xlabel("step time ms (median of steady-state steps, worst rank)")
    ax.set_ylabel(mem_label)
    if mem_key == "ledger_mib":
        title += "\nledger = bytes saved for backward in one micro-batch (activations only)"
    ax.set_title(title, fontsize=9)
    ax.margins(x=0.25, y=0.12)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _near(points: list[dict], mem_key: str, frac: float = 0.03) -> list[list[dict]]:
    """Points closer than ``frac`` of both axis spans, grouped (for one label per group)."""
    if not points:
        return []
    span = lambda k: (max(p[k] for p in points) - min(p[k] for p in points)) or 1.0  # noqa: E731
    dx, dy = span("step_ms") * frac, span(mem_key) * frac
    groups: list[list[dict]] = []
    for p in sorted(points, key=lambda p: (p["step_ms"], p[mem_key])):
        home = next((g for g in groups if abs(g[0]["step_ms"] - p["step_ms"]) <= dx
                     and abs(g[0][mem_key] - p[mem_key]) <= dy), None)
        home.append(p) if home is not None else groups.append([p])
    return groups


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
