"""GatedDeltaNet (GDN) hybrid layers on megatron-core's local spec, and the one CPU switch for its kernels.

``model=gdn`` mixes megatron-core's ``GatedDeltaNet`` (``experimental_attention_variant=
"gated_delta_net"``, the linear-attention layers of Qwen3-Next-style hybrids) with standard attention
layers: ``linear_attention_freq=N`` makes every N-th layer standard attention and the rest GDN
(megatron's ``get_linear_attention_pattern``; N=4 is Qwen3-Next's 3:1).

Why our own block spec: megatron's ``get_transformer_block_with_experimental_attention_variant_spec``
asserts ``transformer_impl == "transformer_engine"``, and its ``get_gated_delta_net_module_spec``
fuses the layer's input norm into ``in_proj`` (``column_parallel_layer_norm_linear``), which
``LocalSpecProvider`` does not have (it returns None). ``gdn_layer_spec`` (placed per layer by
``recipes.build.model.build_block_spec``) builds the same per-layer list from local pieces: the GDN layers keep the layer's own ``input_layernorm`` and a plain
``ColumnParallelLinear`` ``in_proj`` (the same arithmetic, unfused); the attention layers are the
local attention layer spec with our core attention (``recipes.build.attention``), exactly as model=standard_attn.

The kernels come from fla-core (flash-linear-attention, Triton), which megatron imports in
``megatron/core/ssm/gated_delta_net/common.py``: ``chunk_gated_delta_rule``, ``causal_conv1d`` and
``l2norm``. Triton cannot run without a GPU, so ``select_gdn_ops()`` is the one switch: without CUDA
it points megatron's GDN module at pure-PyTorch references, and with CUDA it leaves the real kernels:

- ``chunk_gated_delta_rule`` -> fla's own reference, ``fla.ops.gated_delta_rule.naive.
  naive_chunk_gated_delta_rule`` (same chunked algorithm in fp32, autograd through plain ops);
- ``causal_conv1d`` -> a depthwise ``torch.nn.functional.conv1d`` + SiLU (fla-core ships no naive
  convolution; this is megatron's own ``deterministic_mode`` branch in gdn.py);
- ``l2norm`` -> ``x / sqrt(sum(x^2) + eps)``, the formula of fla's Triton kernel (eps 1e-6).

On a CPU it also runs megatron's ``@jit_fuser`` (``torch.compile``) GDN helpers eagerly (same math,
no inductor C++ build per shape). Nothing else in the layer changes, so the CPU exercises the
layer's structure, its parameters and the ``gdn_norm_out`` checkpoint (the gated output norm,
``GatedDeltaNet._gated_norm_and_a2a``), not fla's Triton numerics. Packed sequences
(``cu_seqlens``) are refused on the CPU path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from recipes.build.compat import cuda_available
from recipes.errors import ConfigError

#: megatron's GDN module globals that hold fla's Triton kernels -> their CPU references (below).
_SWAPPED: dict[str, Any] = {}


def naive_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                 output_final_state=False, use_qk_l2norm_in_kernel=False,
                                 cu_seqlens=None, **_unused):
    """fla's reference chunked gated delta rule, behind the call signature megatron uses."""
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule as reference

    if cu_seqlens is not None:
        raise NotImplementedError("packed sequences (cu_seqlens) are not supported by the CPU "
                                  "reference ops; run GDN with packed sequences on a GPU")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    out, state = reference(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state)
    return out.to(v.dtype), state


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, **_unused) -> tuple[torch.Tensor, None]:
    """Depthwise causal convolution over ``x`` [b, s, d] with ``weight`` [d, w] (fla's layout)."""
    if cu_seqlens is not None or initial_state is not None or output_final_state:
        raise NotImplementedError("the CPU causal_conv1d supports whole sequences without state")
    seq_len, width = x.shape[1], weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1,
                 groups=weight.shape[0])[..., :seq_len]
    if activation in ("silu", "swish"):
        y = F.silu(y)
    return y.transpose(1, 2), None


