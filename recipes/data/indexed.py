"""``data=indexed``: megatron-core's ``GPTDataset`` over indexed datasets (``PREFIX.bin``/``PREFIX.idx``).

``data.paths`` is Megatron-LM's ``--data-path`` list: ``[prefix]``, ``[prefix, prefix]`` (weighted by size),
or ``[weight, prefix, weight, prefix...]``. ``BlendedMegatronDatasetBuilder`` splits every prefix into
train/valid/test by ``data.split`` (by document) and blends them; samples are ``train.seq_length`` tokens.

Two halves, so that bad input is refused before any worker starts:
- ``validate_data(cfg)`` runs in the controller and stays cheap (file existence, the ``.idx`` header and
  its last entries, the small ``PREFIX.meta.json`` sidecar written by ``recipes.data.preprocess``; no
  megatron import): missing prefix, ``.bin`` without ``.idx``, empty dataset, a truncated ``.idx`` or a
  ``.bin`` whose size disagrees with its index, a split part with no documents (megatron would loop
  forever on it), a tokenizer vocabulary larger than ``model.vocab_size``, and a token id at or past
  ``model.vocab_size`` (the sidecar's ``max_token_id``, else a scan of at most ``SCAN_BYTES`` of the ``.bin``).
  ``data.tokenizer`` is only checked to exist here (the byte and null tokenizers are known without loading).
- ``check_tokenizer(cfg)`` runs in the worker before the model is built: ``data.tokenizer`` loads through
  megatron-core (``recipes.data.tokenizer``) and must agree with every sidecar on vocabulary size and eod id,
  and fit ``model.vocab_size``; ``build_indexed_datasets(cfg, num_samples)`` then builds the datasets
  (``recipes.data.datasets.build_datasets``).

Relative prefixes are resolved against the repository root (the worker's working directory), so the
controller checks the same files the worker reads. Megatron's sample/shuffle index cache goes to
``data.cache_dir`` (default ``$XDG_CACHE_HOME/recompute-recipes/megatron-indices``), never the data folder.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path
from typing import Any

from recipes.config import typed
from recipes.data.gpt import ByteTokenizer, gpt_dataset_config
from recipes.data.tokenizer import BYTE_EOD, BYTE_VOCAB, KINDS, check_spec, load_tokenizer
from recipes.errors import ConfigError
from recipes.files import REPO_ROOT, UnreadableFile, read_json, write_json_atomic
from recipes.validate.run import output_problem

META_SUFFIX = ".meta.json"
#: What the sidecar records for the byte tokenizer (``recipes.data.tokenizer``; known without loading it).
BYTE_TOKENIZER = {"name": "byte", "library": "byte-level", "path": None, "sha256": None, "vocab_size": BYTE_VOCAB,
                  "eod": BYTE_EOD}
_INDEX_HEADER = b"MMIDIDX\x00\x00"  # megatron.core.datasets.indexed_dataset._INDEX_HEADER


def meta_path(prefix: str) -> str:
    """The sidecar that records how ``prefix`` was tokenized."""
    return f"{prefix}{META_SUFFIX}"


def write_meta(prefix: str, meta: dict) -> None:
    write_json_atomic(Path(meta_path(prefix)), meta)
    os.chmod(meta_path(prefix), 0o644)  # readable like the .bin/.idx next to it (mkstemp makes 0600)


def read_meta(prefix: str) -> dict | None:
    path = Path(meta_path(prefix))
    if not path.is_file():
        return None
    try:
        return read_json(path)
    except UnreadableFile as err:
        raise ConfigError("data.paths", str(err), "re-run recipes.data.preprocess, or delete the sidecar and set "
                          "data.tokenizer to the tokenizer the data was made with") from err


def resolve_prefix(prefix: str) -> str:
    """An absolute prefix: ``~`` expanded, relative paths taken from the repository root."""
    path = Path(os.path.expanduser(str(prefix)))
    return str(path if path.is_absolute() else REPO_ROOT / path)


def parse_blend(paths: list) -> tuple[list[str], list[float] | None]:
    """(prefixes, weights or None) from ``data.paths``, as megatron's ``get_blend_from_list`` reads it."""
    items = [str(p) for p in paths]
    if not items:
        raise ConfigError("data.paths", "data=indexed needs at least one dataset prefix",
                          "data.paths=[data/stdlib_text_document] (make data builds it), or "
                          "data.paths=[0.7,data/a_text_document,0.3,data/b_text_document]")

    def number(text: str) -> float | None:
        try:
            return float(text)
        except ValueError:
            return None

    pairs = len(items) % 2 == 0 and all(number(w) is not None for w in items[::2])
    if not pairs:
        if any(number(p) is not None for p in items):
            raise ConfigError("data.paths", f"{items} mixes weights and prefixes unevenly",
                              "give [prefix, ...] or [weight, prefix, weight, prefix, ...]")
        return items, None
    weights = [float(w) for w in items[::2]]
    if any(w <= 0 for w in weights):
        raise ConfigError("data.paths", f"weights {weights} must be positive",
                          "drop a dataset instead of giving it weight 0")
    return items[1::2], weights


