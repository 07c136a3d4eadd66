"""Tokenizers through megatron-core (``recipes.data.tokenizer``): each kind that can be built offline is
built here, preprocessed with, and read back; nothing downloads; preprocessing and training agree on the
vocabulary and the end-of-document id, and training refuses a mismatch before the model is built.

The byte and null tokenizers need nothing more. Hugging Face needs ``transformers`` (and ``tokenizers`` to
build a tokenizer.json here), SentencePiece ``sentencepiece``, tiktoken ``tiktoken``: without them those
tests skip, saying which package is missing (none is a dependency of this repository).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import shutil

import numpy
import pytest
from conftest import compose

from recipes.data.indexed import BYTE_TOKENIZER, check_tokenizer, validate_data
from recipes.data.preprocess import PreprocessError, preprocess, preprocess_tokenizer
from recipes.errors import ConfigError
from recipes.results import RankResult

TEXT = "the quick brown fox jumps over the lazy dog. héllo wörld\n"


def needs(*packages: str):
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (pip install {' '.join(missing)})")


def _corpus(tmp_path, tokenizer: str = "byte", **kwargs) -> tuple[str, dict]:
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": f"{i} {TEXT * 5}"}) for i in range(10)) + "\n")
    meta = preprocess([tmp_path / "docs.jsonl"], str(tmp_path / "c"), tokenizer, append_eod=True,
                      progress_interval=-1, **kwargs)
    return str(tmp_path / "c_text_document"), meta


def _cfg(prefix: str, *overrides: str) -> dict:
    return compose("data=indexed", f"data.paths=[{prefix}]", "data.split='80,20,0'", *overrides)


def _read(prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def test_byte_is_megatron_s_byte_level_tokenizer_and_writes_utf8_bytes(tmp_path):
    tok = preprocess_tokenizer("byte")
    assert type(tok.megatron._tokenizer).__name__ == "ByteLevelTokenizer"
    assert tok.info == BYTE_TOKENIZER and tok.tokenize(TEXT).tolist() == list(TEXT.encode("utf-8"))
    prefix, meta = _corpus(tmp_path)
    assert meta["tokenizer"] == BYTE_TOKENIZER and meta["dtype"] == "uint16"
    assert _read(prefix)[3] == list(f"3 {TEXT * 5}".encode()) + [256]


def test_null_tokenizer_reads_ids(tmp_path):
    tok = preprocess_tokenizer("null:300")
    assert tok.info["vocab_size"] == 300 and tok.eod == 299 and tok.tokenize("5 7 299").tolist() == [5, 7, 299]


def test_missing_files_packages_and_names_are_refused_with_the_fix(tmp_path, monkeypatch):
    with pytest.raises(PreprocessError, match=r"--tokenizer .*nope/tokenizer.json: no such file.*never downloaded"):
        preprocess_tokenizer(str(tmp_path / "nope/tokenizer.json"))
    with pytest.raises(PreprocessError, match="null tokenizer needs its vocabulary size"):
        preprocess_tokenizer("null:many")
    (tmp_path / "sp.model").write_bytes(b"x")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sentencepiece" else real(name, *a))
    with pytest.raises(PreprocessError, match="needs the sentencepiece package.*pip install sentencepiece"):
        preprocess_tokenizer(str(tmp_path / "sp.model"))
    with pytest.raises(ConfigError, match="data.tokenizer"):
        validate_data(compose("data=indexed", f"data.tokenizer={tmp_path / 'missing.model'}"))


def test_a_hugging_face_name_is_read_from_the_local_cache_only(monkeypatch):
    """``org/name`` is never downloaded: megatron's loader runs with HF_HUB_OFFLINE=1, and a name that is
    not in the cache is refused saying so."""
    from megatron.core.tokenizers import MegatronTokenizer

    seen = {}

    def from_pretrained(**kwargs):
        import os

        seen["offline"] = os.environ.get("HF_HUB_OFFLINE")
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them "
                      "in the cached files.")

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "transformers" else real(name, *a))
    monkeypatch.setattr(MegatronTokenizer, "from_pretrained", from_pretrained)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(PreprocessError, match="not in the local Hugging Face cache"):
        preprocess_tokenizer("meta-llama/Llama-3.1-8B")
    assert seen["offline"] == "1"
    import os

    assert "HF_HUB_OFFLINE" not in os.environ  # restored


def test_training_refuses_a_tokenizer_that_disagrees_with_the_data_before_the_model(tmp_path, monkeypatch):
    from recipes.run import worker

    prefix, _ = _corpus(tmp_path)
    cfg = _cfg(prefix, "data.tokenizer=null:300")
    with pytest.raises(ConfigError) as err:
        validate_data(cfg)  # the null tokenizer's vocabulary is known without loading it
    assert "null:300 has 300 tokens (eod 299)" in str(err.value) and "257 tokens, eod 256" in str(err.value)
    assert check_tokenizer(_cfg(prefix, "data.tokenizer=byte")) == BYTE_TOKENIZER
    meta = json.loads((tmp_path / "c_text_document.meta.json").read_text())
    meta["tokenizer"]["eod"] = 0  # made with another end-of-document id
    (tmp_path / "c_text_document.meta.json").write_text(json.dumps(meta))
    cfg = _cfg(prefix, "data.tokenizer=byte")

    def no_model(cfg):
        raise AssertionError("the model was built before the tokenizer check")

    monkeypatch.setattr(worker, "Trainer", no_model)
    with pytest.raises(ConfigError) as err:
        worker.train_and_measure(cfg, RankResult(rank=0))
    message = str(err.value)
    assert message.startswith("data.tokenizer") and "eod 256 here, 0 in the data" in message
    assert "re-run python -m recipes preprocess with --tokenizer byte" in message


def _built_tokenizer_json(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]))
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return tok


@needs("tokenizers", "transformers")
def test_a_local_tokenizer_json_through_megatron(tmp_path):
    hf = _built_tokenizer_json(tmp_path / "tok")
    eod = hf.token_to_id("<|endoftext|>")
    for spec in (tmp_path / "tok" / "tokenizer.json", tmp_path / "tok"):  # the file, or its directory
        tok = preprocess_tokenizer(str(spec))
        assert tok.vocab_size == hf.get_vocab_size() and tok.eod == eod
        assert tok.tokenize(TEXT).tolist() == hf.encode(TEXT, add_special_tokens=False).ids
    prefix, meta = _corpus(tmp_path, str(tmp_path / "tok" / "tokenizer.json"))
    assert meta["tokenizer"]["name"] == "huggingface" and meta["tokenizer"]["eod"] == eod and meta["tokenizer"]["sha256"]
    assert _read(prefix)[0] == hf.encode(f"0 {TEXT * 5}", add_special_tokens=False).ids + [eod]
    ok = _cfg(prefix, f"data.tokenizer={tmp_path / 'tok'}")
    validate_data(ok)
    assert check_tokenizer(ok)["vocab_size"] == hf.get_vocab_size()
    with pytest.raises(ConfigError, match="data.tokenizer"):
        validate_data(_cfg(prefix, "data.tokenizer=byte"))
    (tmp_path / "tok" / "tokenizer.json").rename(tmp_path / "tok" / "other.json")
    with pytest.raises(PreprocessError, match="must be named tokenizer.json"):
        preprocess_tokenizer(str(tmp_path / "tok" / "other.json"))
    with pytest.raises(PreprocessError, match="--eod-token '<nope>': the byte tokenizer names no tokens"):
        preprocess_tokenizer("byte", eod_token="<nope>")  # not ignored: the data would end documents otherwise
    with pytest.raises(PreprocessError, match="--eod-token '<nope>' is not one of its tokens"):
        shutil.copy(tmp_path / "tok" / "other.json", tmp_path / "tok" / "tokenizer.json")
        preprocess_tokenizer(str(tmp_path / "tok"), eod_token="<nope>")


@needs("sentencepiece")
def test_a_local_sentencepiece_model_through_megatron(tmp_path):
    import sentencepiece

    (tmp_path / "text.txt").write_text(TEXT * 50)
    sentencepiece.SentencePieceTrainer.train(input=str(tmp_path / "text.txt"), model_prefix=str(tmp_path / "sp"),
                                            vocab_size=34, minloglevel=2)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    tok = preprocess_tokenizer(str(tmp_path / "sp.model"))
    assert tok.vocab_size == sp.get_piece_size() and tok.eod == sp.eos_id()
    assert tok.tokenize("the lazy dog").tolist() == sp.encode("the lazy dog")
    prefix, meta = _corpus(tmp_path, str(tmp_path / "sp.model"))
    assert meta["tokenizer"]["name"] == "sentencepiece" and _read(prefix)[1][-1] == sp.eos_id()


@needs("tiktoken")
def test_a_local_tiktoken_vocabulary_through_megatron(tmp_path):
    vocab = [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": chr(i)} for i in range(256)]
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    tok = preprocess_tokenizer(f"tiktoken:{tmp_path / 'vocab.json'}")
    ids = tok.tokenize("dog")
    assert len(ids) == 3 and tok.eod is not None and tok.vocab_size > int(numpy.max(ids))
    prefix, meta = _corpus(tmp_path, f"tiktoken:{tmp_path / 'vocab.json'}")
    assert meta["tokenizer"]["name"] == "tiktoken" and _read(prefix)[0][-1] == tok.eod
