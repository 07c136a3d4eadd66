"""A step's timeline from its module-time pass, and what work inserted into it costs the step.

The pass (``recipes.measure.moduletime``, ``marks``) notes each timed module's forward start and end
and its backward start, on the host's clock (``host_ms``: when the host issued it) and, from a second
pass the host issues well ahead of the GPU, the GPU's own time up to each (``gpu_ms``: its work, no
waiting). The GPU reaches a mark once the host has issued it and the work before it is done::

    reached[j] = max(host[j] + latency, reached[j - 1] + work[j])

A recompute replays some modules' forward where backward reaches them: the host issues that forward
again (its host time, which moves every later mark) and the GPU runs it again (its GPU time, after the
mark). Its cost to the step is how much later the last mark is reached: the GPU time where the host
was ahead by more than the replay adds to it, the host time where the GPU was waiting for the host,
and between the two elsewhere. That is why one label costs an MoE step its module's stream time on
one day and its GPU time on another (docs/offload.md): the host's lead differs, and this reads it.
The GPU pass's sleeps let its kernels run faster than a step's; ``stream_pace`` says by how much, from
the module-time pass, and the GPU work is read at the step's pace (``Timeline.scaled``). A checkpoint
also runs its region's first forward under no_grad, which costs the host less (``Timeline.nograd``,
from a forward-only pass): where the host is behind, that is taken off the step. The region's own
machinery costs the host in the forward too (``Timeline.region_forward_ms``), where a dense step's host
is barely ahead in its first micro-batch, however far ahead its backward runs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from functools import cached_property

#: The modules whose stream time can check the GPU pass's pace: one or a few kernels each, no host
#: work of their own to speak of (``recipes.measure.moduletime.TIMED`` names).
PACE_MODULES = ("self_attention.linear_qkv", "self_attention.core_attention", "self_attention.linear_proj",
                "mlp.linear_fc1", "mlp.linear_fc2", "mlp.experts")
#: The range a pace is kept in (a ratio outside it is a measurement gone wrong, not a clock).
PACE_RANGE = (0.9, 1.3)


@dataclass(frozen=True)
class Timeline:
    """One point's marks: names ("<layer>:<module>:<pre|end|bwd>"), when the host issued each (ms since
    the pass began) and the GPU's own work from the mark before to each (ms). ``finish()`` of the base
    timeline should come near the host pass's measured ``pass_ms`` (the work after the last mark aside)."""

    names: list[str]
    host: list[float]
    work: list[float]
    #: the forward-only pass under ``torch.no_grad``, as a checkpoint's first forward runs its region:
    #: its marks and host clock (no GPU work); None where the pass did not record it
    nograd: Timeline | None = None
    #: host ms a checkpoint region of each kind costs beyond its function, and each elementwise
    #: region's function (``recipes.measure.regions``); None where the pass did not record them
    region_ms: dict | None = None
    region_function_ms: dict | None = None
    #: the part of ``region_ms`` each kind's forward costs (where its module runs); None where the
    #: pass did not record it (older records): the whole cost is placed at the replay
    region_forward_ms: dict | None = None
    #: host ms an offload group costs, fixed and a tensor, forward and backward together
    #: (``recipes.measure.regions.offload_host_ms``); None where the pass did not record it
    offload_ms: dict | None = None
    #: ms the point's measured steps' host waited for the GPU where megatron reads the grad norm (the
    #: median; ``timing.host_wait_s``): the margin the host had over the GPU at the step's sync, which
    #: caps what added host work can hide (``added``); None where the point did not record it
    host_wait_ms: float | None = None

    @classmethod
    def of(cls, marks: dict | None) -> Timeline | None:
        """From a ``module_times["marks"]`` record (None without one). An interval the GPU may have
        waited inside (``gpu_clean`` false) takes the median of the clean ones between the same two
        marks of other micro-batches, where there are any. The host's clock loses what the marks
        before each cost it (``mark_cost_ms`` each)."""
        if not marks or not marks.get("gpu_ms") or len(marks["gpu_ms"]) != len(marks.get("names") or []):
            return None
        names, work = marks["names"], list(marks["gpu_ms"])
        clean = marks.get("gpu_clean") or [True] * len(work)
        seen: dict[tuple[str, str], list[float]] = {}
        for j in range(1, len(work)):
            if clean[j]:
                seen.setdefault((names[j - 1], names[j]), []).append(work[j])
        for j in range(1, len(work)):
            same = sorted(seen.get((names[j - 1], names[j])) or [])
            if not clean[j] and same:
                work[j] = same[len(same) // 2]
        cost = marks.get("mark_cost_ms") or 0.0  # the hooks' host time, off each mark after them
        nograd = marks.get("nograd_names")
        if nograd:
            nograd = cls(list(nograd), [h - cost * j for j, h in enumerate(marks["nograd_host_ms"])],
                         [0.0] * len(nograd))
        return cls(list(names), [h - cost * j for j, h in enumerate(marks["host_ms"])], work, nograd or None,
                   marks.get("region_ms"), marks.get("region_function_ms") or {}, marks.get("region_forward_ms"),
                   marks.get("offload_ms"), marks.get("step_host_wait_ms"))

    @cached_property
    def _index(self) -> dict[str, list[int]]:
        index: dict[str, list[int]] = {}
        for j, name in enumerate(self.names):
            index.setdefault(name, []).append(j)
        return index

    def where(self, layer: int, module: str, kind: str) -> list[int]:
        """The marks of one module of one layer of one kind, in order (one a micro-batch)."""
        return self._index.get(f"{layer}:{module}:{kind}", [])

    def forward(self, layer: int, module: str) -> list[tuple[float, float]]:
        """(host ms, GPU ms) each forward of the module took, in order."""
        return [(self.host[b] - self.host[a], sum(self.work[a + 1:b + 1]))
                for a, b in zip(self.where(layer, module, "pre"), self.where(layer, module, "end"))]

    def forward_nograd(self, layer: int, module: str) -> list[float]:
        """Host ms each forward of the module took under ``torch.no_grad`` ([] where not recorded)."""
        return [host for host, _ in self.nograd.forward(layer, module)] if self.nograd else []

    def finish(self, inserted: dict[int, tuple[float, float]] | None = None) -> float:
        """When the GPU reaches the last mark (ms), with (host ms, GPU ms) of work ``inserted`` right
        after some marks: the host issues it there, and the GPU runs it before the next mark's work."""
        return self._reach(inserted)[-1]

    def added(self, inserted: dict[int, tuple[float, float]]) -> float:
        """ms the work ``inserted`` (as ``finish`` takes it) adds to the step: how much later the GPU
        reaches the last mark, and at least its host work beyond ``host_wait_ms``. The host issues all
        of it before the step's grad-norm read returns, and at that read the base step's host was only
        ``host_wait_ms`` ahead of the GPU. The timeline alone can read a longer lead than the steps had:
        its host pass ends before the step's own host work after backward (docs/offload.md)."""
        later = self.finish(inserted) - self.finish()
        if self.host_wait_ms is None:
            return later
        return max(later, sum(host for host, _ in inserted.values()) - self.host_wait_ms)

    def reached(self) -> list[float]:
        """When the GPU reaches each mark (ms), nothing inserted."""
        return self._reach(None)[:-1]

    def _reach(self, inserted: dict[int, tuple[float, float]] | None) -> list[float]:
        """When the GPU reaches each mark, and last where the work inserted after the last mark ends."""
        inserted = inserted or {}
        shift, out, n = 0.0, [self.host[0]], len(self.names)
        for j in range(1, n + 1):  # n: after the last mark, where work inserted there ends
            host, gpu = inserted.get(j - 1, (0.0, 0.0))
            shift += host
            out.append(max(self.host[min(j, n - 1)] + shift, out[-1] + (self.work[j] if j < n else 0.0) + gpu))
        return out

    def scaled(self, pace: float) -> Timeline:
        """The same timeline with the GPU's work ``pace`` times as long (``stream_pace``)."""
        return replace(self, work=[w * pace for w in self.work])


def stream_pace(timeline: Timeline, forward_ms: dict, layers: list[int]) -> float | None:
    """How much longer the GPU takes for a module's forward in a plain pass than in the GPU pass: the
    median over ``PACE_MODULES``' forwards (each layer's, in the module-time pass's stream times,
    ``forward_ms``) where the GPU was busy and the host far ahead (host time under half the GPU time),
    so that the stream time is the GPU's work at the step's own pace. On one H200 it was 1.08-1.16 on
    every base point that had such forwards (dense, MLA, MoE; docs/offload.md): the GPU pass's sleeps let
    the same kernels run about a tenth faster, and dense replays priced at the GPU pass's pace came out
    5-15% low. None where no forward qualifies (an MoE pass whose host is behind everywhere)."""
    ratios = []
    for name in PACE_MODULES:
        stream = forward_ms.get(name) or []
        for i, number in enumerate(layers[:len(stream)]):
            spans = timeline.forward(number, name)
            if not spans:
                continue
            host, gpu = (sum(x) / len(spans) for x in zip(*spans))
            if gpu > 0.2 and host < 0.5 * gpu:
                ratios.append(stream[i] / gpu)
    if not ratios:
        return None
    return min(max(statistics.median(ratios), PACE_RANGE[0]), PACE_RANGE[1])

