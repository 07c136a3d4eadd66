"""data=indexed on real text: preprocess local files, read them back exactly, train on them, refuse bad input.

The corpus is a few standard-library modules (text on every machine) plus a JSONL file, preprocessed into
a temporary directory with the byte tokenizer. Everything runs in this process on a CPU.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import statistics

import numpy
import pytest
from conftest import compose, train_in_process

STDLIB = ("bisect", "copy", "operator", "queue", "string")
RECORDS = [f"record {i}: " + "the quick brown fox jumps over the lazy dog. " * (i + 1) for i in range(9)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(prefix, expected documents as token lists, cache dir) of a small preprocessed corpus."""
    from recipes.data.preprocess import preprocess, stdlib_files

    root = tmp_path_factory.mktemp("corpus")
    texts = root / "texts"
    texts.mkdir()
    by_name = {p.stem: p for p in stdlib_files()}
    for name in STDLIB:
        shutil.copy(by_name[name], texts / f"{name}.py")
    (texts / "__init__.py").write_text("")  # empty in a directory: skipped, counted
    (texts / ".hidden.txt").write_text("not read")
    jsonl = root / "extra.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t}) for t in RECORDS + [""]) + "\n")
    meta = preprocess([texts, jsonl], str(root / "small"), append_eod=True, progress_interval=-1)
    assert meta["skipped"] == {"empty files": 1, "empty records": 1}
    documents = [(texts / f"{n}.py").read_text() for n in sorted(STDLIB)] + RECORDS
    expected = [list(d.encode("utf-8")) + [256] for d in documents]
    return str(root / "small_text_document"), expected, str(root / "cache")


def indexed_cfg(prefix: str, cache: str, *overrides: str) -> dict:
    return compose("data=indexed", f"data.paths=[{prefix}]", "data.split='80,20,0'",
                   f"data.cache_dir={cache}", "measure.profile=none", *overrides)


def test_indexed_dataset_round_trip(corpus):
    """megatron's IndexedDataset returns exactly the token ids written, document by document."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix, expected, _ = corpus
    ds = IndexedDataset(prefix)
    assert len(ds) == len(expected) == 14
    assert ds.index.dtype == numpy.uint16  # megatron's optimal dtype for a 257-token vocabulary
    for i, doc in enumerate(expected):
        assert ds[i].tolist() == doc
    meta = json.loads(open(prefix + ".meta.json").read())
    assert meta["num_tokens"] == sum(map(len, expected)) and meta["max_token_id"] == 256
    assert meta["tokenizer"]["vocab_size"] == 257


def test_gpt_dataset_samples_are_the_written_tokens(corpus, megatron_world):
    """Every GPTDataset sample is a window of the documents in megatron's order, eod tokens intact."""
    from recipes.data.indexed import build_indexed_datasets

    prefix, expected, cache = corpus
    cfg = indexed_cfg(prefix, cache)
    seq = cfg["train"]["seq_length"]
    train, valid, test = build_indexed_datasets(cfg, [50, 10, 0])
    assert test is None and len(train) >= 50 and len(valid) >= 10
    for ds, docs in ((train, range(0, 11)), (valid, range(11, 14))):
        assert set(ds.document_index.tolist()) == set(docs)  # the 80/20 split, by document
        stream = numpy.concatenate([expected[d] for d in ds.document_index])
        for i in range(len(ds)):
            start = int(ds.shuffle_index[i]) * seq
            window = stream[start:start + seq + 1]
            sample = ds[i]
            assert sample["tokens"].tolist() == window[:-1].tolist()
            assert sample["labels"].tolist() == window[1:].tolist()
            assert sample["loss_mask"].min() == 1.0  # eod (256) is a real token, not padding
    assert (numpy.concatenate([train[i]["tokens"].numpy() for i in range(len(train))]) == 256).any()


def test_training_on_text_lowers_train_and_validation_loss(corpus, megatron_world):
    prefix, _, cache = corpus
    cfg = indexed_cfg(prefix, cache, "train.train_iters=40", "train.lr=1e-3", "data.eval_interval=10",
                      "measure.ledger=false")
    result = train_in_process(cfg)
    losses, evals = result["loss"], result["eval_loss"]
    first, last = statistics.mean(losses[:3]), statistics.mean(losses[-3:])
    print(f"train loss {first:.3f} -> {last:.3f}; val {[round(e['loss'], 3) for e in evals]}")
    assert first > 5.5  # about ln(257): the untrained model knows nothing
    assert last < first - 1.5
    assert [e["step"] for e in evals] == [10, 20, 30, 40]
    # validation text (English records) is not the Python the model mostly trains on; it still falls
    assert evals[-1]["loss"] < evals[0]["loss"] - 0.8
    assert all(e["loss"] < first for e in evals)


