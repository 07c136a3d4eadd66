"""result.json: one file per run, written atomically, schema versioned.

Each worker rank writes ``ranks/rank<N>.json``; the controller merges them into ``result.json``
with the worst rank (highest peak allocated, the one that decides whether a config fits) marked.
A run whose workers died without writing anything is still recorded, as ``failed``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from recipes.config import upgrade
from recipes.files import MIB, UnreadableFile, read_json
from recipes.offload import option_of as offload_option_of
from recipes.recompute import option_of

SCHEMA_VERSION = 1
#: Keys that do not change what a point measures: a stored result with other values still counts.
NOT_MEASURED = ("rerun", "dry_run", "name", "output_dir", "logger", "estimate", "lock_wait_s", "checkpoint",
                "fork_server")
#: Status severity: the run's status is its worst rank's. `stopped` (train.exit_interval) and
#: `preempted` (a signal) saved a checkpoint and ended early: not complete, a re-run resumes.
_SEVERITY = {"ok": 0, "stopped": 0.5, "preempted": 0.5, "oom": 1, "failed": 2, "refused": 3}


def read_ranks(run_dir: Path) -> list[dict]:
    """Every rank file of a run, ordered by rank."""
    files = sorted((Path(run_dir) / "ranks").glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    ranks = []
    for f in files:
        try:
            ranks.append(read_json(f))
        except UnreadableFile as err:  # counted as a rank that wrote nothing: the run is failed, not lost
            print(f"warning: skipped {err}", file=sys.stderr)
    return ranks


def worst_rank(ranks: list[dict]) -> int | None:
    """Index of the rank that decides fit: worst status, then highest peak (or ledger) memory."""
    if not ranks:
        return None

    def key(r: dict):
        mem = (r.get("memory") or {}).get("peak_allocated_gib")
        if mem is None:
            mem = (r.get("memory_at_failure") or {}).get("peak_allocated_gib", 0.0)
        # Without an allocator (CPU): the ledger bytes the pipeline schedule keeps in flight here
        ledger = (r.get("pipeline") or {}).get("in_flight_ledger_bytes") or (
            r.get("ledger") or {}).get("total_bytes", 0)
        return (_SEVERITY.get(r.get("status"), 2), mem or 0.0, ledger)

    return max(range(len(ranks)), key=lambda i: key(ranks[i]))


def merge_result(run_dir: Path, meta: dict, expected_ranks: int, launch_error: str | None) -> dict:
    """Combine rank files and run metadata into the run's result (not yet written)."""
    ranks = read_ranks(run_dir)
    result = {"schema_version": SCHEMA_VERSION, **meta, "ranks": ranks}
    missing = expected_ranks - len(ranks)
    if not ranks:
        result["status"] = "failed"
        result["error"] = launch_error or "no worker wrote a result"
    else:
        w = worst_rank(ranks)
        result["worst_rank"] = ranks[w].get("rank", w)
        result["status"] = max((r.get("status", "failed") for r in ranks), key=_SEVERITY.get)
        errors = [r["error"] for r in ranks if r.get("error")]
        if errors:
            result["error"] = errors[0]
        if missing > 0:
            result["status"] = "failed" if result["status"] == "ok" else result["status"]
            result.setdefault("error", f"{missing} rank(s) wrote no result: {launch_error}")
    return result


