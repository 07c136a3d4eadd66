"""Python's garbage collections inside the measured steps: how many, and how long the host paused.

A full (generation 2) collection walks every object the process tracks: after megatron-core's imports
and a model's build about half a million, 0.27 s on this repository's 2-core CI machine. A step whose
GPU waits on the host for its next kernels (an MoE step launches about 4,600) takes such a pause in
full. ``train.manual_gc`` (``recipes.run.collector``) keeps the collector out of the steps; this meter
shows whether it ran there (``result.json ranks[*].timing.gc``; on one H200 it found only young
collections, about 1 ms over 4 MoE steps: docs/training.md).
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager


class CollectionMeter:
    """Counts the collections by generation and sums their pauses while installed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.pause_s = 0.0
        self._started: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.pause_s += time.perf_counter() - self._started
            self.collections[info["generation"]] += 1
            self._started = None

    def install(self) -> CollectionMeter:
        gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def snapshot(self) -> tuple[list[int], float]:
        return list(self.collections), self.pause_s

    def since(self, before: tuple[list[int], float]) -> tuple[list[int], float]:
        counts, pause = before
        return [n - c for n, c in zip(self.collections, counts)], self.pause_s - pause


def window_record(parts: list[tuple[list[int], float]], manual: bool) -> dict:
    """``timing.gc``: the collections inside the timed steps (summed over them) and their pauses."""
    counts = [sum(p[0][g] for p in parts) for g in range(3)]
    pauses = [p[1] * 1e3 for p in parts]
    return {"manual": manual, "collections": counts, "pause_ms": sum(pauses),
            "max_step_pause_ms": max(pauses, default=0.0)}


def collection_findings(timing: dict | None) -> list[str]:
    """A warning when Python's collector paused the timed steps for more than 1% of their time."""
    record, median = (timing or {}).get("gc"), (timing or {}).get("step_time_s")
    if not record or not median or record["pause_ms"] <= 0.01 * median * 1e3 * (timing.get("steps") or 1):
        return []
    return [f"Python's garbage collector ran {sum(record['collections'])} time(s) inside the timed steps and "
            f"paused them {record['pause_ms']:.1f} ms (the longest step's: {record['max_step_pause_ms']:.1f} ms): "
            "set train.manual_gc=true to keep it between steps"]


@contextmanager
def collector_off():
    """Python's garbage collector off while a measurement runs (``recipes.measure.moduletime``'s
    passes), and back as it was after. A full collection walks every object the process holds: inside
    an MoE host pass at the h200 size it paused the host 310 ms (one H200), which the
    timeline would read as the host's pace and every replay's price would carry.
    Whether and where one lands depends on how many objects the process made before: in one of four
    processes of one point it made the host pass 2.2x as long as in the other three."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
