"""Local text -> a megatron indexed dataset (``PREFIX_text_document.bin/.idx``) plus a metadata sidecar.

Megatron users keep corpora tokenized ahead of time; this writes the same format with megatron-core's
``IndexedDatasetBuilder``, tokenizing with megatron-core's tokenizers (``recipes.data.tokenizer``) from local
files only: bytes (the default, 257 ids with an end-of-document id 256, no extra package), a Hugging Face
``tokenizer.json`` or directory (needs ``transformers``), SentencePiece, tiktoken, or megatron's null tokenizer.
Inputs are text files (one document each), directories of them (recursively; empty and non-UTF-8 files
are skipped and counted), or JSONL files (``*.jsonl``: one document per line, text under ``--json-key``).
The output prefix follows Megatron-LM's ``tools/preprocess_data.py``: ``{output_prefix}_{json_key}_document``.
``PREFIX.meta.json`` records the tokenizer (kind, megatron library, vocabulary size, eod id, file hash) so
training can refuse a model whose vocabulary is too small, or a tokenizer that disagrees with the data, before
any compute (``recipes.data.indexed``).

    python -m recipes preprocess notes/ more.txt --output-prefix data/notes --append-eod
    python -m recipes preprocess --stdlib --output-prefix data/stdlib --append-eod     # `make data`
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import sysconfig
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy

from recipes.data.indexed import META_SUFFIX, write_meta
from recipes.data.tokenizer import EOD_CANDIDATES, SPECS, Tokenizer, load_tokenizer

#: The small real corpus (``--stdlib``): standard-library modules present as single files in Python
#: 3.12 and later (about 1.7 MB, 40 documents), text already on every machine that runs this repository.
STDLIB_MODULES = (
    "argparse ast base64 bisect calendar configparser contextlib copy csv dataclasses difflib enum "
    "fractions functools gettext heapq inspect ipaddress operator optparse pprint queue random shlex "
    "shutil statistics string textwrap threading tokenize traceback typing uuid warnings weakref "
    "json/__init__ json/decoder json/encoder logging/__init__ logging/handlers"
).split()


class PreprocessError(ValueError):
    """Bad input to preprocessing: the message names the file and the fix."""


def stdlib_files() -> list[Path]:
    """The ``STDLIB_MODULES`` files of the running Python (those that exist in this version)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / f"{m}.py" for m in STDLIB_MODULES if (root / f"{m}.py").is_file()]
    if not files:
        raise PreprocessError(f"none of the --stdlib modules were found under {root}")
    return files


def preprocess_tokenizer(spec: str, eod_token: str | None = None) -> Tokenizer:
    """``--tokenizer`` through megatron-core (``recipes.data.tokenizer``); a bad one is a ``PreprocessError``."""
    return load_tokenizer(spec, lambda what, fix: PreprocessError(f"--tokenizer {what} ({fix})"), eod_token)


def iter_documents(inputs: Sequence[str | Path], json_key: str, skipped: dict,
                   exclude: Sequence[str] = ()) -> Iterator[tuple[str, str]]:
    """(source, text) per document. A named empty file is an error; empty files in a directory are
    skipped (``skipped`` counts why), as are binary or non-UTF-8 files there, hidden files, the
    ``exclude`` paths (this run's own outputs) and empty JSONL records."""
    excluded = {Path(e).resolve() for e in exclude}
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.resolve() not in excluded
                           and not any(part.startswith(".") or part == "__pycache__"
                                       for part in p.relative_to(path).parts))
            for f in files:
                yield from _read_or_skip(f, json_key, skipped, named=False)
        elif path.is_file():
            yield from _read_or_skip(path, json_key, skipped, named=True)
        elif path.exists():  # /dev/zero, a FIFO, a socket: endless or blocking reads, not a document
            raise PreprocessError(f"input {path} is not a regular file (a device, pipe or socket): give text "
                                  "files, directories of them or *.jsonl files (save a stream to a file first)")
        else:
            raise PreprocessError(f"input {path}: no such file or directory (give text files, directories of "
                                  "them or *.jsonl files)")


def _read_or_skip(path: Path, json_key: str, skipped: dict, named: bool) -> Iterator[tuple[str, str]]:
    """``_read``; a file the OS will not read (permissions, an I/O error) is refused when named, else
    skipped and counted."""
    try:
        yield from _read(path, json_key, skipped, named)
    except OSError as err:
        if named:
            raise PreprocessError(f"input {path} cannot be read ({err.strerror or err}): check its permissions, "
                                  "or remove it from the inputs") from None
        skipped["unreadable files"] = skipped.get("unreadable files", 0) + 1


