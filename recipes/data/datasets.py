"""Training data through megatron-core's dataset classes.

``data=mock`` draws synthetic token sequences from megatron's ``MockGPTDataset`` (no files, no
download). Batches are yielded as ``{tokens, labels, loss_mask, position_ids}`` on this process's
device; attention masks are not materialized (the core-attention modules apply the causal mask).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from recipes.data.gpt import ByteTokenizer, gpt_dataset_config
from recipes.data.indexed import build_indexed_datasets


def build_datasets(cfg: Any, num_samples: list[int]):
    """(train, valid, test) megatron datasets for ``cfg.data`` (valid/test may be None)."""
    # lazy: megatron takes seconds to import; tools that never build a model skip it
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    name = cfg["data"]["name"]
    if name == "mock":
        config = gpt_dataset_config(cfg, ByteTokenizer(), split="1,0,0")
        builder = BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, lambda: True, config)
        return builder.build()
    if name == "indexed":
        return build_indexed_datasets(cfg, num_samples)
    raise ValueError(f"data.name={name!r} is not known; use data=mock or data=indexed")


def batches(dataset, micro_batch_size: int, device: torch.device, seed: int = 0) -> Iterator[dict]:
    """An endless iterator of micro-batches drawn in order from a megatron GPT dataset.

    Each data-parallel rank takes its own slice of every global step's samples (as megatron's
    ``MegatronPretrainingSampler`` does), so DP ranks never train on the same text.
    """
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = 0, 1
    if ps.model_parallel_is_initialized():
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    index = dp_rank * micro_batch_size
    while True:
        samples = [dataset[(index + i) % len(dataset)] for i in range(micro_batch_size)]
        index += micro_batch_size * dp_size
        batch = {}
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            batch[key] = torch.stack([torch.as_tensor(s[key]) for s in samples]).to(device)
        yield batch
