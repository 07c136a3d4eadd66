"""result.json: one file per run, written atomically, schema versioned.

Each worker rank writes ``ranks/rank<N>.json``; the controller merges them into ``result.json``
with the worst rank (highest peak allocated, the one that decides whether a config fits) marked.
A run whose workers died without writing anything is still recorded, as ``failed``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from recipes.validate import recompute_option

SCHEMA_VERSION = 1
GIB = 1024**3
#: Status severity: the run's status is its worst rank's.
_SEVERITY = {"ok": 0, "oom": 1, "failed": 2, "refused": 3}


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to a temp file in the same directory, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_ranks(run_dir: Path) -> list[dict]:
    """Every rank file of a run, ordered by rank."""
    files = sorted((Path(run_dir) / "ranks").glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(f.read_text()) for f in files]


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
    return json.loads(path.read_text())


def recompute_of(result: dict) -> str | None:
    """The recompute option a point ran, from its recorded config (recipes.validate.recompute_option),
    so that a point composed as ``recompute=control recompute.recompute_modules=[...]`` is not read as
    a control; results without a config fall back to the Hydra choice."""
    config = result.get("config")
    if config and "recompute" in config:
        return recompute_option(config)
    return (result.get("choices") or {}).get("recompute")


def summary(result: dict) -> dict:
    """The flat numbers of a run (its worst rank) for tables, W&B and the advisor."""
    row = {
        "name": result.get("name"),
        "status": result.get("status"),
        "recompute": recompute_of(result),
        "attention": result.get("choices", {}).get("attention"),
        "model": result.get("choices", {}).get("model"),
    }
    ranks = result.get("ranks") or []
    if not ranks:
        return row
    r = ranks[[x.get("rank") for x in ranks].index(result.get("worst_rank", ranks[0].get("rank")))]
    mem = r.get("memory") or {}
    timing = r.get("timing") or {}
    ledger = r.get("ledger") or {}
    row.update(
        worst_rank=r.get("rank"),
        peak_allocated_gib=mem.get("peak_allocated_gib"),
        peak_reserved_gib=mem.get("peak_reserved_gib"),
        fragmentation_gib=mem.get("fragmentation_gib"),
        activation_gib=mem.get("activation_gib"),
        step_time_s=timing.get("step_time_s"),
        tokens_per_s=timing.get("tokens_per_s"),
        mfu=timing.get("mfu"),
        ledger_gib=(ledger.get("total_bytes") or 0) / GIB if ledger else None,
        ledger_bytes=ledger.get("total_bytes"),
    )
    if r.get("status") == "oom":
        row["peak_allocated_gib"] = (r.get("memory_at_failure") or {}).get("peak_allocated_gib")
    return row


def first_sentence(error: str | None) -> str:
    """An error's first line, and of torch's OOM message only the part up to the size it tried to
    allocate (the rest is torch's generic advice, which the advisor gives in context)."""
    text = (error or "").splitlines()[0] if error else ""
    cut = text.find(". GPU ")
    return text[: cut + 1] if cut > 0 else text