def refusal(cfg: dict) -> str:
    """The controller's checks before launch: the rules, then the data files."""
    from recipes.data.indexed import validate_data
    from recipes.errors import ConfigError
    from recipes.validate import validate

    with pytest.raises(ConfigError) as err:
        validate(cfg, num_gpus=0, te_available=False)
        validate_data(cfg)
    return str(err.value)


def test_bad_datasets_are_refused_before_training(corpus, tmp_path):
    prefix, _, cache = corpus
    assert "missing prefix" in refusal(indexed_cfg(str(tmp_path / "nothing"), cache))
    half = tmp_path / "half"
    shutil.copy(prefix + ".bin", f"{half}.bin")
    assert f"{half}.bin has no .idx file" in refusal(indexed_cfg(str(half), cache))
    message = refusal(indexed_cfg(prefix, cache, "model.vocab_size=200"))
    assert message.startswith("model.vocab_size") and "257 tokens" in message
    assert f"{prefix}.meta.json" in message and "model.vocab_size=257" in message
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    empty = tmp_path / "empty"  # a dataset with no documents, written by megatron's builder
    IndexedDatasetBuilder(f"{empty}.bin", dtype=numpy.uint16).finalize(f"{empty}.idx")
    assert f"{empty}.bin is empty" in refusal(indexed_cfg(str(empty), cache, "data.tokenizer=byte"))
    assert "takes prefixes" in refusal(indexed_cfg(prefix + ".bin", cache))
    assert "no validation part" in refusal(indexed_cfg(prefix, cache, "data.split='1,0,0'",
                                                       "data.eval_interval=5"))
    bare = tmp_path / "bare"  # a dataset made elsewhere (no sidecar) needs data.tokenizer
    for suffix in (".bin", ".idx"):
        shutil.copy(prefix + suffix, f"{bare}{suffix}")
    assert "data.tokenizer=byte" in refusal(indexed_cfg(str(bare), cache))
    from recipes.data.indexed import validate_data

    validate_data(indexed_cfg(str(bare), cache, "data.tokenizer=byte"))
    tj = tmp_path / "tokenizer.json"  # only checked to exist here; the worker loads it (tests/test_tokenizers.py)
    tj.write_text("{}")
    validate_data(indexed_cfg(str(bare), cache, f"data.tokenizer={tj}"))
    assert "no such file" in refusal(indexed_cfg(str(bare), cache, f"data.tokenizer={tmp_path / 'nope.json'}"))
    assert "601 tokens but the model's vocabulary is 512" in refusal(  # null's vocabulary is known here
        indexed_cfg(str(bare), cache, "data.tokenizer=null:601"))
    assert "says the data was made with byte" in refusal(indexed_cfg(prefix, cache, "data.tokenizer=null:601"))


