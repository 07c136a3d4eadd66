"""What every GPT dataset here shares: megatron's dataset config for a run, and the byte tokenizer."""

from __future__ import annotations


class ByteTokenizer:
    """What ``data=mock`` tells megatron's ``MockGPTDataset``: a 257-token vocabulary whose end-of-document
    (and pad) id is 256. Text is tokenized by megatron-core's tokenizers (``recipes.data.tokenizer``)."""

    vocab_size = 257
    eod = 256
    pad = 256
    unique_identifiers = {"class": "ByteTokenizer"}  # megatron hashes it into the dataset cache key

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def gpt_dataset_config(seed: int, seq_length: int, tokenizer, blend=None, split=None):
    """megatron's GPTDatasetConfig for a run's seed and sequence length (``train.seed``,
    ``train.seq_length``; mock when no blend)."""
    # lazy: megatron takes seconds to import; tools that never build a model skip it
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
