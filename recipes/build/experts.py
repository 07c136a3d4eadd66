"""Grouped MoE experts for megatron-core's local (no Transformer Engine) spec, with ``moe_act``.

Why this exists (see ``recipes.build.upstream`` and docs/troubleshooting.md): megatron-core 0.19.2
implements ``moe_act`` recompute only in ``TEGroupedMLP``. The local spec always builds
``SequentialMLP``, where ``moe_act`` is accepted and silently does nothing. ``GroupedExperts`` is a
drop-in replacement for ``SequentialMLP`` (same constructor, same forward call and return) that

- runs all local experts as one grouped GEMM (``torch._grouped_mm``) on CUDA, or as a loop of plain
  matmuls over each expert's token slice elsewhere (``use_grouped_mm`` decides, per call);
- applies the activation and the router probabilities exactly as megatron's ``MLP`` does for an
  expert (probs multiply the activation output, after the GLU, then cast back);
- implements ``moe_act`` the way ``TEGroupedMLP`` does: the activation between FC1 and FC2 runs
  under ``CheckpointWithoutOutput``; its output is discarded once FC2 has saved it, and recomputed
  in backward when FC2's output gradient arrives;
- calls megatron's fine-grained offload points ``expert_fc1`` (FC1's input) and ``moe_act`` (the
  activation's input) where ``TEGroupedMLP`` calls them, so ``offload_modules`` moves the experts'
  activations to the host (megatron wires them only into its TE experts); the stacked weights are
  marked not to offload, as megatron marks every parameter, since the GEMMs save views of them.

Parameters are the per-expert ``linear_fc1.weight`` / ``linear_fc2.weight`` of ``SequentialMLP``
stacked along a leading expert dimension (``weight1``: [E, fc1 out, in], ``weight2``:
[E, out, ffn]), so ``load_from_sequential`` is a plain copy. Limits: ``add_bias_linear=False``,
expert tensor parallel size 1, no FP8/FP4 (those need Transformer Engine). ``sharded_state_dict``
maps the stacked weights onto global tensors [all experts, out, in] under ``SequentialMLP``'s
keys (``experts.linear_fc1.weight``), sharded over expert-parallel ranks, for megatron's
``dist_checkpointing``.
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core import tensor_parallel
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
    FineGrainedActivationOffloadingInterface as off_interface,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


def use_grouped_mm(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether to run the experts as one ``torch._grouped_mm`` (else: a loop of matmuls).

    Grouped only where it was verified to be fast and exact: a CUDA tensor in bf16, on a torch that
    has ``_grouped_mm``, with rows 16-byte aligned (the kernel's stride requirement). Everything
    else (CPU, fp32/fp16, odd sizes) takes the per-expert loop, which is SequentialMLP's arithmetic.
    """
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    return all(w.shape[-1] * w.element_size() % 16 == 0 for w in weights) and all(
        w.shape[-2] * w.element_size() % 16 == 0 for w in weights
    )


