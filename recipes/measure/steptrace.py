"""One training step under torch's profiler, read as a timeline: where the GPU's time went.

``trace_step`` runs one extra step (off the step count, as the profiled memory step) under
``torch.profiler`` and ``summarize`` turns its chrome trace into a small summary for ``result.json``:

- ``span_s``: first to last GPU activity of the step; ``kernel_busy_s``: the time some kernel ran;
  ``gpu_idle_s``: the span with no kernel, copy or memset running (host work the GPU waited for);
  ``gpu_busy_s``: the rest of the span, what the step takes when the host keeps up (``measure.gpu_time``).
- ``copies``: device-to-host and host-to-device copies, busy and *exposed* (no kernel running beside
  them: what copies can add to a step), per direction and together (``exposed_time``).
- ``kernels``: the kernels with the most device time (name, ms, calls), and ``kernel_total_s``.
- ``runtime``: the CUDA runtime and driver calls with the most host time (e.g. ``cudaStreamWaitEvent``,
  ``cudaMemcpyAsync``, ``cudaHostAlloc``): a call that blocks the host shows here.

Two runs' summaries side by side say whether a slower step ran more kernel time (which kernels) or
left the GPU idle (which calls). ``measure.trace_step=true`` records it for any GPU run and keeps the
trace (``RUN_DIR/step_trace[_rank<N>].json.gz``, for Perfetto or chrome://tracing); activation
offload records it always (``recipes.measure.offload``). GPU only; the arithmetic is tested on a CPU.
"""

from __future__ import annotations

import gzip
import json
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

TOP_KERNELS = 12
TOP_RUNTIME = 8


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in _union(intervals))


def exposed_time(copies: list[tuple[float, float]], compute: list[tuple[float, float]]) -> dict:
    """Copy intervals against compute intervals (same clock): ``busy`` is the time some copy ran,
    ``exposed`` the part of it with no compute running (what the copies can add to a step)."""
    copy_u, comp_u = _union(copies), _union(compute)
    busy = sum(b - a for a, b in copy_u)
    overlap, j = 0.0, 0
    for a, b in copy_u:
        while j < len(comp_u) and comp_u[j][1] <= a:
            j += 1
        k = j
        while k < len(comp_u) and comp_u[k][0] < b:
            overlap += min(b, comp_u[k][1]) - max(a, comp_u[k][0])
            k += 1
    return {"busy": busy, "exposed": busy - overlap}


def trace_intervals(trace: dict) -> tuple[dict[str, list], list]:
    """From a chrome trace (torch.profiler's export): the device-to-host and host-to-device memcpy
    intervals and the compute kernels' intervals, in seconds."""
    copies: dict[str, list] = {"d2h": [], "h2d": []}
    compute = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or "dur" not in event:
            continue
        span = (event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6)
        cat, name = event.get("cat", ""), event.get("name", "")
        if cat == "gpu_memcpy" and "DtoH" in name:
            copies["d2h"].append(span)
        elif cat == "gpu_memcpy" and "HtoD" in name:
            copies["h2d"].append(span)
        elif cat == "kernel":
            compute.append(span)
    return copies, compute


def copy_summary(copies: dict[str, list], compute: list) -> dict:
    """The copies' busy and exposed seconds per direction (``d2h_busy_s``, ...) and together, from
    ``trace_intervals``."""
    out = {f"{d}_{k}_s": v for d in ("d2h", "h2d") for k, v in exposed_time(copies[d], compute).items()}
    both = exposed_time(copies["d2h"] + copies["h2d"], compute)
    out.update(copy_busy_s=both["busy"], exposed_s=both["exposed"], copies=sum(len(v) for v in copies.values()))
    return out


def _top(durations: dict[str, list[float]], n: int) -> list[dict]:
    rows = sorted(durations.items(), key=lambda kv: -sum(kv[1]))[:n]
    return [{"name": name[:120], "ms": sum(d) * 1e3, "calls": len(d)} for name, d in rows]


def summarize(trace: dict) -> dict:
    """A step's chrome trace as the summary described in the module docstring."""
    copies, kernel_spans = trace_intervals(trace)
    kernels: dict[str, list[float]] = defaultdict(list)
    runtime: dict[str, list[float]] = defaultdict(list)
    gpu_spans = list(kernel_spans)
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or "dur" not in event:
            continue
        cat, name = event.get("cat", ""), event.get("name", "")
        span = (event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6)
        if cat == "kernel":
            kernels[name].append(span[1] - span[0])
        elif cat in ("gpu_memcpy", "gpu_memset"):
            gpu_spans.append(span)
        elif cat in ("cuda_runtime", "cuda_driver"):
            runtime[name].append(span[1] - span[0])
    span_s = (max(b for _, b in gpu_spans) - min(a for a, _ in gpu_spans)) if gpu_spans else 0.0
    busy = _length(gpu_spans)
    return {
        "span_s": span_s,
        "kernel_busy_s": _length(kernel_spans),
        "gpu_idle_s": span_s - busy,
        "gpu_busy_s": busy,
        "kernel_total_s": sum(sum(d) for d in kernels.values()),
        "copies": copy_summary(copies, kernel_spans),
        "kernels": _top(kernels, TOP_KERNELS),
        "runtime": _top(runtime, TOP_RUNTIME),
    }


def trace_step(step, keep: Path | None = None, host: bool = True) -> dict | None:
    """Run ``step()`` (one training step) under torch's profiler; its ``summarize``d trace, and the
    trace itself gzipped at ``keep`` when given. ``host=False`` records CUDA activity only (the GPU's
    busy time, ``measure.gpu_time``: a fraction of the events to export and read). None on a CPU."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if host else [ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        if keep is not None:
            with path.open("rb") as src, gzip.open(keep, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return summarize(trace)