def l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """fla's L2 norm over the last dimension, in fp32: ``x / sqrt(sum(x^2) + eps)``."""
    y = x.float() * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def select_gdn_ops() -> bool:
    """Without CUDA, swap megatron's fla Triton kernels for the references above; True if swapped.

    Scoped like ``recipes.build.compat.install_cpu_compat``: with CUDA it does nothing, so a GPU always
    runs fla's kernels. Call it before building GDN layers (``GatedDeltaNet.__init__`` binds
    ``chunk_gated_delta_rule`` to the instance). Idempotent.
    """
    if cuda_available():
        return False
    if _SWAPPED:
        return True
    # lazy: megatron takes seconds to import; tools that never build a model skip it
    from megatron.core.ssm.gated_delta_net import common, gdn

    for module, name, replacement in ((gdn, "chunk_gated_delta_rule", naive_chunk_gated_delta_rule),
                                      (gdn, "causal_conv1d", causal_conv1d),
                                      (common, "l2norm", l2norm)):
        _SWAPPED[f"{module.__name__}.{name}"] = getattr(module, name)
        setattr(module, name, replacement)
    _disable_jit_on_cpu()
    return True


def check_fla_kernels() -> None:
    """Refuse, at build time, a GPU whose fla kernels would refuse the first backward step.

    fla-core 0.6.0 raises in ``chunk_bwd_dqkwg`` (``fla/ops/common/chunk_o.py``) on Hopper with
    Triton >= 3.4 and < 3.7.1, which give wrong gradients there (fla #640), unless tilelang is
    installed (fla then dispatches that kernel to tilelang). fla says so only after a whole forward
    pass; this says it before any step, with the offline fix. Does nothing without CUDA (the CPU runs
    the references above). ``tests/test_gdn.py`` fails once fla drops its guard.
    """
    if not cuda_available():
        return
    import importlib.util

    import triton
    from fla import utils

    if (utils.IS_NVIDIA_HOPPER and utils.TRITON_ABOVE_3_4_0 and not utils.TRITON_ABOVE_3_7_1
            and importlib.util.find_spec("tilelang") is None):
        raise ConfigError(
            "model=gdn", f"fla-core's GDN backward gives wrong gradients with Triton {triton.__version__} on "
            "Hopper GPUs (fla #640), and fla refuses it at the first backward step",
            "pip install 'triton>=3.7.1' (or tilelang); on a machine without network, "
            "bash benchmarks/pack_triton.sh here, carry .triton/ and unpack it first on PYTHONPATH (docs/troubleshooting.md)")


def _disable_jit_on_cpu() -> None:
    """Run GDN's ``@jit_fuser`` (``torch.compile``) helpers eagerly on a CPU.

    megatron decorates ``_apply_gated_norm``, ``_prepare_input_for_gated_delta_rule`` and
    ``_compute_g_and_beta`` with ``torch.compile`` at import; on a CPU that would build C++ with
    inductor for each shape (seconds to minutes, per test). The eager function is the same math.
    """
    from megatron.core.ssm.gated_delta_net.common import _GDNBase

    for name in ("_apply_gated_norm", "_prepare_input_for_gated_delta_rule", "_compute_g_and_beta"):
        fn = _GDNBase.__dict__[name]
        eager = getattr(fn, "_torchdynamo_orig_callable", None)
        if eager is not None:
            _SWAPPED[f"_GDNBase.{name}"] = fn
            setattr(_GDNBase, name, eager)


def gdn_ops_in_use() -> dict[str, str]:
    """Which implementation each kernel of megatron's GDN resolves to now (module.function)."""
    from megatron.core.ssm.gated_delta_net import common, gdn

    return {name: f"{fn.__module__}.{fn.__name__}" for name, fn in (
        ("chunk_gated_delta_rule", gdn.chunk_gated_delta_rule),
        ("causal_conv1d", gdn.causal_conv1d), ("l2norm", common.l2norm))}


def linear_attention_pattern(config) -> list[int]:
    """Per layer, 1 for GatedDeltaNet and 0 for standard attention (megatron's own parser)."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_linear_attention_pattern,
    )

    return get_linear_attention_pattern(config)


def gdn_layer_spec(attention_layer_spec):
    """``attention_layer_spec`` (a local layer spec, dense or MoE MLP) with a GatedDeltaNet mixer in
    place of its self-attention; ``recipes.build.model.build_block_spec`` places it where the pattern says."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    select_gdn_ops()
    check_fla_kernels()
    layer = attention_layer_spec.submodules
    return dataclasses.replace(attention_layer_spec, submodules=dataclasses.replace(
        layer,
        self_attention=ModuleSpec(
            module=GatedDeltaNet,
            submodules=GatedDeltaNetSubmodules(
                in_proj=ColumnParallelLinear,
                out_norm=layer.input_layernorm,  # the local norm (RMSNorm or LayerNorm)
                out_proj=RowParallelLinear,
            ),
        ),
    ))