def split_fractions(split: str) -> list[float]:
    """``data.split`` ("98,2,0") as normalized train/valid/test fractions (megatron's parsing)."""
    parts = [float(x) for x in re.findall(r"[.0-9]+", str(split))]
    parts += [0.0] * (3 - len(parts))
    if len(parts) != 3 or sum(parts) <= 0:
        raise ConfigError("data.split", f"{split!r} is not three non-negative weights",
                          "use e.g. \"data.split='98,2,0'\" (train,valid,test; quoted for Hydra)")
    return [p / sum(parts) for p in parts]


def split_documents(num_documents: int, fractions: list[float]) -> list[int]:
    """Documents per split, rounded exactly as ``BlendedMegatronDatasetBuilder`` rounds them."""
    bookends = [0.0, fractions[0], fractions[0] + fractions[1], 1.0]
    edges = [int(round(b * num_documents)) for b in bookends]
    return [edges[i + 1] - edges[i] for i in range(3)]


def read_index_header(idx_path: str) -> tuple[int, int]:
    """(number of sequences, number of documents) from a ``.idx`` header, without megatron."""
    with open(idx_path, "rb") as f:
        head = f.read(34)
    if len(head) < 34 or head[:9] != _INDEX_HEADER:
        raise ConfigError("data.paths", f"{idx_path} is not a megatron index (bad header)",
                          "rebuild it: python -m recipes preprocess INPUT... --output-prefix PREFIX")
    sequences, documents = struct.unpack("<QQ", head[18:34])
    return sequences, max(documents - 1, 0)


#: megatron's index dtype codes (``indexed_dataset.DType``) and their item sizes in bytes.
DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
#: The token scan reads at most this many bytes of a .bin (its start and its end), so the check stays cheap.
SCAN_BYTES = 64 * 2**20