def load_result(path: Path) -> dict:
    """A result.json, or a directory holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / "result.json"
    result = read_json(path)
    if isinstance(result, dict) and isinstance(result.get("config"), dict):
        result["config"] = upgrade(result["config"])  # written by an earlier version: today's schema
    return result


def recompute_of(result: dict) -> str | None:
    """The recompute option a point ran, from its recorded config (recipes.recompute.option_of),
    so that a point composed as ``recompute=control recompute.recompute_modules=[...]`` is not read as
    a control; results without a config fall back to the Hydra choice."""
    config = result.get("config")
    if config and "recompute" in config:
        return option_of(config)
    return (result.get("choices") or {}).get("recompute")


@dataclass
class RankRow:
    """The numbers of one rank of one point, read once from ``result.json``: what the console, the
    report, the advisor, W&B and the benchmarks show. An ``oom`` rank reports the allocator at the
    failure; a point with no rank result (refused, died at launch) has one row with ``rank=None``."""

    point: str | None  # the run's name
    run_dir: str | None
    point_status: str | None  # the run's status (its worst rank's)
    status: str | None  # this rank's
    model: str | None
    attention: str | None
    recompute: str | None  # what the recorded config recomputes (``recompute_of``)
    rank: int | None = None
    offload: str = "none"  # what it offloads (``recipes.offload.option_of``)
    worst: bool = False  # the rank that decides whether the point fits
    coords: dict = field(default_factory=dict)
    host: str | None = None
    device: str | None = None
    error: str | None = None
    peak_allocated_gib: float | None = None
    peak_reserved_gib: float | None = None
    fragmentation_gib: float | None = None
    activation_gib: float | None = None
    ledger_bytes: int | None = None
    profile_peak_bytes: int | None = None
    step_time_s: float | None = None  # median of the timed steps (of the processes' medians when repeated)
    step_time_min_s: float | None = None
    step_time_spread: float | None = None  # slowest / fastest process median - 1 (measure.repeat)
    repeats: int | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    model_tflops_per_gpu: float | None = None
    hardware_tflops_per_gpu: float | None = None
    recompute_flops_fraction: float | None = None  # forward work replayed by recompute, over the model's
    gpu_busy_s: float | None = None  # one profiled step's GPU busy time (measure.gpu_time; median when repeated)
    host_wait_s: float | None = None  # the host's wait for the GPU at the grad-norm read (near 0: host-bound)
    gpu_busy_spread: float | None = None  # slowest / fastest process's GPU busy time - 1 (measure.repeat)
    pipeline: dict = field(default_factory=dict)
    last_loss: float | None = None
    # activation offload: what one micro-batch's forward copied to the host, what a measured step
    # moved out (and back), and on a GPU the seconds compute waited for reloads in one step
    host_bytes: int | None = None
    moved_bytes_per_step: int | None = None
    reload_wait_s: float | None = None

    @property
    def ledger_mib(self) -> float | None:
        return self.ledger_bytes / MIB if self.ledger_bytes is not None else None

    @property
    def host_mib(self) -> float | None:
        return self.host_bytes / MIB if self.host_bytes is not None else None

    @property
    def reload_wait_ms(self) -> float | None:
        return self.reload_wait_s * 1e3 if self.reload_wait_s is not None else None

    @property
    def step_ms(self) -> float | None:
        return self.step_time_s * 1e3 if self.step_time_s is not None else None

    @property
    def gpu_ms(self) -> float | None:
        return self.gpu_busy_s * 1e3 if self.gpu_busy_s is not None else None

    @property
    def step_noise(self) -> float | None:
        """Median step / fastest step - 1: the spread inside one process."""
        s, fast = self.step_time_s, self.step_time_min_s
        return s / fast - 1.0 if s and fast else None


def rank_row(result: dict, rank: dict) -> RankRow:
    """One rank of a point as a ``RankRow``."""
    choices = result.get("choices") or {}
    mem = rank.get("memory") or rank.get("memory_at_failure") or {}
    timing = rank.get("timing") or {}
    alloc, reserved = mem.get("peak_allocated_gib"), mem.get("peak_reserved_gib")
    frag = mem.get("fragmentation_gib")
    if frag is None and alloc is not None and reserved is not None:
        frag = reserved - alloc
    losses = [x for x in rank.get("loss") or [] if x is not None]
    status = rank.get("status") or result.get("status")
    offload = rank.get("offload") or {}
    return RankRow(
        point=result.get("name"), run_dir=result.get("run_dir"), point_status=result.get("status"), status=status,
        model=choices.get("model"), attention=choices.get("attention"), recompute=recompute_of(result),
        offload=offload_option_of(result.get("config") or {}),
        rank=rank.get("rank"), worst=rank.get("rank") is not None and rank.get("rank") == result.get("worst_rank"),
        coords=rank.get("coords") or {}, host=rank.get("host"), device=rank.get("device"),
        error=rank.get("error") or (result.get("error") if status != "ok" else None),
        peak_allocated_gib=alloc, peak_reserved_gib=reserved, fragmentation_gib=frag,
        activation_gib=mem.get("activation_gib"), ledger_bytes=(rank.get("ledger") or {}).get("total_bytes"),
        profile_peak_bytes=(rank.get("profile") or {}).get("peak_bytes"),
        step_time_s=timing.get("step_time_s"), step_time_min_s=timing.get("step_time_min_s"),
        step_time_spread=timing.get("step_time_spread"), repeats=timing.get("repeats"),
        tokens_per_s=timing.get("tokens_per_s"), mfu=timing.get("mfu"),
        model_tflops_per_gpu=timing.get("model_tflops_per_gpu"), hardware_tflops_per_gpu=timing.get("hardware_tflops_per_gpu"),
        recompute_flops_fraction=timing.get("recompute_flops_fraction"), pipeline=rank.get("pipeline") or {},
        gpu_busy_s=gpu_busy_s(rank), host_wait_s=timing.get("host_wait_s"), gpu_busy_spread=(rank.get("trace") or {}).get("gpu_busy_spread"),
        last_loss=losses[-1] if losses else None,
        host_bytes=(rank.get("ledger") or {}).get("host_total_bytes") if offload else None,
        moved_bytes_per_step=(offload.get("moved_per_step") or {}).get("d2h_bytes"),
        reload_wait_s=measured_value(offload.get("reload_wait_s")),
    )


def measured_value(value) -> float | None:
    """A measurement's value; None where it was not taken or failed (a failure is recorded as a dict)."""
    return value if isinstance(value, int | float) else None


def gpu_busy_s(rank: dict) -> float | None:
    """The GPU's busy time in the rank's profiled step (``measure.gpu_time``, ``trace_step``, offload):
    kernels, copies and memsets, idle gaps left out. Traces recorded before ``gpu_busy_s`` was stored
    give it as their span less their idle time."""
    trace = rank.get("trace") or {}
    if trace.get("gpu_busy_s") is not None:
        return trace["gpu_busy_s"]
    if trace.get("span_s") is not None and trace.get("gpu_idle_s") is not None:
        return trace["span_s"] - trace["gpu_idle_s"]
    return None


def result_rows(result: dict) -> list[RankRow]:
    """Every rank of a point, in rank order (one row with ``rank=None`` when no rank wrote a result)."""
    return [rank_row(result, r) for r in result.get("ranks") or [{}]]


def deciding_rank(result: dict) -> dict:
    """The rank entry that decides whether a point fits (the merged ``worst_rank``; its only one when it
    has one; an empty one when no rank wrote a result)."""
    ranks = result.get("ranks") or [{}]
    worst = result.get("worst_rank")
    return next((r for r in ranks if r.get("rank") is not None and r.get("rank") == worst), ranks[0])


def worst_row(result: dict) -> RankRow:
    """The rank that decides whether a point fits, as a row."""
    return rank_row(result, deciding_rank(result))


def first_sentence(error: str | None) -> str:
    """An error's first line, and of torch's OOM message only the part up to the size it tried to
    allocate (the rest is torch's generic advice, which the advisor gives in context)."""
    text = (error or "").splitlines()[0] if error else ""
    cut = text.find(". GPU ")
    return text[: cut + 1] if cut > 0 else text
