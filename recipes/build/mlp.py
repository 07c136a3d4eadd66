"""The dense MLP's ``mlp`` recompute without replaying FC2.

megatron-core 0.19.2 recomputes the dense MLP by wrapping all of it in ``tensor_parallel.checkpoint``
(``TransformerLayer._forward_mlp``): backward replays FC1, the activation and FC2. FC2's output is
not needed for backward, only its input (the activation's output), so the FC2 GEMM is replayed for
nothing: a third of the MLP's FLOPs with SwiGLU (FC1 is h -> 2 ffn, FC2 ffn -> h).

``ReplayMLP`` is megatron's ``MLP`` (same constructor, parameters and state dict) that, when the
layer's ``mlp`` label is on, runs FC1 and the activation under ``CheckpointWithoutOutput``, as
megatron's own ``moe_act`` does for its TE experts: the checkpoint keeps FC1's input (the norm output,
which megatron's checkpoint kept too), FC2 saves the activation's output, and that output is discarded
once FC2 has run and recomputed when FC2's output gradient arrives. The same bytes are kept; the
replay is FC1 and the activation only. ``recompute.mlp_replays_fc2=true`` keeps megatron's path.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.mlp import MLP


class _Passthrough(torch.nn.Module):
    """FC2's stand-in while megatron's ``MLP.forward`` runs FC1 and the activation only."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x, None


class ReplayMLP(MLP):
    """``MLP`` whose ``mlp`` recompute replays FC1 and the activation, not FC2 (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # set by replay_mlps on the layers whose mlp label is on (megatron's flag on the layer
        # is turned off there); recipes.measure.labels reads and flips it like megatron's
        self.recompute_mlp = False

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs):
        if not (self.recompute_mlp and torch.is_grad_enabled()) or per_token_scale is not None:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        checkpoint = tensor_parallel.CheckpointWithoutOutput()
        activation = checkpoint.checkpoint(self._fc1_activation, hidden_states)
        output, bias = self.linear_fc2(activation)
        # FC2 has saved the activation's output: free it, recompute it when FC2's grad arrives.
        checkpoint.discard_output_and_register_recompute(output)
        # A view, so that hooks the layer registers on the MLP's output (the pre-MLP norm's
        # recompute under layernorm) run before this one, which reads the norm's output.
        return output.view_as(output), bias

    def _fc1_activation(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """megatron's ``MLP.forward`` up to FC2 (its own FC1, bias and activation code), FC2 skipped."""
        fc2 = self._modules["linear_fc2"]
        self._modules["linear_fc2"] = _PASSTHROUGH
        try:
            activation, _ = super().forward(hidden_states)
        finally:
            self._modules["linear_fc2"] = fc2
        return activation


_PASSTHROUGH = _Passthrough()


def use_replay_mlp(spec):
    """``spec`` (a local layer spec with a dense MLP) building ``ReplayMLP`` in place of ``MLP``."""
    mlp = spec.submodules.mlp  # functools.partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(...))
    if getattr(mlp, "func", None) != MLP.as_mlp_submodule:
        return spec
    spec.submodules.mlp = type(mlp)(ReplayMLP.as_mlp_submodule, *mlp.args, **mlp.keywords)
    return spec


def replay_mlps(chunks: list[torch.nn.Module]) -> int:
    """Move the ``mlp`` label from megatron's layer-wide checkpoint to each ``ReplayMLP``; returns
    how many layers it moved."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    count = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TransformerLayer) and module.recompute_mlp and isinstance(module.mlp, ReplayMLP):
                module.recompute_mlp = False
                module.mlp.recompute_mlp = True
                count += 1
    return count