def test_truncated_or_out_of_vocabulary_data_is_refused_naming_the_file(corpus, tmp_path):
    """A .bin cut short (a copy interrupted), a .idx cut short, and token ids past model.vocab_size are
    found before launch, with the file named, not by a worker mid-run."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix, _, cache = corpus
    cut = tmp_path / "cut"
    for suffix in (".bin", ".idx", ".meta.json"):
        shutil.copy(prefix + suffix, f"{cut}{suffix}")
    with open(f"{cut}.bin", "r+b") as f:
        f.truncate(f.seek(0, 2) - 100)
    message = refusal(indexed_cfg(str(cut), cache))
    assert message.startswith("data.paths") and f"{cut}.bin has" in message and "truncated" in message
    shutil.copy(prefix + ".bin", f"{cut}.bin")
    with open(f"{cut}.idx", "r+b") as f:
        f.truncate(f.seek(0, 2) - 8)
    assert f"{cut}.idx is truncated" in refusal(indexed_cfg(str(cut), cache))
    wide = tmp_path / "wide"  # made with a larger vocabulary than declared: ids up to 600, no sidecar
    builder = IndexedDatasetBuilder(f"{wide}.bin", dtype=numpy.uint16)
    for i in range(10):
        builder.add_document(numpy.arange(i, 600 - i, dtype=numpy.uint16), [600 - 2 * i])
    builder.finalize(f"{wide}.idx")
    message = refusal(indexed_cfg(str(wide), cache, "data.tokenizer=byte", "data.split='100,0,0'"))
    assert message.startswith("model.vocab_size") and f"{wide}.bin" in message and "token id 599" in message
    assert "model.vocab_size=600" in message


def test_bad_preprocess_inputs_name_the_file(tmp_path, capsys):
    from recipes.data.preprocess import main

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main([str(empty), "--output-prefix", str(tmp_path / "out")]) == 2
    assert f"input {empty} is empty" in capsys.readouterr().err
    assert not list(tmp_path.glob("out*"))  # nothing half-written
    assert main([str(tmp_path / "missing.txt"), "--output-prefix", str(tmp_path / "out")]) == 2
    assert "missing.txt: no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "x"}\n')
    assert main([str(bad), "--output-prefix", str(tmp_path / "out")]) == 2
    assert "bad.jsonl:1: not a JSON object with a 'text' string" in capsys.readouterr().err
    if importlib.util.find_spec("transformers") is None:
        tok = tmp_path / "tokenizer.json"
        tok.write_text("{}")
        text = tmp_path / "a.txt"
        text.write_text("hello")
        assert main([str(text), "--output-prefix", str(tmp_path / "out"), "--tokenizer", str(tok)]) == 2
        assert "pip install transformers" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["binary", "text_not_a_string", "binary_jsonl", "device", "json_key_escapes",
                                  "prefix_under_a_file"])
def test_preprocess_refuses_bad_input_naming_it_and_the_fix(tmp_path, capsys, case):
    """Exit 2, one line naming the input and what to do, nothing written (never a traceback, a hang
    on an endless device, or files outside the output prefix)."""
    from recipes.data.preprocess import main

    out = tmp_path / "out" / "prefix"
    text = tmp_path / "a.txt"
    text.write_text("hello")
    args, says = {
        "binary": ("data.bin", "input {} is not UTF-8 text (binary?): remove it from the inputs, or convert it"),
        "text_not_a_string": ("nums.jsonl", "{}:2: field 'text' holds [\"a\"], not a string: store the text as a "
                              "string, or set --json-key"),
        "binary_jsonl": ("bin.jsonl", "{}:1: not UTF-8 text (binary?): JSONL is UTF-8"),
        "device": ("/dev/zero", "input {} is not a regular file (a device, pipe or socket): give text files"),
        "json_key_escapes": ("a.txt", "--json-key '../../x': a field name of letters, digits"),
        "prefix_under_a_file": ("a.txt", "cannot write {}/o_text_document.bin ({} is a file, not a directory): "
                                "choose a prefix in a writable directory"),
    }[case]
    path = tmp_path / args if not args.startswith("/") else args
    if case == "binary":
        path.write_bytes(bytes(range(256)) * 4)
    elif case == "text_not_a_string":
        path.write_text('{"text": "fine"}\n{"text": ["a"]}\n')
    elif case == "binary_jsonl":
        path.write_bytes(b"\xff\xfe\x00{}")
    argv = [str(path), "--output-prefix", str(out), "--progress-interval", "-1"]
    if case == "json_key_escapes":
        argv += ["--json-key", "../../x"]
    if case == "prefix_under_a_file":
        argv[2] = str(text / "o")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says.format(path, path) in err, err
    assert not list(tmp_path.rglob("*_document*")) and not list(tmp_path.parent.glob("x_document*"))


def test_progress_reports_rates(tmp_path, capsys):
    from recipes.data.preprocess import preprocess

    for i in range(3):
        (tmp_path / f"{i}.txt").write_text("some text " * 100)
    preprocess([tmp_path], str(tmp_path / "p"), progress_interval=0)
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("[preprocess]")]
    assert len(lines) == 4 and "docs/s" in lines[0] and "MB/s" in lines[0]
    assert lines[-1].startswith("[preprocess] done: 3 docs")


def test_data_parallel_ranks_read_disjoint_samples(monkeypatch):
    """Rank r of a DP group of 2 takes the r-th micro-batch of every global batch (megatron's sampler)."""
    import torch
    from megatron.core import parallel_state as ps

    from recipes.data.datasets import batches

    dataset = [{k: torch.tensor([i]) for k in ("tokens", "labels", "loss_mask", "position_ids")}
               for i in range(16)]
    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda: 2)
    seen = {}
    for rank in (0, 1):
        monkeypatch.setattr(ps, "get_data_parallel_rank", lambda rank=rank: rank)
        it = batches(dataset, 2, torch.device("cpu"))
        seen[rank] = [next(it)["tokens"].flatten().tolist() for _ in range(3)]
    assert seen == {0: [[0, 1], [4, 5], [8, 9]], 1: [[2, 3], [6, 7], [10, 11]]}
