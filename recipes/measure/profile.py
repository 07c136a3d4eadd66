"""What drives the peak: one profiled training step, its memory timeline and the peak's attribution.

The guide's first decision depends on "the tensor that actually drives the per-rank peak".
``profile_step`` runs one extra training step after the timed ones (``profile=peak``, the default;
``profile=none`` turns it off) and records, for this rank, the bytes alive at the peak by module
kind (the ledger's kinds), ``parameters``, ``gradients``, ``optimizer_state`` and
``other/transient``, and the phase the peak falls in (forward of layer i, backward of layer j,
optimizer step). ``recipes.measure.memtrace`` records the step's ``Trace``; ``replay`` here walks it:

- GPU: the caching allocator's events for this one step. The peak is the sum of the blocks alive at
  the peak event, so the attribution adds up to the allocator's peak by construction (the check
  against ``max_memory_allocated`` is recorded: trace sizes are requested sizes, rounded here to the
  allocator's 512 bytes). Normal steps run without the recording.
- CPU: the storages saved for backward, gradients and optimizer state, so CI tests the logic. At
  the end of a micro-batch's forward the CPU attribution equals the ledger.

The timeline plots and the console and advisor helpers that read a profile are in
``recipes.measure.timeline``, which imports no torch (the controller and the report use them).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from recipes.build import compat
from recipes.config import typed
from recipes.errors import ConfigError
from recipes.measure.memtrace import BEFORE, Trace, record_cpu, record_gpu
from recipes.measure.timeline import BUCKETS, run_title, top_buckets
from recipes.recompute import KINDS

MODES = ("none", "peak")


# --- replay: the peak, what is alive there, and the timeline -------------------------------------


def _attribute(trace: Trace, sizes: dict[int, int]) -> dict:
    by_bucket = {b: 0 for b in BUCKETS}
    by_phase: dict[str, int] = {}
    by_layer: dict[str, int] = {}
    for blk, n in sizes.items():
        bucket, origin = trace.bucket[blk], trace.origin[blk]
        by_bucket[bucket] += n
        by_phase[origin] = by_phase.get(origin, 0) + n
        if bucket in KINDS and " layer " in origin:
            layer = origin.rsplit(" ", 1)[-1]
            by_layer[layer] = by_layer.get(layer, 0) + n
    top_phases = dict(sorted(by_phase.items(), key=lambda kv: -kv[1])[:8])
    return {"bytes_by_kind": by_bucket, "alive_by_phase": top_phases, "activation_bytes_by_layer": by_layer}


def replay(trace: Trace, num_samples: int = 400) -> dict:
    """Walk the events: the peak (the first event reaching the maximum), what is alive there and at
    the end of the first forward, and a down-sampled stacked timeline for plots."""
    sizes, total, totals = dict(trace.start), sum(trace.start.values()), []
    totals.append(total)
    for blk, n, _ in trace.events:
        if blk >= 0:
            total += n - sizes.get(blk, 0)
            sizes[blk] = n
        totals.append(total)
    peak_i = max(range(len(totals)), key=totals.__getitem__)
    phases = [BEFORE] + [phase for _, _, phase in trace.events]  # phase after i events
    fwd_end = next((i - 1 for i in range(1, len(phases)) if phases[i].startswith("backward")), None)
    step = max(1, len(totals) // num_samples)
    samples = set(range(0, len(totals), step)) | {peak_i, len(totals) - 1}
    series: dict[str, list[int]] = {b: [] for b in BUCKETS}
    xs, marks = [], {}
    sizes, by_bucket = dict(trace.start), {b: 0 for b in BUCKETS}
    for blk, n in sizes.items():
        by_bucket[trace.bucket[blk]] += n

    def visit(i: int) -> None:
        if i in samples:
            xs.append(i)
            for b in BUCKETS:
                series[b].append(by_bucket[b])
        if i in (peak_i, fwd_end):
            marks[i] = {b: n for b, n in sizes.items() if n}

    visit(0)
    for i, (blk, n, _) in enumerate(trace.events, start=1):
        if blk >= 0:
            by_bucket[trace.bucket[blk]] += n - sizes.get(blk, 0)
            sizes[blk] = n
        visit(i)
    spans: list[list] = []
    for i, phase in enumerate(phases):
        if spans and spans[-1][2] == phase:
            spans[-1][1] = i
        else:
            spans.append([i, i, phase])
    out = {"peak_bytes": totals[peak_i], "peak_phase": phases[peak_i], "peak_event": peak_i,
           "num_events": len(trace.events), **_attribute(trace, marks[peak_i])}
    out["forward_end"] = None
    if fwd_end is not None:
        at_end = _attribute(trace, marks[fwd_end])["bytes_by_kind"]
        out["forward_end"] = {"event": fwd_end, "phase": phases[fwd_end],
                              "activation_bytes_by_kind": {k: at_end[k] for k in KINDS}}
    out["timeline"] = {"x": xs, "series": {b: v for b, v in series.items() if any(v)},
                       "phases": spans, "total": [sum(series[b][j] for b in BUCKETS) for j in range(len(xs))]}
    return out


# --- the profiled step ---------------------------------------------------------------------------


def _reference_step(trainer, on_gpu: bool) -> dict:
    """One normal step to compare against: its time and peak (GPU) or its ledger (CPU)."""
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.step(record_ledger=not on_gpu)
    if on_gpu:
        torch.cuda.synchronize()
        return {"step_s": time.perf_counter() - t0, "peak_bytes": torch.cuda.max_memory_allocated()}
    return {"step_s": time.perf_counter() - t0, "ledger": dict(trainer.ledger.bytes_by_kind)}


#: Why a CPU run writes no memory snapshot.
NO_CPU_SNAPSHOT = ("no memory snapshot on a CPU: PyTorch's viewer (memory_viz) reads the CUDA caching allocator's "
                   "history, and a CPU has no such allocator; the profile's timeline is the saved tensors'")


def snapshot_path(run_dir: Path | str) -> Path:
    """Where the profiled step's allocator snapshot goes: ``memory_snapshot.pickle`` (rank 0), else
    ``memory_snapshot_rank<N>.pickle``; drag it into https://pytorch.org/memory_viz."""
    rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
    return Path(run_dir) / ("memory_snapshot.pickle" if rank == 0 else f"memory_snapshot_rank{rank}.pickle")


