"""Rows routed to each rank's experts: what expert-parallel memory follows (``moe_routing``).

Under expert parallel a rank's routed-token tensors (the permuted expert input, the experts'
activations) scale with the rows its local experts receive, which the router decides step by step
(two H200s, ``ep2``: 0.95x/1.05x balanced at the ledger's micro-batch, up to 1.5x at the peak;
docs/evidence/h200x2.md). ``RoutingRecorder`` counts them: a forward pre-hook on each MoE layer's
experts reads the rows it is given (the shape of the permuted input: no device sync), grouped per
forward of a model chunk (one micro-batch) and tagged with the optimizer step it belongs to.
Recomputed forwards (in backward) and forward-only evaluation are not counted.

The summary goes into the rank's result as ``moe_routing``; ``recipes.predict.estimate`` prices each
rank at it in ``--compare`` (the ledger then exact per rank).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from functools import partial

import torch


class RoutingRecorder:
    """Routed rows per MoE layer, per forward micro-batch through each model chunk.

    ``step_of()`` says which optimizer step a forward belongs to (the worker: steps taken so far).
    """

    def __init__(self, chunks: list[torch.nn.Module], step_of: Callable[[], int]):
        from megatron.core.transformer.moe.moe_layer import MoELayer

        self.step_of = step_of
        self.events: list[tuple[int, int, list[int]]] = []  # (step, chunk, rows per MoE layer)
        self._current: list[int] | None = None
        self._handles = []
        self.layers = 0
        for index, chunk in enumerate(chunks):
            experts = [m.experts for m in chunk.modules() if isinstance(m, MoELayer)]
            if not experts:
                continue
            self.layers += len(experts)
            self._handles += [chunk.register_forward_pre_hook(partial(self._begin, index)),
                              chunk.register_forward_hook(partial(self._end, index))]
            self._handles += [e.register_forward_pre_hook(self._rows, with_kwargs=True) for e in experts]

    def __bool__(self) -> bool:
        return self.layers > 0

    def _begin(self, index: int, module: torch.nn.Module, args) -> None:
        training = module.training and torch.is_grad_enabled()
        self._current = [] if training else None

    def _end(self, index: int, module: torch.nn.Module, args, output) -> None:
        if self._current is not None:
            self.events.append((self.step_of(), index, self._current))
        self._current = None

    def _rows(self, module: torch.nn.Module, args, kwargs) -> None:
        if self._current is not None:
            hidden = args[0] if args else kwargs["permuted_local_hidden_states"]
            self._current.append(int(hidden.shape[0]))

    def summary(self, ledger_step: int | None, steps: range) -> dict:
        """``ledger_rows``: rows per MoE layer of this rank (chunk order) in the first micro-batch
        through each chunk at ``ledger_step`` (what the activation ledger records); ``max_rows_per_step``:
        per step in ``steps``, the largest sum over this rank's layers of one micro-batch's rows."""
        by_step: dict[int, dict[int, list[list[int]]]] = defaultdict(lambda: defaultdict(list))
        for step, chunk, rows in self.events:
            by_step[step][chunk].append(rows)
        out: dict = {"layers": self.layers}
        if ledger_step is not None and by_step.get(ledger_step):
            chunks = by_step[ledger_step]
            out["ledger_rows"] = [r for c in sorted(chunks) for r in chunks[c][0]]
        per_step = []
        for step in steps:
            chunks = by_step.get(step) or {}
            if not chunks:
                continue
            # the i-th forward through each chunk is micro-batch i
            count = min(len(v) for v in chunks.values())
            per_step.append(max(sum(sum(chunks[c][i]) for c in chunks) for i in range(count)))
        out["max_rows_per_step"] = per_step
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
