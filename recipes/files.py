"""Paths, units and JSON files shared by every part of the package (a leaf: imports nothing of ours)."""

from __future__ import annotations

import json
import os
import tempfile
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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to a temp file in the same directory, fsync, then rename over ``path``.

    The file gets the permissions a plain ``open`` would (0666 less the umask): mkstemp's 0600 would
    hide results from the rest of a group on a shared cluster file system."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> Any:
    """A JSON file's content; a corrupt file raises ``UnreadableFile`` naming the path."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UnreadableFile(path, err) from err