def check_sizes(idx_path: str, bin_path: str) -> dict:
    """The ``.idx`` and ``.bin`` agree: the index holds every entry its header counts, and the ``.bin`` is
    as long as the index's last sequence ends (megatron's format: 34-byte header, then int32 lengths,
    int64 byte pointers and int64 document indices). A truncated or mismatched pair is refused here, not
    found by a worker mid-run. Returns the dtype and token count."""
    import numpy

    with open(idx_path, "rb") as f:
        head = f.read(34)
    code = head[17]
    if code not in DTYPES:
        raise ConfigError("data.paths", f"{idx_path} has an unknown token dtype code {code}",
                          "rebuild it: python -m recipes preprocess INPUT... --output-prefix PREFIX")
    dtype = numpy.dtype(DTYPES[code])
    sequences, documents = struct.unpack("<QQ", head[18:34])
    need = 34 + 12 * sequences + 8 * documents
    have = os.path.getsize(idx_path)
    if have < need:
        raise ConfigError("data.paths", f"{idx_path} is truncated: its header counts {sequences} sequences and "
                          f"{documents} document indices ({need} bytes), the file has {have} bytes",
                          "copy the complete file, or rebuild the dataset with python -m recipes preprocess")
    with open(idx_path, "rb") as f:
        f.seek(34 + 4 * (sequences - 1))
        (last_length,) = struct.unpack("<i", f.read(4))
        f.seek(34 + 4 * sequences + 8 * (sequences - 1))
        (last_pointer,) = struct.unpack("<q", f.read(8))
    expected = last_pointer + last_length * dtype.itemsize
    size = os.path.getsize(bin_path)
    if size != expected:
        raise ConfigError("data.paths", f"{bin_path} has {size} bytes but {idx_path} indexes {expected} "
                          f"({expected // dtype.itemsize} {dtype.name} tokens): "
                          + ("truncated" if size < expected else "longer than its index (another dataset's?)"),
                          "copy the complete .bin and .idx of one dataset, or rebuild it with python -m recipes preprocess")
    return {"dtype": dtype, "num_tokens": expected // dtype.itemsize}


def largest_token_id(bin_path: str, dtype, limit: int = SCAN_BYTES) -> tuple[int, bool]:
    """(the largest token id in ``bin_path``, whether the whole file was read). Files above ``limit``
    bytes are read at their first and last ``limit / 2`` bytes only: a bounded cost per launch."""
    import numpy

    size = os.path.getsize(bin_path)
    if size <= limit:
        chunks = [numpy.fromfile(bin_path, dtype=dtype)]
    else:
        count = limit // 2 // dtype.itemsize
        tail = (size // dtype.itemsize - count) * dtype.itemsize
        chunks = [numpy.fromfile(bin_path, dtype=dtype, count=count),
                  numpy.fromfile(bin_path, dtype=dtype, count=count, offset=tail)]
    return max(int(c.max()) for c in chunks if c.size), size <= limit


def _tokenizer_error(what: str, fix: str) -> ConfigError:
    return ConfigError("data.tokenizer", what, fix)


def declared_tokenizer(spec: str) -> dict:
    """``data.tokenizer`` as far as the controller knows it without loading it: the byte and null tokenizers
    in full; any other kind's files must exist here (its vocabulary and eod are ``check_tokenizer``'s)."""
    kind, where = check_spec(spec, _tokenizer_error)
    if kind == "byte":
        return dict(BYTE_TOKENIZER)
    if kind == "null":
        vocab = int(where)
        return {"name": "null", "library": KINDS["null"][0], "path": None, "sha256": None, "vocab_size": vocab,
                "eod": vocab - 1}
    return {"name": kind, "library": KINDS[kind][0], "path": where, "sha256": None, "vocab_size": None, "eod": None}


_LOADED: dict[str, dict] = {}  # data.tokenizer -> what megatron-core loaded (once per worker)


def check_tokenizer(cfg: Any) -> dict | None:
    """Worker, before the model is built: ``data.tokenizer`` through megatron-core, which must agree with
    every prefix's sidecar on vocabulary size and end-of-document id (the data was made with it) and fit
    ``model.vocab_size``. Returns what it loaded (None without ``data=indexed`` and ``data.tokenizer``)."""
    cfg = typed(cfg)
    data = cfg.data
    spec = data.tokenizer if data.name == "indexed" else None
    if not spec:
        return None
    if spec not in _LOADED:
        _LOADED[spec] = load_tokenizer(spec, _tokenizer_error).info
    info = _LOADED[spec]
    for raw in parse_blend(list(data.paths))[0]:
        meta = read_meta(resolve_prefix(raw))
        made = (meta or {}).get("tokenizer") or {}
        differs = [f"{k} {info[k]} here, {made.get(k)} in the data" for k in ("vocab_size", "eod")
                   if meta is not None and made.get(k) != info[k]]
        if differs:
            raise ConfigError("data.tokenizer", f"{spec} ({info['name']}) disagrees with {meta_path(resolve_prefix(raw))}, "
                              f"made with {made.get('name')} {made.get('path') or ''}: " + "; ".join(differs),
                              "drop data.tokenizer (the sidecar's tokenizer is used), give the tokenizer the data "
                              "was made with, or re-run python -m recipes preprocess with --tokenizer " + spec)
    if info["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", f"data.tokenizer {spec}: the {info['name']} tokenizer has "
                          f"{info['vocab_size']} tokens but the model's vocabulary is {cfg.model.vocab_size}",
                          f"set model.vocab_size={info['vocab_size']} or more, or use a smaller tokenizer")
    return info


def inspect_data(cfg: Any) -> dict:
    """Check every prefix of ``data.paths``; returns prefixes, weights and the tokenizer they share."""
    cfg = typed(cfg)
    data, model = cfg.data, cfg.model
    raw_prefixes, weights = parse_blend(list(data.paths))
    fractions = split_fractions(data.split)
    if data.eval_interval and fractions[1] == 0:
        raise ConfigError("data.split", f"data.eval_interval={data.eval_interval} but "
                          f"data.split={data.split} has no validation part",
                          "give the split a validation weight (\"data.split='98,2,0'\") or data.eval_interval=0")
    declared = declared_tokenizer(data.tokenizer) if data.tokenizer else None
    tokenizer, source = declared, "data.tokenizer"
    prefixes, tops = [], []
    for raw in raw_prefixes:
        prefix = resolve_prefix(raw)
        if raw.endswith((".bin", ".idx")):
            raise ConfigError("data.paths", f"{raw} is a file; data.paths takes prefixes",
                              f"use {raw[:-4]} (without .bin/.idx)")
        bin_path, idx_path = f"{prefix}.bin", f"{prefix}.idx"
        if not os.path.exists(bin_path) and not os.path.exists(idx_path):
            raise ConfigError("data.paths", f"missing prefix {raw}: neither {bin_path} nor {idx_path} "
                              "exists", "build it with python -m recipes preprocess (make data for "
                              "data/stdlib_text_document), or fix the path (relative to the repository root)")
        for have, lacks in ((bin_path, idx_path), (idx_path, bin_path)):
            if not os.path.exists(lacks):
                raise ConfigError("data.paths", f"{have} has no {Path(lacks).suffix} file: {lacks} "
                                  "is missing", "copy both files of the dataset, or re-run recipes.data.preprocess")
        sequences, documents = read_index_header(idx_path)
        if sequences == 0 or os.path.getsize(bin_path) == 0:
            raise ConfigError("data.paths", f"{bin_path} is empty (0 documents, 0 tokens)",
                              "re-run recipes.data.preprocess on non-empty inputs, or drop the prefix")
        found_sizes = check_sizes(idx_path, bin_path)
        per_split = split_documents(sequences, fractions)
        for name, fraction, count in zip(("train", "validation", "test"), fractions, per_split):
            if fraction > 0 and count == 0:
                raise ConfigError("data.split", f"{raw} has {sequences} document(s): data.split="
                                  f"{data.split} leaves its {name} part empty (megatron cannot "
                                  "sample from it)", "add documents, or change the split (a single "
                                  "document needs \"data.split='100,0,0'\" and data.eval_interval=0)")
        meta = read_meta(prefix)
        if meta is not None:
            found, where = meta["tokenizer"], meta_path(prefix)
            known = [k for k in ("vocab_size", "eod") if declared and declared[k] is not None]
            if any(declared[k] != found.get(k) for k in known):  # the byte and null tokenizers, known here
                raise ConfigError("data.tokenizer", f"{data.tokenizer} has {declared['vocab_size']} "
                                  f"tokens (eod {declared['eod']}) but {where} says the data was made with "
                                  f"{found['name']} ({found['vocab_size']} tokens, eod {found.get('eod')})",
                                  "drop data.tokenizer (the sidecar is used), or give the tokenizer the data "
                                  "was made with")
            if not declared and tokenizer is not None and _identity(tokenizer) != _identity(found):
                raise ConfigError("data.paths", f"{where} was made with {found['name']} (vocab "
                                  f"{found['vocab_size']}), {source} with {tokenizer['name']} (vocab "
                                  f"{tokenizer['vocab_size']})", "blend only datasets made with one tokenizer")
            if not declared:
                tokenizer, source = found, where
        elif declared is None:
            raise ConfigError("data.tokenizer", f"{raw} has no {Path(meta_path(prefix)).name} "
                              "(written by recipes.data.preprocess), so its tokenizer is unknown",
                              "set data.tokenizer=byte or data.tokenizer=/path/to/tokenizer.json: "
                              "the tokenizer the data was made with")
        recorded = (meta or {}).get("max_token_id")
        if recorded is not None and meta.get("num_tokens") == found_sizes["num_tokens"]:
            top, where, whole = recorded, meta_path(prefix), True  # preprocess recorded it
        else:
            (top, whole), where = largest_token_id(bin_path, found_sizes["dtype"]), bin_path
        tops.append((top, where, whole))
        prefixes.append(prefix)
    if tokenizer["vocab_size"] is not None and tokenizer["vocab_size"] > model["vocab_size"]:
        raise ConfigError("model.vocab_size", f"{source}: the {tokenizer['name']} tokenizer has "
                          f"{tokenizer['vocab_size']} tokens but the model's vocabulary is "
                          f"{model['vocab_size']} (ids past it would index outside the embedding)",
                          f"set model.vocab_size={tokenizer['vocab_size']} or more, or use a smaller tokenizer")
    for top, where, whole in tops:  # the ids actually in the data (a sidecar or data.tokenizer can be wrong)
        if top >= model["vocab_size"]:
            raise ConfigError("model.vocab_size", f"{where}: the data holds token id {top}"
                              + ("" if whole else f" (in the first and last {SCAN_BYTES // 2**21} MiB of it)")
                              + f", past the model's vocabulary of {model['vocab_size']} (ids 0.."
                              f"{model['vocab_size'] - 1}): the embedding lookup would fail in the worker",
                              f"set model.vocab_size={top + 1} or more, or use data made with the model's tokenizer")
    return {"prefixes": prefixes, "weights": weights, "tokenizer": tokenizer, "tokenizer_source": source}


def _identity(tokenizer: dict) -> tuple:
    return tokenizer["name"], tokenizer["vocab_size"], tokenizer.get("sha256")


def validate_data(cfg: Any) -> None:
    """Controller-side refusal of bad ``data=indexed`` input (cheap: no megatron, no token reads), and of a
    vocabulary too small for ``data=mock``'s token ids (the embedding lookup would raise IndexError)."""
    cfg = typed(cfg)
    if cfg.data.name == "indexed":
        inspect_data(cfg)
        cache_dir = cfg.data.cache_dir  # megatron writes its index there: a file in the way stops the run
        if cache_dir and (problem := output_problem(resolve_prefix(cache_dir))):
            raise ConfigError("data.cache_dir", problem[1], "set data.cache_dir to a writable directory (null: "
                              "the per-user cache)")
    elif cfg.data.name == "mock" and cfg.model.vocab_size < ByteTokenizer.vocab_size:
        raise ConfigError("model.vocab_size", f"{cfg.model.vocab_size} is smaller than data=mock's "
                          f"{ByteTokenizer.vocab_size} token ids (bytes and the end-of-document id "
                          f"{ByteTokenizer.eod}); the embedding would index past its table",
                          f"set model.vocab_size>={ByteTokenizer.vocab_size}, e.g. model.vocab_size=512")


class DatasetTokenizer:
    """What ``GPTDataset`` needs of the tokenizer the data was made with: vocabulary size, eod, pad.

    ``pad`` is megatron's "no pad" id (-1): a pad id equal to eod (as ``ByteTokenizer`` has) would make
    ``GPTDataset`` zero every real end-of-document token; megatron notices and resets it with a warning.
    """

    pad = -1

    def __init__(self, info: dict):
        self.vocab_size = info["vocab_size"]
        self.eod = info["eod"] if info.get("eod") is not None else -1
        self.unique_identifiers = {"class": "DatasetTokenizer", "name": info["name"],
                                   "vocab_size": self.vocab_size, "sha256": info.get("sha256")}


def default_cache_dir() -> str:
    """Megatron's index cache when ``data.cache_dir`` is null: a per-user cache, keyed by megatron's
    hash of prefix, split, seed, sequence length and sample count, so runs share it safely."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "recompute-recipes", "megatron-indices")


def build_indexed_datasets(cfg: Any, num_samples: list[int]):
    """(train, valid, test) ``GPTDataset``/``BlendedDataset`` splits of ``data.paths`` (None where empty)."""
    cfg = typed(cfg)
    # lazy: megatron takes seconds to import; tools that never build a model skip it
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    found = inspect_data(cfg)
    tokenizer = DatasetTokenizer(check_tokenizer(cfg) or found["tokenizer"])
    config = gpt_dataset_config(cfg.train.seed, cfg.train.seq_length, tokenizer,
                                blend=(found["prefixes"], found["weights"]), split=cfg.data.split)
    cache_dir = cfg.data.cache_dir
    config.path_to_cache = resolve_prefix(cache_dir) if cache_dir else default_cache_dir()
    builder = BlendedMegatronDatasetBuilder(GPTDataset, num_samples, lambda: True, config)
    return builder.build()