def _weight_view(view: torch.Tensor) -> torch.Tensor:
    """A view of a weight that a GEMM saves for backward: never offloaded (megatron marks parameters
    ``_do_not_offload``; a view is a new tensor that does not carry the mark)."""
    view._do_not_offload = True
    return view


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[T, in] x [E, out, in] -> [T, out]; rows offs[e-1]:offs[e] go through expert e."""
    out = torch._grouped_mm(x, _weight_view(weight.transpose(-2, -1)), offs=offs)
    if out.requires_grad:  # its backward rejects broadcast (stride-0) grads, e.g. from .sum()
        out.register_hook(torch.Tensor.contiguous)
    return out


def loop_gemm(x: torch.Tensor, weight: torch.Tensor, splits: list[int]) -> torch.Tensor:
    """The same product as ``grouped_gemm``, one matmul per expert token slice (splits: sizes)."""
    return torch.cat([torch.matmul(t, _weight_view(w.t())) for t, w in zip(x.split(splits), weight)])


class GroupedExperts(MegatronModule):
    """All local experts of an MoE layer as stacked weights; a drop-in for ``SequentialMLP``.

    ``gemm_impl`` ("auto", "grouped_mm" or "loop") forces a path; "auto" asks ``use_grouped_mm``.
    ``submodules`` is accepted for ``SequentialMLP``'s signature and ignored: there are no
    ``ColumnParallelLinear``/``RowParallelLinear`` children, and the TE activation module cannot
    exist without Transformer Engine.
    """

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules: MLPSubmodules | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        name: str | None = None,
    ):
        super().__init__(config=config)
        del submodules, name
        if config.add_bias_linear:
            raise ValueError(
                "GroupedExperts supports only add_bias_linear=False (expert biases are not "
                "implemented; megatron-core 0.19.2's local MoE path with biases fails in place too)"
            )
        if config.fp8 or config.fp4 or config.use_te_activation_func:
            raise ValueError(
                "GroupedExperts has no FP8/FP4 or use_te_activation_func path: they need "
                "Transformer Engine"
            )
        if config.bias_activation_fusion and not (
            config.gated_linear_unit and config.activation_func is torch.nn.functional.silu
        ):
            raise ValueError("GroupedExperts fuses only SwiGLU (bias_activation_fusion=True)")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(
                required_pgs=["ep", "expt_tp", "expt_dp"]
            )
        self.ep_group, self.tp_group = pg_collection.ep, pg_collection.expt_tp
        if self.tp_group.size() > 1:
            raise ValueError(
                "GroupedExperts supports only expert_tensor_parallel_size=1, got an expert "
                f"tensor-parallel group of size {self.tp_group.size()}"
            )

        self.num_local_experts = num_local_experts
        self.gemm_impl = "auto"
        # moe_act: TEGroupedMLP's condition, verbatim.
        self.activation_recompute = (
            config.recompute_granularity == "selective" and "moe_act" in config.recompute_modules
        )
        # the fine-grained offload points, as TEGroupedMLP sets them
        offloading = config.fine_grained_activation_offloading
        self.offload_expert_fc1 = offloading and "expert_fc1" in config.offload_modules
        self.offload_moe_act = offloading and "moe_act" in config.offload_modules

        in_size = config.moe_latent_size or config.hidden_size
        ffn = config.moe_ffn_hidden_size
        fc1_out = 2 * ffn if config.gated_linear_unit else ffn
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        empty = partial(torch.empty, device=device, dtype=config.params_dtype)
        self.weight1 = torch.nn.Parameter(empty(num_local_experts, fc1_out, in_size))
        self.weight2 = torch.nn.Parameter(empty(num_local_experts, in_size, ffn))
        # Attributes as ColumnParallelLinear / RowParallelLinear set them on expert weights: the
        # (expert-)TP partition dim, and allreduce=False only when experts use expert-DP groups.
        use_expert_pgs = (
            config.expert_model_parallel_size > 1
            or config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        )
        fc1_stride = 2 if config.gated_linear_unit else 1
        for weight, dim, stride in ((self.weight1, 1, fc1_stride), (self.weight2, 2, 1)):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=stride)
            weight.allreduce = not use_expert_pgs
        if config.perform_initialization:
            # Expert by expert, fc1 then fc2, under the expert RNG tracker: SequentialMLP's order.
            rng = get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name())
            with torch.no_grad(), rng:
                for w1, w2 in zip(self.weight1, self.weight2):
                    config.init_method(w1)
                    config.output_layer_init_method(w2)

    @torch.no_grad()
    def load_from_sequential(self, sequential_mlp: torch.nn.Module) -> GroupedExperts:
        """Copy each ``SequentialMLP.local_experts[e].linear_fc{1,2}.weight`` into expert e."""
        experts = sequential_mlp.local_experts
        if len(experts) != self.num_local_experts:
            raise ValueError(f"{len(experts)} experts to load into {self.num_local_experts}")
        for e, expert in enumerate(experts):
            self.weight1[e].copy_(expert.linear_fc1.weight)
            self.weight2[e].copy_(expert.linear_fc2.weight)
        return self

    def activation(self, fc1_output: torch.Tensor, permuted_probs: torch.Tensor) -> torch.Tensor:
        """megatron ``MLP``'s expert activation (GLU: the first half gates the second), x probs.

        The probs (one per routed token) multiply the activation output, in their dtype (fp32 from
        the router), and the result is cast back, exactly as ``MLP.forward(per_token_scale=...)``.
        This is the function ``moe_act`` checkpoints; its output is what FC2 saves.
        """
        config = self.config
        probs = permuted_probs.unsqueeze(-1)
        if config.bias_activation_fusion:
            return weighted_bias_swiglu_impl(
                fc1_output, None, probs, config.activation_func_fp8_input_store
            )
        if config.gated_linear_unit:
            x_glu, x_linear = torch.chunk(fc1_output, 2, dim=-1)
            if (val := config.activation_func_clamp_value) is not None:
                x_glu = x_glu.clamp(min=None, max=val)
                x_linear = x_linear.clamp(min=-val, max=val)
            out = config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)
        else:
            out = config.activation_func(fc1_output)
        return (out * probs).to(out.dtype)

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        """Tokens sorted by local expert ([T, h]), their count per expert ([E]) and router prob
        ([T]) -> (expert outputs [T, h], None), as ``SequentialMLP.forward``. The probs are
        applied inside the experts (MoELayer's combine only sums), after the activation, unless
        ``moe_apply_probs_on_input`` moves them onto the input (top-1 only)."""
        hidden = permuted_local_hidden_states
        if self.config.moe_apply_probs_on_input:
            assert self.config.moe_router_topk == 1, (
                "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
            )
            hidden = (permuted_probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            permuted_probs = torch.ones_like(permuted_probs)

        impl = self.gemm_impl
        if impl == "auto":
            impl = "grouped_mm" if use_grouped_mm(hidden, self.weight1, self.weight2) else "loop"
        if impl == "grouped_mm":  # offsets stay on the device: no host sync
            offs = torch.cumsum(tokens_per_expert, 0).to(device=hidden.device, dtype=torch.int32)
            gemm = partial(grouped_gemm, offs=offs)
        elif impl == "loop":
            gemm = partial(loop_gemm, splits=tokens_per_expert.tolist())
        else:
            raise ValueError(f"gemm_impl must be auto, grouped_mm or loop, not {impl!r}")

        # Offload points and order as TEGroupedMLP: FC1's input leaves after FC1; the activation's
        # input (FC1's output) after FC2, so that it is back before moe_act's recompute needs it.
        fc1_offload = off_interface(self.offload_expert_fc1, hidden, "expert_fc1")
        with fc1_offload as hidden:
            fc1_output = gemm(hidden, self.weight1)
        fc1_output = fc1_offload.group_offload(fc1_output, forced_released_tensors=[hidden])
        act_offload = off_interface(self.offload_moe_act, fc1_output, "moe_act")
        with act_offload as fc1_output:
            if self.activation_recompute:
                checkpoint = tensor_parallel.CheckpointWithoutOutput()
                act_output = checkpoint.checkpoint(self.activation, fc1_output, permuted_probs)
            else:
                act_output = self.activation(fc1_output, permuted_probs)
        output = gemm(act_output, self.weight2)
        if self.activation_recompute:
            # FC2 has saved act_output; free it now, recompute it when FC2's grad arrives.
            checkpoint.discard_output_and_register_recompute(output)
        output = act_offload.group_offload(output, forced_released_tensors=[fc1_output])
        return output, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """``weight1``/``weight2`` as global [num experts, out, in] tensors, this rank's experts at
        offset ``ep rank x local experts``, under the layer's prepended axes (``sharded_offsets``).
        Replicas are the expert-data-parallel ranks; expert TP is 1 (checked in ``__init__``)."""
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        prepend = len(sharded_offsets)
        expert_axis = (prepend, self.ep_group.rank(), self.ep_group.size())
        replica = (0, 0, ps.get_expert_data_parallel_rank())
        out = {}
        for name, sharded_name in (("weight1", "linear_fc1.weight"), ("weight2", "linear_fc2.weight")):
            out[f"{prefix}{name}"] = ShardedTensor.from_rank_offsets(
                f"{prefix}{sharded_name}", getattr(self, name), *sharded_offsets, expert_axis,
                replica_id=replica, prepend_axis_num=prepend)
        return out

    def backward_dw(self) -> None:
        """Weight gradients are not deferred here (MoELayer calls this with delayed wgrad)."""


def grouped_experts_builder() -> partial:
    """The experts builder for ``MoESubmodules(experts=...)``, like
    ``LocalSpecProvider.grouped_mlp_modules``: MoELayer calls it as
    ``builder(num_local_experts, config, pg_collection=..., name=...)``."""
    return partial(GroupedExperts, submodules=None)
