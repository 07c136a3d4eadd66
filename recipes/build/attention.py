"""Core-attention modules for megatron-core's local (no Transformer Engine) spec.

Both take megatron's core-attention call (``query, key, value`` as ``[s, b, heads, dim]``, the
attention mask, ``attn_mask_type``) and accept MLA's ``k_channels``/``v_channels``, which megatron's
own ``DotProductAttention`` rejects (Megatron-LM issue 1589, see ``recipes.build.upstream``).

- ``UnfusedAttention`` materializes the ``[b, heads, s, s]`` scores and probabilities exactly as
  megatron's ``DotProductAttention`` does (scale, causal mask, softmax in fp32 when
  ``attention_softmax_in_fp32``, dropout under the tensor-parallel RNG). Those tensors are what
  ``core_attn`` recompute discards.
- ``SDPAAttention`` calls ``torch.nn.functional.scaled_dot_product_attention`` (flash / cuDNN /
  memory-efficient kernels on a GPU): it never stores the probabilities, so ``core_attn`` saves
  little there. The guide's point, measurable with the ledger.

Under ``train.deterministic`` (torch's deterministic algorithms) both are deterministic without a change
here: torch's SDPA dispatcher skips cuDNN's kernel, runs flash attention's deterministic backward, and
the memory-efficient kernel (MLA's unequal q/k and v head dims) with one key split.

Context parallelism is not supported by either (megatron's TE attention is needed for it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class _CoreAttention(MegatronModule):
    """Shared constructor: head counts per tensor-parallel rank, softmax scale, dropout."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                f"{type(self).__name__} does not support context parallelism; "
                "use attention=te (Transformer Engine) with context_parallel_size > 1"
            )
        if pg_collection is None:
            # lazy: megatron takes seconds to import; tools that never build a model skip it
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        self.num_heads = config.num_attention_heads // tp
        self.num_query_groups = config.num_query_groups // tp
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        )
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self._mask_cache: dict[tuple, torch.Tensor] = {}

    def _expand_groups(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """GQA: repeat key/value groups to the number of query heads (as megatron does).

        Read from the shapes: MLA has as many key/value heads as query heads, whatever
        ``num_query_groups`` says."""
        rep = query.size(2) // key.size(2)
        if rep > 1:
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)
        return key, value

    def _causal_mask(self, sq: int, sk: int, device: torch.device) -> torch.Tensor:
        """True where attention is masked; built on the query's device (megatron's is CUDA-only)."""
        key = (sq, sk, device)
        if key not in self._mask_cache:
            self._mask_cache[key] = torch.ones(sq, sk, dtype=torch.bool, device=device).triu(
                diagonal=1 + sk - sq
            )
        return self._mask_cache[key]

    def _is_causal(self, attention_mask, attn_mask_type, packed_seq_params, attention_bias) -> bool:
        """Refuse what neither module supports; True when the causal mask applies."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError(f"{type(self).__name__} supports neither packed sequences nor attention bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        return mask_type == AttnMaskType.causal or attention_mask is None

    def _dropout_ctx(self):
        if self.dropout_p > 0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        import contextlib

        return contextlib.nullcontext()


class UnfusedAttention(_CoreAttention):
    """Scores and probabilities materialized, as in megatron's local DotProductAttention."""

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **_,
    ):
        causal = self._is_causal(attention_mask, attn_mask_type, packed_seq_params, attention_bias)
        key, value = self._expand_groups(query, key, value)
        sq, b, np_, _ = query.shape
        sk = key.size(0)
        q = query.reshape(sq, b * np_, -1).transpose(0, 1)  # [b*np, sq, dk]
        k = key.reshape(sk, b * np_, -1).permute(1, 2, 0)  # [b*np, dk, sk]
        scores = torch.bmm(q, k).mul_(self.softmax_scale).view(b, np_, sq, sk)
        mask = self._causal_mask(sq, sk, scores.device) if causal else attention_mask
        if self.config.attention_softmax_in_fp32 and scores.dtype != torch.float32:
            probs = torch.softmax(scores.float().masked_fill(mask, -10000.0), dim=-1)
            probs = probs.to(query.dtype)
        else:
            probs = torch.softmax(scores.masked_fill(mask, -10000.0), dim=-1)
        with self._dropout_ctx():
            probs = F.dropout(probs, p=self.dropout_p, training=self.training)
        v = value.reshape(sk, b * np_, -1).transpose(0, 1)  # [b*np, sk, dv]
        context = torch.bmm(probs.view(b * np_, sq, sk), v)  # [b*np, sq, dv]
        context = context.view(b, np_, sq, -1).permute(2, 0, 1, 3).contiguous()
        return context.view(sq, b, np_ * self.v_channels)


class SDPAAttention(_CoreAttention):
    """torch's scaled_dot_product_attention: flash/cuDNN/efficient kernels, no stored probabilities."""

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **_,
    ):
        causal = self._is_causal(attention_mask, attn_mask_type, packed_seq_params, attention_bias)
        sq, b, np_, _ = query.shape
        rep = query.size(2) // key.size(2)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        with self._dropout_ctx():
            context = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None if causal else ~attention_mask,
                dropout_p=self.dropout_p if self.training else 0.0,
                is_causal=causal,
                scale=self.softmax_scale,
                enable_gqa=rep > 1,
            )
        # [b, h, s, dv] -> [s, b, h*dv]
        return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * self.v_channels)


CORE_ATTENTION = {"unfused": UnfusedAttention, "sdpa": SDPAAttention}
