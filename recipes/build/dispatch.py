"""The ``local`` MoE token dispatcher: every expert on this rank, no host synchronisation.

megatron-core's ``MoEAllGatherTokenDispatcher.dispatch_postprocess`` (token_dispatcher.py) copies
the per-expert token counts to the host (``.long().cpu()``), reads their sum (``.item()``) to size
the permutation, and picks the routed probabilities with ``masked_select``, whose output size
depends on the data. On a GPU each of these waits for the device, in every MoE layer, in every
forward (and again in a ``moe`` or ``full`` recompute), and the experts then copy the counts back
to the device for the grouped GEMM's offsets.

With expert parallel 1 and expert-tensor parallel 1 the dispatcher gathers nothing, and without
token dropping every token goes to exactly top-k experts, so the number of routed rows is
``tokens x top-k``: known on the host. ``LocalTokenDispatcher`` uses that:

- the permutation is the prefix of megatron's ``moe_utils.permute`` argsort (a stable sort of the
  [experts, tokens] routing map) that holds the routed pairs: the map's ``tokens x top-k`` nonzero
  entries (``torch.nonzero_static``, sized from the shapes, not from the data); the probabilities
  are gathered by the same index, not by ``masked_select``;
- the counts per expert stay on the device (``routing_map.sum(0)``); ``GroupedExperts`` turns them
  into the grouped GEMM's offsets there;
- the combine is megatron's ``unpermute`` (a scatter-add into the token order).

The arithmetic is the allgather dispatcher's: the same rows in the same order, the same
probabilities, the same scatter-add, so outputs and gradients are bit-identical
(``tests/test_dispatch.py``). What it saves for backward differs: the probabilities' gather keeps
its int64 index (tokens x top-k) where ``masked_select`` kept the [experts, tokens] probabilities
and boolean map (``recipes.predict.activations.moe_terms``).

``LocalDispatchMoELayer`` is megatron's ``MoELayer`` with this dispatcher; ``use_local_dispatcher``
swaps it into a layer or block spec (``model.moe_token_dispatcher_type=local``, the default of the
MoE model options; ``recipes.validate`` refuses it where it cannot be exact).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection, unpermute
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from megatron.core.transformer.spec_utils import ModuleSpec


class LocalTokenDispatcher(MoETokenDispatcher):
    """Tokens sorted by expert on this rank; counts per expert on the device; no communication."""

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        if self.tp_size > 1 or self.ep_size > 1:
            raise ValueError(
                "LocalTokenDispatcher keeps every token on its rank: it needs expert parallel 1 and "
                f"expert-tensor parallel 1, got EP={self.ep_size}, expert TP={self.tp_size} "
                "(use moe_token_dispatcher_type=allgather)")
        if config.moe_expert_capacity_factor is not None:
            raise ValueError(
                "LocalTokenDispatcher needs every token routed to exactly top-k experts; token "
                "dropping (moe_expert_capacity_factor) makes the count data-dependent (use allgather)")
        if config.moe_permute_fusion:
            raise ValueError("LocalTokenDispatcher has no fused (Transformer Engine) permutation: "
                             "set moe_permute_fusion=False, or use allgather")
        assert num_local_experts == len(local_expert_indices) == config.num_moe_experts
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.topk = config.moe_router_topk
        self.routing_map = None
        self.sorted_indices = None
        self.cudagraph_attrs = ["routing_map"]

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """[s, b, h] -> [s*b, h]; keeps the routing map for ``dispatch_postprocess``."""
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        return hidden_states.view(-1, self.hidden_shape[-1]), probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Nothing to send: every expert is on this rank."""
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Rows sorted by expert, tokens in order within an expert (as the allgather dispatcher),
        their count per expert (on the device) and their router probabilities."""
        routing_map, self.routing_map = self.routing_map, None
        self.hidden_shape_before_permute = hidden_states.shape
        num_tokens = hidden_states.shape[0]
        num_rows = num_tokens * self.topk
        tokens_per_expert = routing_map.sum(dim=0)
        # Every token has exactly top-k experts (no token dropping, refused above). A map that broke
        # it would permute the wrong rows: the device checks it without stopping the host.
        torch._assert_async(tokens_per_expert.sum() == num_rows)
        # moe_utils.permute's argsort (descending, stable) puts the routed (expert, token) pairs of
        # the [experts, tokens] map first, in order: the map's nonzero entries, which nonzero_static
        # finds sized from the shapes (one pass, no sort, no host wait; equal to the argsort's prefix).
        order = torch.nonzero_static(routing_map.T.contiguous().view(-1), size=num_rows).view(-1)
        self.sorted_indices = order % num_tokens
        permuted = hidden_states.index_select(0, self.sorted_indices)
        # masked_select(probs.T, map.T) picks the same entries in the same order, sized by the data.
        permuted_probs = probs.T.contiguous().view(-1).index_select(0, order)
        return permuted, tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Expert outputs back to token order, the top-k rows of a token summed (megatron's
        ``unpermute``: a scatter-add into zeros)."""
        out = unpermute(hidden_states, self.sorted_indices, restore_shape=self.hidden_shape_before_permute)
        self.sorted_indices = None  # autograd keeps what backward needs; hold nothing between steps
        return out

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Nothing to receive."""
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[s*b, h] -> [s, b, h]."""
        return hidden_states.view(self.hidden_shape)


class LocalDispatchMoELayer(MoELayer):
    """megatron's ``MoELayer`` with ``LocalTokenDispatcher`` in place of the dispatcher its config
    names (the config says ``allgather``: megatron's ``TransformerConfig`` knows no other name)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, **kwargs):
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection, **kwargs)
        self.token_dispatcher = LocalTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config=self.config, pg_collection=pg_collection)


def use_local_dispatcher(spec):
    """``spec`` (a layer spec, or a block spec with ``layer_specs``) with every ``MoELayer`` MLP
    built as ``LocalDispatchMoELayer``; dense MLPs are left alone. Changes ``spec`` in place."""
    layers = getattr(spec, "layer_specs", None)
    for layer in layers if layers is not None else [spec]:
        mlp = getattr(layer.submodules, "mlp", None)
        if isinstance(mlp, partial) and mlp.func is MoELayer:
            layer.submodules.mlp = partial(LocalDispatchMoELayer, *mlp.args, **mlp.keywords)
        elif isinstance(mlp, ModuleSpec) and mlp.module is MoELayer:
            layer.submodules.mlp = dataclasses.replace(mlp, module=LocalDispatchMoELayer)
    return spec
