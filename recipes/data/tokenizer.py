"""Tokenizers through megatron-core's ``megatron.core.tokenizers``, from local files only.

One spec string names the kind and where it is (``--tokenizer`` of preprocessing, ``data.tokenizer`` of
training):

- ``byte`` (the default): UTF-8 bytes 0-255 and end-of-document 256, vocabulary 257 (megatron's
  ``byte-level`` library); needs nothing more.
- ``path/to/tokenizer.json``, a directory holding one, or ``huggingface:PATH_OR_NAME`` (a name only from
  the local Hugging Face cache): Hugging Face (``huggingface``); needs ``transformers``.
- ``path/to/tokenizer.model`` or ``sentencepiece:PATH``: SentencePiece; needs ``sentencepiece``.
- ``tiktoken:path/to/vocab.json``: tiktoken (megatron's JSON vocabulary: ``rank``, ``token_bytes``,
  ``token_str`` per token, after 1000 special ids; vocabulary megatron's 2**17, or the file's size plus
  1000 when smaller); needs ``tiktoken``.
- ``null:VOCAB``: megatron's null tokenizer (``null-text``): text is space-separated ids, eod ``VOCAB - 1``.

Nothing is downloaded: a missing file is refused, and a Hugging Face name is looked up in the local cache
only (``HF_HUB_OFFLINE``). Every refusal is the caller's error class (``PreprocessError``, ``ConfigError``)
naming the option and the fix.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy

#: Special tokens taken as end-of-document when the tokenizer names none (no eos) and no eod token is given.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
#: Our kind -> (megatron's library name, the package it needs or None).
KINDS = {"byte": ("byte-level", None), "huggingface": ("huggingface", "transformers"),
         "sentencepiece": ("sentencepiece", "sentencepiece"), "tiktoken": ("tiktoken", "tiktoken"),
         "null": ("null-text", None)}
#: The byte tokenizer's vocabulary and end-of-document id (what ``PREFIX.meta.json`` records for it).
BYTE_VOCAB, BYTE_EOD = 257, 256
#: megatron's tiktoken defaults: the largest vocabulary, and the special ids placed before the ranks.
TIKTOKEN_MAX_VOCAB, TIKTOKEN_SPECIAL = 2**17, 1000
SPECS = "byte, a tokenizer.json or Hugging Face directory, a SentencePiece .model, tiktoken:vocab.json or null:VOCAB"


def parse_spec(spec: str) -> tuple[str, str | None]:
    """(kind, location) of a tokenizer spec, without loading anything. A location is a path (``~``
    expanded), a Hugging Face name, or the null tokenizer's vocabulary size; it is not checked here."""
    spec = str(spec)
    if spec == "byte":
        return "byte", None
    kind, sep, rest = spec.partition(":")
    if sep and kind in KINDS and kind != "byte":
        return kind, rest if kind == "null" else os.path.expanduser(rest)
    path = os.path.expanduser(spec)
    if path.endswith(".model"):
        return "sentencepiece", path
    return "huggingface", path  # a tokenizer.json, a directory, or a name in the local cache


def check_spec(spec: str, fail: Callable[[str, str], Exception]) -> tuple[str, str | None]:
    """``parse_spec``, and the location exists here (a cheap check: no library). ``fail(what, fix)``
    makes the caller's error."""
    kind, where = parse_spec(spec)
    if kind == "null":
        if not (where or "").isdigit() or int(where) < 2:
            raise fail(f"{spec}: the null tokenizer needs its vocabulary size", "write null:VOCAB, e.g. null:32000")
        return kind, where
    if kind == "byte" or os.path.exists(where):
        return kind, where
    if kind == "huggingface" and _hub_name(where):
        return kind, where  # looked up in the local cache when loaded
    raise fail(f"{spec}: no such file or directory (tokenizers are read from local files, never downloaded)",
               f"give {SPECS}, as a path on this machine")


def _hub_name(text: str) -> bool:
    """A Hugging Face hub name (``org/name``) rather than a local path."""
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "~")) and not text.endswith(".json")


@contextmanager
def _offline():
    """Hugging Face's libraries use their local cache only while loading (no download)."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(dict.fromkeys(keys, "1"))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _sha256(where: str | None) -> str | None:
    """The hash of the tokenizer's file (a directory: its tokenizer.json), recorded with the data."""
    if not where:
        return None
    path = Path(where)
    if path.is_dir():
        path = path / "tokenizer.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


