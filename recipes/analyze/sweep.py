"""A sweep's results: the ``result.json`` files under its directory, in order, its manifest, and a
point run in several processes (``measure.repeat``) merged into one: the median of its processes."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from recipes.files import UnreadableFile, write_json_atomic
from recipes.results import (
    NOT_MEASURED,  # config sections that do not change a measurement
    gpu_busy_s,
    load_result,
    measured_value,
)

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
            if f.absolute() not in _WARNED:  # once per file (the advisor reads a sweep several times)
                _WARNED.add(f.absolute())  # not resolve(): links to one target are each named
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
    4.9 ms in three processes of one point on an H200 (docs/offload.md); None when none timed them."""
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
