"""result.json: one file per run, written atomically, schema versioned.

Each worker rank writes ``ranks/rank<N>.json``; the controller merges them into ``result.json``
with the worst rank (highest peak allocated, the one that decides whether a config fits) marked.
A run whose workers died without writing anything is still recorded, as ``failed``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from recipes.config import _defaults, upgrade
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


@dataclass
class RankResult:
    """One rank's result: what the worker and the measured window (``recipes.run.window``) record, written
    as ``ranks/rank<N>.json``. One field per key, so a misspelled one raises (``AttributeError``) where a
    dict took it. A field is written once recorded: given to the constructor other than None, or
    assigned (None too: ``window`` is null when the run measured nothing); the file lists them in the
    order they were recorded, as the worker's dict always did. Sections the tools read by key (timing,
    memory, ledger, ...) stay dicts: see docs/outputs.md for their keys."""

    rank: int | None = None
    status: str | None = None  # ok | stopped | preempted | oom | failed | refused (_SEVERITY)
    host: str | None = None
    device: str | None = None  # the GPU's name, or "cpu"
    timeline: dict[str, float] | None = None  # when each phase of the worker ended (time.time())
    cpu_cores: list[int] | None = None  # launcher.cpu_cores_per_rank: the cores it was pinned to
    coords: dict[str, int] | None = None  # its place in the parallel layout
    num_parameters: int | None = None
    optimizer: str | None = None
    precision: str | None = None
    memory_after_init: dict[str, float] | None = None
    labels: dict[str, dict] | None = None  # per recompute label: modules wrapped, regions, saved bytes
    resumed_from: dict | None = None  # {"path", "step"} of the checkpoint it continued
    checkpoint_notes: list[str] | None = None
    first_step: int | None = None
    window: list[int] | None = None  # [start, end] of the measured steps; null: none in this process
    phase: str | None = None  # before_window | window | after_window: where a failure struck
    setup_s: float | None = None
    ledger: dict | None = None
    offload: dict | None = None
    pipeline: dict | None = None
    checkpoints: dict[str, dict] | None = None  # checkpoint regions per step, by label
    timing: dict | None = None
    memory: dict[str, float] | None = None
    module_times: dict | None = None
    trace: dict | None = None
    profile: dict | None = None
    # the control ledger's warnings until the run's end (the checkpoint carries them): written only by
    # a rank that failed before
    ledger_warnings: list[str] | None = field(default=None, metadata={"key": "_ledger_warnings"})
    control_abandoned: bool | None = None  # until main reads it (CONTROL_ABANDONED)
    moe_routing: dict | None = None
    signal: str | None = None  # the signal that preempted it
    checkpoint: dict | None = None  # {"path", "step"} of the last checkpoint saved
    stopped_at: int | None = None
    stop_reason: str | None = None
    loss: list[float | None] | None = None  # per step (None off the last pipeline stage)
    grad_norm: list[float | None] | None = None  # before clipping
    lr: list[float | None] | None = None
    eval_loss: list[dict] | None = None
    warnings: list[str] | None = None
    error: str | None = None
    memory_at_failure: dict[str, float] | None = None
    traceback: str | None = None
    #: keys of a file no field holds (written by another version), kept as read and written back last
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_recorded", {f.name: None for f in fields(self)
                                               if f.name != "extra" and getattr(self, f.name) is not None})

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self.__dataclass_fields__:
            raise AttributeError(f"a rank result has no field {name!r} (fields: recipes.results.RankResult)")
        object.__setattr__(self, name, value)
        if "_recorded" in self.__dict__ and name != "extra":  # set after __init__: recorded
            self._recorded[name] = None

    def pop(self, name: str, default: Any = None) -> Any:
        """A recorded field's value, no longer recorded (``default`` when it was not)."""
        if name not in self._recorded:
            getattr(self, name)  # a misspelled name raises
            return default
        value = getattr(self, name)
        del self._recorded[name]
        object.__setattr__(self, name, None)
        return value

    def record(self, values: dict) -> None:
        """Record ``values`` by their keys in the file (a checkpoint's measurements, a file read back);
        a key no field holds goes to ``extra``."""
        for key, value in values.items():
            name = _RANK_FIELD.get(key, key)
            if name in self.__dataclass_fields__ and name != "extra":
                setattr(self, name, value)
            else:
                self.extra[key] = value

    @classmethod
    def from_dict(cls, data: dict) -> RankResult:
        """A rank file's content (of any version) as a ``RankResult``: ``as_dict`` gives it back."""
        result = cls()
        result.record(data)
        return result

    def as_dict(self) -> dict:
        """The rank's JSON: its recorded fields, in the order recorded, by their keys in the file. Shallow:
        the sections are this result's own."""
        out = {_RANK_KEY.get(name, name): getattr(self, name) for name in self._recorded}
        return {**out, **{k: v for k, v in self.extra.items() if k not in out}}

    # read by key as well, as a rank dict is (``label_findings`` takes either; a recorded key only)
    def __getitem__(self, key: str) -> Any:
        name = _RANK_FIELD.get(key, key)
        if name in self._recorded:
            return getattr(self, name)
        if key in self.extra:
            return self.extra[key]
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: str) -> bool:
        return _RANK_FIELD.get(key, key) in self._recorded or key in self.extra