def profile_step(trainer, cfg: dict, run_dir: Path | None = None, step_time_s: float | None = None) -> dict:
    """Profile one extra training step (``measure.profile=peak``); returns the rank's ``profile``.

    Writes ``memory_timeline.png`` (rank 0; ``memory_timeline_rank<N>.png`` for others) into
    ``run_dir`` when given, and on a GPU the step's allocator snapshot (``snapshot_path``: for
    pytorch.org/memory_viz; ``profile["snapshot"]``; a CPU writes none, ``profile["snapshot_note"]``).
    ``step_time_s`` (the median of the timed steps) is the cost reference; without it, the reference
    step's time is used. A failure is recorded, never raised: the run's
    measurements stand without the profile.
    """
    cfg = typed(cfg)
    mode = cfg.measure.profile
    if mode not in MODES:
        raise ConfigError("measure.profile", f"unknown profile {mode!r}", "use profile=peak or profile=none")
    if mode == "none":
        return {}
    on_gpu = compat.cuda_available()
    try:
        ref = _reference_step(trainer, on_gpu)
        snapshot = snapshot_path(run_dir) if on_gpu and run_dir is not None else None
        trace, info = record_gpu(trainer, snapshot) if on_gpu else record_cpu(trainer)
        out = {"status": "ok", "source": "allocator" if on_gpu else "saved_tensors", **replay(trace)}
    except Exception as err:  # the run's own measurements are already in the result
        return {"status": "failed", "error": f"{type(err).__name__}: {err}"}
    out["snapshot"] = str(snapshot) if on_gpu and snapshot is not None else None
    if not on_gpu:
        out["snapshot_note"] = NO_CPU_SNAPSHOT
    baseline = step_time_s or ref["step_s"]
    cost = {"profiled_step_s": info.pop("profiled_step_s"), "step_time_s": baseline,
            "reference_step_s": ref["step_s"]}
    cost["time_ratio"] = cost["profiled_step_s"] / baseline if baseline else None
    if on_gpu:  # the allocator's peak with and without the recording, and the replay's sum
        cost.update(reference_peak_bytes=ref["peak_bytes"], profiled_peak_bytes=info["max_memory_allocated_bytes"])
        out["check"] = {**info, "replay_peak_bytes": out["peak_bytes"],
                        "sum_ratio": out["peak_bytes"] / info["max_memory_allocated_bytes"]}
        out["check"]["sum_within_2pct"] = abs(out["check"]["sum_ratio"] - 1) <= 0.02 and not info["unmatched_frees"]
    else:  # the ledger's measure (first forward of each chunk), without and with the profiling hooks
        out["ledger_bytes_by_kind"] = info["ledger_bytes_by_kind"]
        cost.update(reference_peak_bytes=sum(ref["ledger"].values()),
                    profiled_peak_bytes=sum(info["ledger_bytes_by_kind"].values()))
    if cost.get("reference_peak_bytes"):
        cost["peak_change"] = cost["profiled_peak_bytes"] / cost["reference_peak_bytes"] - 1
        cost["peak_change_within_1pct"] = abs(cost["peak_change"]) <= 0.01
    out["cost"] = cost
    out["top"] = top_buckets(out)
    out["title"] = run_title(cfg)
    return out
