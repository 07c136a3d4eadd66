"""Training data through megatron-core's dataset classes.

``data=mock`` draws synthetic token sequences from megatron's ``MockGPTDataset`` (no files, no
download). Batches are yielded as ``{tokens, labels, loss_mask, position_ids}`` on this process's
device; attention masks are not materialized (the core-attention modules apply the causal mask).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

from recipes.config import typed
from recipes.data.gpt import ByteTokenizer, gpt_dataset_config
from recipes.data.indexed import build_indexed_datasets


def build_datasets(cfg: Any, num_samples: list[int]):
    """(train, valid, test) megatron datasets for ``cfg.data`` (valid/test may be None)."""
    cfg = typed(cfg)
    name = cfg.data.name
    if name == "mock":
        return _mock_datasets(cfg.train.seed, cfg.train.seq_length, tuple(num_samples))
    if name == "indexed":
        return build_indexed_datasets(cfg, num_samples)
    raise ValueError(f"data.name={name!r} is not known; use data=mock or data=indexed")


@functools.lru_cache(maxsize=4)
def _mock_datasets(seed: int, seq_length: int, num_samples: tuple[int, ...]):
    """megatron's mock datasets, a function of the seed, the sequence length and the sizes alone (their
    samples are drawn by index; nothing in them changes as they are read): built once a process, where a
    process that builds several trainers (``recipes.run.world.fresh_trainer``: the tests, benchmarks) paid
    0.15 s each time on two CPU cores for three shuffled splits of a million samples."""
    # lazy: megatron takes seconds to import; tools that never build a model skip it
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    config = gpt_dataset_config(seed, seq_length, ByteTokenizer(), split="1,0,0")
    return BlendedMegatronDatasetBuilder(MockGPTDataset, list(num_samples), lambda: True, config).build()


class MicroBatches:
    """An endless iterator of micro-batches drawn in order from a megatron GPT dataset.

    Each data-parallel rank takes its own slice of every global step's samples (as megatron's
    ``MegatronPretrainingSampler`` does), so DP ranks never train on the same text. The position is
    ``consumed_samples`` (over all DP ranks), what a checkpoint stores and ``seek`` restores.
    """

    def __init__(self, dataset, micro_batch_size: int, device: torch.device):
        from megatron.core import parallel_state as ps

        self.dataset, self.micro_batch_size, self.device = dataset, micro_batch_size, device
        self.dp_rank, self.dp_size = 0, 1
        if ps.model_parallel_is_initialized():
            self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.drawn = 0  # micro-batches this rank has drawn

    @property
    def consumed_samples(self) -> int:
        return self.drawn * self.micro_batch_size * self.dp_size

    def seek(self, consumed_samples: int) -> None:
        """Continue after ``consumed_samples`` samples (all DP ranks together)."""
        per_draw = self.micro_batch_size * self.dp_size
        if consumed_samples % per_draw:
            raise ValueError(f"{consumed_samples} consumed samples are not a whole number of "
                             f"micro-batches of {self.micro_batch_size} on {self.dp_size} data-parallel ranks")
        self.drawn = consumed_samples // per_draw

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        mbs = self.micro_batch_size
        index = self.dp_rank * mbs + self.drawn * mbs * self.dp_size
        samples = [self.dataset[(index + i) % len(self.dataset)] for i in range(mbs)]
        self.drawn += 1
        batch = {}
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            batch[key] = torch.stack([torch.as_tensor(s[key]) for s in samples])
        if self.device.type != "cuda":
            return {key: value.to(self.device) for key, value in batch.items()}
        # From pinned memory without a wait: a copy from pageable memory makes the host wait for the
        # device (4 times a micro-batch, each while the previous micro-batch's kernels are queued).
        # The pinned allocator keeps each buffer until its copy has run.
        return {key: value.pin_memory().to(self.device, non_blocking=True) for key, value in batch.items()}


def batches(dataset, micro_batch_size: int, device: torch.device) -> MicroBatches:
    """The micro-batches of ``dataset`` for this rank, from the start (``MicroBatches``)."""
    return MicroBatches(dataset, micro_batch_size, device)