#: Field -> key in the file, where they differ (and back).
_RANK_KEY = {f.name: f.metadata["key"] for f in fields(RankResult) if "key" in f.metadata}
_RANK_FIELD = {key: name for name, key in _RANK_KEY.items()}


def load_rank(path: Path) -> RankResult:
    """A ``ranks/rank<N>.json`` file (of any version) as a ``RankResult``."""
    return RankResult.from_dict(read_json(path))


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


class BadResult(UnreadableFile):
    """A ``result.json`` that is not a run's result: not a file, not JSON, or JSON of the wrong shape
    (a list, a field of the wrong type). Its message names the file, what is wrong and the fix."""

    def __init__(self, path: Path, why: str):
        self.path = Path(path)
        ValueError.__init__(self, f"{path}: {why}; move it away or delete it (re-running the sweep's "
                                  "command measures that point again)")


#: The fields of a result and of each rank that the tools read, with their JSON types (None is
#: always allowed: a field a run did not record). Other fields are not checked.
_NUMBER = (int, float)
RESULT_FIELDS = {"schema_version": int, "status": str, "name": str, "run_dir": str, "error": str,
                 "worst_rank": int, "repeats": int, "config": dict, "choices": dict, "overrides": list,
                 "ranks": list}
RANK_FIELDS = {"rank": int, "status": str, "error": str, "host": str, "device": str, "memory": dict,
               "memory_at_failure": dict, "timing": dict, "ledger": dict, "profile": dict, "trace": dict,
               "pipeline": dict, "coords": dict, "offload": dict, "module_times": dict, "moe_routing": dict,
               "labels": dict, "loss": list, "grad_norm": list, "warnings": list}
#: Numbers inside a rank's sections (``RankRow``'s columns, the advisor's and the estimator's inputs).
RANK_NUMBERS = {"memory": ("peak_allocated_gib", "peak_reserved_gib", "fragmentation_gib", "activation_gib",
                           "static_allocated_gib", "total_gib"),
                "memory_at_failure": ("peak_allocated_gib", "peak_reserved_gib", "allocated_gib", "reserved_gib"),
                "timing": ("step_time_s", "step_time_min_s", "step_time_max_s", "step_time_spread", "repeats",
                           "tokens_per_s", "mfu", "model_tflops_per_gpu", "hardware_tflops_per_gpu",
                           "recompute_flops_fraction", "host_wait_s"),
                "ledger": ("total_bytes", "host_total_bytes", "control_total_bytes"),
                "profile": ("peak_bytes",), "trace": ("gpu_busy_s", "span_s", "gpu_idle_s", "gpu_busy_spread"),
                "pipeline": ("in_flight_ledger_bytes",), "coords": ("pp", "tp", "dp", "ep", "cp", "rank")}
#: Objects inside a rank's sections.
RANK_OBJECTS = {"offload": ("moved_per_step", "link", "transfer", "groups_moved", "groups_kept"),
                "ledger": ("bytes_by_kind", "host_bytes_by_kind", "control_bytes_by_kind"),
                "trace": ("copies",), "timing": ("gc",)}


