"""A checkpoint's manifest: every file's size and sha256, written last, checked before anything is read.

megatron's ``torch_dist`` format is read with pickle (torch's distributed-checkpoint reader unpickles
``.metadata``; ``common.pt`` and sharded objects go through ``torch.load``): loading a checkpoint runs
whatever its files tell the unpickler to. The manifest makes a checkpoint *this run saved* safe to load
after a crash, a full disk, a truncated copy or a file changed on its own: a file whose size or hash
differs, a file the manifest does not list, a link, or no manifest at all, and the checkpoint is not
loaded. It is no signature: whoever can write a checkpoint directory can write its manifest, so a
checkpoint is code, and only your own should be resumed.

    python -m recipes.run.manifest trust runs/x/checkpoints/step_00001000   # an older checkpoint of yours
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from recipes.files import read_json, write_json_atomic

MANIFEST = "manifest.json"
FORMAT = "recompute-recipes-manifest/1"
_CHUNK = 8 << 20


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def listed(directory: Path) -> tuple[list[str], list[str]]:
    """(regular files under ``directory`` but the manifest, relative and sorted; anything else found:
    links, devices, sockets). A link could point a reader anywhere, so it is never part of a checkpoint."""
    files, odd = [], []
    for p in sorted(Path(directory).rglob("*")):
        rel = p.relative_to(directory).as_posix()
        if p.is_symlink() or not (p.is_file() or p.is_dir()):
            odd.append(rel)
        elif p.is_file() and rel != MANIFEST:
            files.append(rel)
    return files, odd


def entries(directory: Path, names: list[str]) -> dict[str, dict]:
    """``{name: {"size", "sha256"}}`` of these files of ``directory``."""
    out = {}
    for name in names:
        path = Path(directory) / name
        out[name] = {"size": path.stat().st_size, "sha256": sha256(path)}
    return out


def write_manifest(directory: Path, files: dict[str, dict], step: int) -> None:
    """The manifest of ``files`` (``entries``), atomically: a checkpoint has one only once it is whole."""
    write_json_atomic(Path(directory) / MANIFEST, {"format": FORMAT, "step": step, "files": files})


def read_manifest(directory: Path) -> tuple[dict | None, str | None]:
    """(the manifest, None), or (None, why it is unusable)."""
    path = Path(directory) / MANIFEST
    if path.is_symlink() or not path.is_file():
        return None, f"no {MANIFEST} (a save that did not finish, or a checkpoint from before manifests)"
    try:
        manifest = read_json(path)
    except (OSError, ValueError) as err:
        return None, f"unreadable {MANIFEST} ({err})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        return None, f"{MANIFEST} is not a manifest of format {FORMAT}"
    return manifest, None


def problems(directory: Path, deep: bool = True, share: tuple[int, int] = (0, 1)) -> list[str]:
    """Why ``directory`` must not be loaded (empty: it may). Sizes and the file list always; with
    ``deep`` the sha256 of this caller's ``share`` (index, count) of the files, so several ranks
    hash a checkpoint together. Reads no file but the manifest (JSON) and the bytes it hashes."""
    directory = Path(directory)
    if not directory.is_dir():
        return [f"{directory} is not a directory"]
    manifest, why = read_manifest(directory)
    if manifest is None:
        return [why]
    files, odd = listed(directory)
    out = [f"{name}: not a regular file" for name in odd]
    expected = manifest["files"]
    out += [f"{name}: missing" for name in sorted(set(expected) - set(files))]
    out += [f"{name}: not in the manifest" for name in sorted(set(files) - set(expected))]
    index, count = share
    for i, name in enumerate(sorted(set(files) & set(expected))):
        want, path = expected[name], directory / name
        size = path.stat().st_size
        if size != want.get("size"):
            out.append(f"{name}: {size} bytes, the manifest says {want.get('size')} (truncated or changed)")
        elif deep and i % count == index and sha256(path) != want.get("sha256"):
            out.append(f"{name}: its sha256 differs from the manifest's (changed after the save)")
    return out


def trust(directory: Path) -> Path:
    """Write the manifest of a checkpoint as it is now: for your own checkpoints saved before manifests.
    Whatever the directory holds is then loadable: only run it on a checkpoint you saved yourself."""
    directory = Path(directory)
    meta = read_json(directory / "meta.json") if (directory / "meta.json").is_file() else {}
    files, odd = listed(directory)
    if odd:
        raise SystemExit(f"{directory}: holds links or special files ({', '.join(odd)}); not trusted")
    write_manifest(directory, entries(directory, files), int(meta.get("step", -1)))
    return directory / MANIFEST


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "trust":
        raise SystemExit("usage: python -m recipes.run.manifest trust <checkpoint dir>...")
    for arg in sys.argv[2:]:
        print(f"wrote {trust(Path(arg))}")
