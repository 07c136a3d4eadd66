"""Each transformer layer's modules timed in one forward and backward: what a replay of them costs.

A recompute label replays some modules' forward in backward. What that costs a step is what their
forward took, on this GPU with this host: a GEMM's replay runs at the GEMM's rate, not the step's
average, and a host-bound module (the MoE layer's router and token permutation, MLA's RoPE) costs its
host time, which FLOPs do not see. ``time_modules`` measures it: one more forward and backward of
every micro-batch after the timed window (off the step count, no update), with forward hooks on each
layer and its modules (``TIMED``). On a GPU a module's time is the stream's, from a CUDA event its
pre-hook records to one its hook records, so it includes the GPU waiting for the host inside it; on
a CPU (tests) the wall clock. Calls inside backward are a recompute's replays, kept apart.

The result (``result.json`` ranks[*].module_times): per module name (relative to its layer, "" the
layer itself), the forward ms of one micro-batch in each of the rank's layers (``layers``: megatron's
1-based layer numbers), and the same for replays. ``recipes.predict.offload.measured_replay_s``
prices the recompute labels from a no-recompute point's forward times.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

#: The modules timed, by name relative to their layer ("" the layer; a name a layer lacks is skipped).
TIMED = ("", "input_layernorm", "pre_mlp_layernorm", "self_attention", "self_attention.core_attention",
         "self_attention.linear_qkv", "self_attention.linear_proj", "self_attention.linear_q_proj",
         "self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj",
         "self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj",
         "self_attention.q_layernorm", "self_attention.kv_layernorm", "mlp", "mlp.linear_fc1",
         "mlp.linear_fc2", "mlp.router", "mlp.experts", "mlp.shared_experts")
_SKIP = ("IdentityOp", "IdentityFuncOp")


def transformer_layers(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Every chunk's ``TransformerLayer``s, in order (as the memory trace finds them)."""
    # lazy: megatron takes seconds to import; tools that never build a model skip it
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TransformerLayer)]


class _Clock:
    """CUDA events on the current stream (GPU) or the wall clock (CPU)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


class ModuleTimer:
    """Forward hooks on each layer's ``TIMED`` modules: (layer number, name, in backward) -> intervals."""

    def __init__(self, chunks: list[torch.nn.Module], cuda: bool):
        self.clock, self.handles = _Clock(cuda), []
        self.intervals: dict[tuple[int, str, bool], list] = defaultdict(list)
        self.layers = []
        for layer in transformer_layers(chunks):
            self.layers.append(layer.layer_number)
            modules = dict(layer.named_modules())
            for name in TIMED:
                module = modules.get(name)
                if module is not None and type(module).__name__ not in _SKIP:
                    self._hook(module, layer.layer_number, name)

    def _hook(self, module: torch.nn.Module, layer: int, name: str) -> None:
        open_: list = []

        def pre(_module, _args):
            open_.append(self.clock.mark())

        def post(_module, _args, _output):
            replay = torch._C._current_graph_task_id() != -1  # inside autograd's backward: a replay
            self.intervals[(layer, name, replay)].append((open_.pop(), self.clock.mark()))

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def summary(self, microbatches: int) -> dict:
        """Per module name: ms of one micro-batch in each layer, forward and replayed (read after a
        synchronize)."""
        out: dict = {"layers": self.layers, "microbatches": microbatches, "forward_ms": {}, "replay_ms": {}}
        index = {n: i for i, n in enumerate(self.layers)}
        for (layer, name, replay), spans in sorted(self.intervals.items()):
            per_layer = out["replay_ms" if replay else "forward_ms"].setdefault(name, [0.0] * len(self.layers))
            per_layer[index[layer]] += sum(self.clock.ms(a, b) for a, b in spans) / microbatches
        return out


def time_modules(trainer) -> dict:
    """One more forward and backward of the step's micro-batches with the layers' modules timed (no
    update: the gradients are zeroed after)."""
    cuda = trainer.on_gpu
    timer = ModuleTimer(trainer.chunks, cuda)
    try:
        trainer.compute_gradients()
        if cuda:
            torch.cuda.synchronize()
        return timer.summary(trainer.num_microbatches)
    finally:
        timer.remove()
        trainer.optimizer.zero_grad()