def _type_name(value) -> str:
    return "null" if value is None else {dict: "object", list: "list", str: "string", bool: "boolean",
                                         int: "number", float: "number"}.get(type(value), type(value).__name__)


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _wrong(where: str, value, want: type | tuple) -> str | None:
    """Why ``value`` is not of type ``want`` (None when it is, or is null)."""
    if value is None:
        return None
    wants = want if isinstance(want, tuple) else (want,)
    if isinstance(value, bool) and bool not in wants or not isinstance(value, wants):
        names = " or ".join(sorted({_type_name(w()) for w in wants}))
        return f"{where} is {_a(_type_name(value))}, not {_a(names)}"
    return None


def _config_problem(stored, default, where: str) -> str | None:
    """The first field of a stored config whose JSON type differs from the schema default's (a
    section that is not an object, a number where a string belongs); None when it has none."""
    if isinstance(default, dict):
        if not isinstance(stored, dict):
            return f"{where} is {_a(_type_name(stored))}, not an object"
        for key in default.keys() & stored.keys():
            why = _config_problem(stored[key], default[key], f"{where}.{key}")
            if why:
                return why
        return None
    if stored is None or default is None or default == MISSING:  # MISSING: a size sets it (any type)
        return None
    want = bool if isinstance(default, bool) else _NUMBER if isinstance(default, _NUMBER) else type(default)
    return _wrong(where, stored, want)


def result_problem(result) -> str | None:
    """What makes a parsed ``result.json`` unusable by the tools (None when nothing does): the
    fields they read, at the JSON types the worker and the controller write."""
    if not isinstance(result, dict):
        return f"{_a('JSON ' + _type_name(result))}, not an object"
    for key, want in RESULT_FIELDS.items():
        why = _wrong(key, result.get(key), want)
        if why:
            return why
    if result.get("status") is None:
        return "no status"
    for key in ("choices", "overrides"):
        values = result.get(key) or {}
        for k, v in values.items() if isinstance(values, dict) else enumerate(values):
            why = _wrong(f"{key}[{k!r}]", v, str)
            if why:
                return why
    if result["status"] not in _SEVERITY:
        return f"status {result['status']!r} is none of {', '.join(_SEVERITY)}"
    for i, rank in enumerate(result.get("ranks") or []):
        if not isinstance(rank, dict):
            return f"ranks[{i}] is {_a(_type_name(rank))}, not an object"
        for key, want in RANK_FIELDS.items():
            why = _wrong(f"ranks[{i}].{key}", rank.get(key), want)
            if why:
                return why
        for want, sections in ((_NUMBER, RANK_NUMBERS), (dict, RANK_OBJECTS)):
            for section, keys in sections.items():
                for key in keys:
                    why = _wrong(f"ranks[{i}].{section}.{key}", (rank.get(section) or {}).get(key), want)
                    if why:
                        return why
        for key in ("loss", "grad_norm"):
            for j, x in enumerate(rank.get(key) or []):
                why = _wrong(f"ranks[{i}].{key}[{j}]", x, _NUMBER)
                if why:
                    return why
    if result.get("config") is not None:
        return _config_problem(result["config"], _defaults(), "config")
    return None


def load_result(path: Path) -> dict:
    """A result.json, or a directory holding one, checked (``result_problem``): one that cannot be
    read or is not a run's result raises ``BadResult`` (an ``UnreadableFile``) naming it and the fix."""
    path = Path(path)
    if path.is_dir() and (path / "result.json").exists():
        path = path / "result.json"
    if path.is_dir():
        raise BadResult(path, "a directory, not a run's result")
    if path.exists() and not path.is_file():  # /dev/zero, a FIFO: reading it would never end
        raise BadResult(path, "not a regular file (a device or a pipe), not a run's result")
    try:
        result = read_json(path)
    except UnreadableFile as err:
        raise BadResult(path, f"not JSON, truncated or not a result ({err.__cause__})") from err
    except OSError as err:
        raise BadResult(path, f"cannot be read ({err.strerror or err})") from err
    why = result_problem(result)
    if why:
        raise BadResult(path, f"not a run's result: {why}")
    if isinstance(result.get("config"), dict):
        try:  # written by an earlier version: today's schema; what the tools read of it must read
            result["config"] = upgrade(result["config"])
            recompute_of(result), offload_option_of(result["config"])
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            raise BadResult(path, f"not a run's result: its config does not read ({type(err).__name__}: {err})") from err
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
