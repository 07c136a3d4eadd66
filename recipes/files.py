"""Paths, units and JSON files shared by every part of the package (a leaf: imports nothing of ours)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

#: The repository root (``conf/``, ``train.py``) and the Hydra config directory.
REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"
GIB = 1024**3
MIB = 1024**2
#: A run's progress rows, one JSON object per logged step (rank 0; written by recipes.run.progress,
#: read by recipes.analyze.logger and benchmarks/plot_long_run.py).
PROGRESS_FILE = "progress.jsonl"


class UnreadableFile(ValueError):
    """A JSON file that exists but cannot be parsed (truncated by a kill, edited by hand)."""

    def __init__(self, path: Path, err: Exception):
        self.path = Path(path)
        super().__init__(f"{path}: unreadable JSON ({type(err).__name__}: {err})")


def _new_file(directory: Path, name: str) -> tuple[int, Path]:
    """A new, unique file in ``directory`` open for writing, created with mode 0666 less the process's
    umask (the kernel applies it, as to a plain ``open``): no umask change, which would be seen by every
    thread of the process."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = directory / f".{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name for {directory / name}")


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to a temp file in the same directory, fsync, then rename over ``path``.

    The file gets the permissions a plain ``open`` would (0666 less the umask): mkstemp's 0600 would
    hide results from the rest of a group on a shared cluster file system."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_file(path.parent, path.name)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_or_fallback(path: Path, data: Any, fallback: Any) -> OSError | None:
    """``write_json_atomic(path, data)``; if that fails (a full disk, a read-only or vanished directory),
    try the small ``fallback`` record at the same path and return the first error (None: all written).
    The caller says what was kept: the error names the path."""
    try:
        write_json_atomic(path, data)
        return None
    except OSError as err:
        with contextlib.suppress(OSError):
            write_json_atomic(path, fallback)
        return err


def read_json(path: Path) -> Any:
    """A JSON file's content; a corrupt file raises ``UnreadableFile`` naming the path."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UnreadableFile(path, err) from err