def _read(path: Path, json_key: str, skipped: dict, named: bool) -> Iterator[tuple[str, str]]:
    if path.stat().st_size == 0:
        if named:
            raise PreprocessError(f"input {path} is empty (0 bytes): remove it from the inputs")
        skipped["empty files"] = skipped.get("empty files", 0) + 1
        return
    if path.suffix == ".jsonl":
        yield from _read_jsonl(path, json_key, skipped)
        return
    try:
        text = path.read_text(encoding="utf-8")
        if "\x00" in text:
            raise UnicodeDecodeError("utf-8", b"", 0, 1, "NUL byte: binary")
    except UnicodeDecodeError:
        if named:
            raise PreprocessError(f"input {path} is not UTF-8 text (binary?): remove it from the inputs, or "
                                  "convert it to UTF-8 text (iconv -t UTF-8)") from None
        skipped["binary or non-UTF-8 files"] = skipped.get("binary or non-UTF-8 files", 0) + 1
        return
    yield str(path), text


def _read_jsonl(path: Path, json_key: str, skipped: dict) -> Iterator[tuple[str, str]]:
    """One document per line of a JSONL file: the ``json_key`` string of each JSON object."""
    with open(path, encoding="utf-8") as f:
        line_no = 0
        try:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise PreprocessError(f"{path}:{line_no}: not JSON ({err.msg}, column {err.colno}): one "
                                          "JSON object per line, or rename the file if it is not JSONL") from None
                text = record.get(json_key) if isinstance(record, dict) else None
                if not isinstance(record, dict) or json_key not in record:
                    raise PreprocessError(f"{path}:{line_no}: not a JSON object with a {json_key!r} string; "
                                          f"set --json-key to the field that holds the text")
                if not isinstance(text, str | None):
                    raise PreprocessError(f"{path}:{line_no}: field {json_key!r} holds {json.dumps(text)[:40]}, "
                                          "not a string: store the text as a string, or set --json-key to the "
                                          "field that holds it")
                if text:
                    yield f"{path}:{line_no}", text
                else:
                    skipped["empty records"] = skipped.get("empty records", 0) + 1
        except UnicodeDecodeError:
            raise PreprocessError(f"{path}:{line_no + 1}: not UTF-8 text (binary?): JSONL is UTF-8, one JSON "
                                  "object per line; remove the file from the inputs or convert it") from None


#: ``--json-key`` names the output files too (``{prefix}_{json_key}_document``): a plain field name only.
JSON_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def check_json_key(json_key: str) -> None:
    """Refuse a ``--json-key`` that would write outside the output prefix (``../x``, ``a/b``) or name
    a file badly: it becomes part of every output file's name."""
    if not json_key or not set(json_key) <= JSON_KEY_CHARS or json_key.startswith("."):
        raise PreprocessError(f"--json-key {json_key!r}: a field name of letters, digits, '_', '-' and '.' "
                              "(not first) only: it names the output files {output_prefix}_{json_key}_document.*, "
                              "which must stay beside --output-prefix; rename the field in the JSONL file "
                              "if it has other characters")


class Progress:
    """Documents/s and MB/s on stderr, at most once per ``interval`` seconds."""

    def __init__(self, interval: float = 2.0, stream=None) -> None:
        self.interval, self.stream = interval, stream or sys.stderr
        self.start = self.last = time.perf_counter()
        self.docs = self.bytes = self.tokens = 0

    def update(self, num_bytes: int, num_tokens: int) -> None:
        self.docs += 1
        self.bytes += num_bytes
        self.tokens += num_tokens
        now = time.perf_counter()
        if self.interval >= 0 and now - self.last >= self.interval:
            self.last = now
            self.report()

    def report(self, done: bool = False) -> None:
        secs = max(time.perf_counter() - self.start, 1e-9)
        print(f"[preprocess]{' done:' if done else ''} {self.docs:,} docs, {self.bytes / 1e6:,.1f} MB, "
              f"{self.tokens:,} tokens | {self.docs / secs:,.0f} docs/s, {self.bytes / 1e6 / secs:,.2f} MB/s",
              file=self.stream, flush=True)


