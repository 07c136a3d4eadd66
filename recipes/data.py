"""Training data through megatron-core's dataset classes.

``data=mock`` draws synthetic token sequences from megatron's ``MockGPTDataset`` (no files, no
download). Batches are yielded as ``{tokens, labels, loss_mask, position_ids}`` on this process's
device; attention masks are not materialized (the core-attention modules apply the causal mask).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch


class ByteTokenizer:
    """Bytes as tokens (0-255) plus an end-of-document token (256): needs no download."""

    vocab_size = 257
    eod = 256
    pad = 256
    unique_identifiers = {"class": "ByteTokenizer"}  # megatron hashes it into the dataset cache key

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def gpt_dataset_config(cfg: Any, tokenizer, blend=None, split=None):
    """megatron's GPTDatasetConfig for this run's sequence length and seed (mock when no blend)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return GPTDatasetConfig(
        random_seed=cfg["train"]["seed"],
        sequence_length=cfg["train"]["seq_length"],
        blend=blend,
        split=split,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )


def build_datasets(cfg: Any, num_samples: list[int]):
    """(train, valid, test) megatron datasets for ``cfg.data`` (valid/test may be None)."""
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
        from recipes.indexed import build_indexed_datasets

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