class Tokenizer:
    """A megatron-core tokenizer (``megatron``), with what preprocessing and training need of it: the
    vocabulary size, the end-of-document id, ``tokenize`` to a numpy array, and ``info`` (what
    ``PREFIX.meta.json`` records: ``name`` (the kind), ``library``, ``path``, ``sha256``, ``vocab_size``, ``eod``)."""

    def __init__(self, spec: str, megatron, kind: str, where: str | None, eod: int | None):
        self.spec, self.megatron, self.kind = spec, megatron, kind
        self.vocab_size, self.eod = int(megatron.vocab_size), eod
        path = None if kind in ("byte", "null") else (str(Path(where).resolve()) if os.path.exists(where) else where)
        self.info = {"name": kind, "library": KINDS[kind][0], "path": path, "sha256": _sha256(path),
                     "vocab_size": self.vocab_size, "eod": eod}

    def tokenize(self, text: str) -> numpy.ndarray:
        return numpy.asarray(self.megatron.tokenize(text), dtype=numpy.int64)


def load_tokenizer(spec: str, fail: Callable[[str, str], Exception], eod_token: str | None = None) -> Tokenizer:
    """The tokenizer ``spec`` names, built by ``megatron.core.tokenizers.MegatronTokenizer`` from local files.
    ``eod_token`` names the end-of-document token (default: the tokenizer's eos, else the first of
    ``EOD_CANDIDATES`` it has). ``fail(what, fix)`` makes the caller's error for anything that cannot load."""
    kind, where = check_spec(spec, fail)
    library, package = KINDS[kind]
    if package and importlib.util.find_spec(package) is None:
        raise fail(f"{spec}: the {kind} tokenizer needs the {package} package, which is not installed",
                   f"pip install {package} (or use byte)")
    # lazy: megatron takes seconds to import; the controller's checks never load a tokenizer
    from megatron.core.tokenizers import MegatronTokenizer

    load_from = where
    if kind == "huggingface" and os.path.isfile(where):  # AutoTokenizer reads a directory's tokenizer.json
        if Path(where).name != "tokenizer.json":
            raise fail(f"{spec}: a Hugging Face tokenizer file must be named tokenizer.json",
                       "rename it to tokenizer.json, or give the directory that holds it")
        load_from = str(Path(where).parent)
    kwargs: dict = {}
    if kind == "byte":
        kwargs = {"vocab_size": BYTE_VOCAB, "_eos_id": BYTE_EOD, "_pad_id": -1}
    elif kind == "null":
        kwargs = {"vocab_size": int(where)}
    elif kind == "tiktoken":  # megatron's default (2**17), or the whole vocabulary when smaller
        kwargs = {"vocab_size": min(TIKTOKEN_MAX_VOCAB, _num_ranks(where) + TIKTOKEN_SPECIAL)}
    elif kind == "huggingface":
        # no BOS added to every document; --eod-token is looked up, not passed: megatron would add a missing one
        kwargs = {"include_special_tokens": False}
    try:
        with _offline():
            tok = MegatronTokenizer.from_pretrained(tokenizer_path=None if kind in ("byte", "null") else load_from,
                                                    metadata_path={"library": library}, **kwargs)
    except Exception as err:
        hint = (" (not a local path, and not in the local Hugging Face cache)"
                if kind == "huggingface" and not os.path.exists(where) else "")
        raise fail(f"{spec}: megatron-core could not load it as a {kind} tokenizer{hint}: "
                   f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                   f"give {SPECS}; a Hugging Face model once downloaded elsewhere: its local directory") from None
    eod = _eod(tok, kind, eod_token)
    if eod_token and kind in ("byte", "null"):  # ignored by _eod: say so, not write another eod than asked
        raise fail(f"{spec}: --eod-token {eod_token!r}: the {kind} tokenizer names no tokens (its end-of-document "
                   f"is id {eod})", "drop --eod-token, or use a tokenizer with named tokens")
    if eod_token and eod is None:
        raise fail(f"{spec}: --eod-token {eod_token!r} is not one of its tokens", "name a token the tokenizer has")
    return Tokenizer(spec, tok, kind, where, eod)


def _num_ranks(path: str) -> int:
    """How many tokens a tiktoken vocabulary file holds (megatron's JSON list of ranks)."""
    import json

    try:
        return len(json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError):
        return TIKTOKEN_MAX_VOCAB  # megatron's loader says what is wrong with the file


def _eod(tok, kind: str, eod_token: str | None) -> int | None:
    """The end-of-document id: megatron's ``eod`` (the eos token), else a known end-of-text token."""
    if kind in ("byte", "null"):
        return int(tok.eod)
    inner = tok._tokenizer  # megatron's library object: token_to_id
    names = (eod_token,) if eod_token else ()
    if not eod_token:
        try:
            if tok.eod is not None and tok.eod >= 0:
                return int(tok.eod)
        except Exception:  # a tokenizer without an eos token
            pass
        names = EOD_CANDIDATES
    for name in names:
        try:
            found = inner.token_to_id(name)
        except Exception:
            continue
        if isinstance(found, int) and found >= 0 and (kind != "huggingface" or found != inner.tokenizer.unk_token_id):
            return found
    return None