def preprocess(inputs: Sequence[str | Path], output_prefix: str, tokenizer: str = "byte",
               append_eod: bool = False, json_key: str = "text", eod_token: str | None = None,
               progress_interval: float = 2.0) -> dict:
    """Tokenize ``inputs`` into ``{output_prefix}_{json_key}_document.{bin,idx}`` and its sidecar.

    Files are written under temporary names and renamed at the end, the sidecar last, so an
    interrupted run never leaves a dataset that validation would accept. Returns the sidecar dict.
    """
    # lazy: megatron takes seconds to import; tools that never build a model skip it
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    check_json_key(json_key)
    tok = preprocess_tokenizer(tokenizer, eod_token)
    if append_eod and tok.eod is None:
        raise PreprocessError(f"--append-eod: {tokenizer} has none of {', '.join(EOD_CANDIDATES)}; "
                              "name its end-of-document token with --eod-token")
    prefix = f"{output_prefix}_{json_key}_document"
    try:
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{prefix}.bin.tmp").touch()
    except OSError as err:
        why = err.strerror or str(err)
        blocker = next((p for p in Path(prefix).parents if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            why = f"{blocker} is a file, not a directory"
        raise PreprocessError(f"--output-prefix {output_prefix}: cannot write {prefix}.bin ({why}): "
                              "choose a prefix in a writable directory") from None
    dtype = DType.optimal_dtype(tok.vocab_size)
    bin_tmp, idx_tmp = f"{prefix}.bin.tmp", f"{prefix}.idx.tmp"
    builder = IndexedDatasetBuilder(bin_tmp, dtype=dtype)
    skipped: dict[str, int] = {}
    progress = Progress(progress_interval)
    max_id = -1
    try:
        outputs = [bin_tmp, idx_tmp, f"{prefix}.bin", f"{prefix}.idx", f"{prefix}{META_SUFFIX}"]
        for _, text in iter_documents(inputs, json_key, skipped, exclude=outputs):
            ids = tok.tokenize(text)
            if append_eod:
                ids = numpy.append(ids, tok.eod)
            if ids.size == 0:
                skipped["documents without tokens"] = skipped.get("documents without tokens", 0) + 1
                continue
            max_id = max(max_id, int(ids.max()))
            builder.add_document(ids, [ids.size])
            progress.update(len(text.encode("utf-8")), ids.size)
        builder.finalize(idx_tmp)
        if progress.docs == 0:
            raise PreprocessError(f"no documents in {', '.join(map(str, inputs))}"
                                  + (f" (skipped: {skipped})" if skipped else ""))
    except BaseException:
        builder.data_file.close()
        for tmp in (bin_tmp, idx_tmp):
            Path(tmp).unlink(missing_ok=True)
        raise
    os.replace(bin_tmp, f"{prefix}.bin")
    os.replace(idx_tmp, f"{prefix}.idx")
    progress.report(done=True)
    meta = {
        "format": "megatron-core indexed dataset, written by recipes.data.preprocess",
        "prefix": Path(prefix).name,
        "tokenizer": tok.info,
        "dtype": numpy.dtype(dtype).name,
        "append_eod": append_eod,
        "num_documents": progress.docs,
        "num_tokens": progress.tokens,
        "max_token_id": max_id,
        "num_bytes": progress.bytes,
        "inputs": [str(i) for i in inputs],
        "skipped": skipped,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_meta(prefix, meta)
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes preprocess", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="*", help="text files, directories of text files, *.jsonl files")
    parser.add_argument("--output-prefix", required=True,
                        help="writes OUTPUT_PREFIX_{json_key}_document.bin/.idx and .meta.json")
    parser.add_argument("--stdlib", action="store_true",
                        help=f"add {len(STDLIB_MODULES)} Python standard-library modules (no download)")
    parser.add_argument("--tokenizer", default="byte", help=f"{SPECS} (default byte; local files only)")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the eod id")
    parser.add_argument("--eod-token", default=None, help="the end-of-document token (default: the tokenizer's eos)")
    parser.add_argument("--json-key", default="text", help="text field of *.jsonl records (default: text)")
    parser.add_argument("--progress-interval", type=float, default=2.0,
                        help="seconds between progress lines on stderr (negative: quiet)")
    args = parser.parse_args(argv)
    if args.progress_interval != args.progress_interval:
        parser.error("--progress-interval must be a number of seconds (negative: quiet), got nan")
    # importing megatron.core says TE/Apex/absl are missing and CUDA is absent: true, and noise here
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|absl).*")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        inputs = list(args.inputs) + (stdlib_files() if args.stdlib else [])
        if not inputs:
            parser.error("give input files/directories, or --stdlib")
        meta = preprocess(inputs, args.output_prefix, args.tokenizer, args.append_eod, args.json_key,
                          args.eod_token, args.progress_interval)
    except PreprocessError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    prefix = f"{args.output_prefix}_{args.json_key}_document"
    print(f"wrote {prefix}.bin/.idx ({meta['num_documents']:,} documents, {meta['num_tokens']:,} tokens, "
          f"{meta['tokenizer']['name']} tokenizer, vocab {meta['tokenizer']['vocab_size']}) and {prefix}{META_SUFFIX}")
    if meta["skipped"]:
        print(f"skipped: {meta['skipped']}")
    print(f"train on it: python train.py data=indexed 'data.paths=[{prefix}]'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
