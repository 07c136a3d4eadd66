"""Give the committed GPU points short, stable directory names and write each sweep's manifest.

    python checks/rename_points.py                  # docs/h200: git mv every old-style point, write manifests
    python checks/rename_points.py --dry-run        # print what it would do, change nothing
    python checks/rename_points.py DIR --no-git     # a copy outside git: plain renames

A sweep directory (``docs/h200/<sweep>/``) holds one directory per point (``result.json``,
``config.yaml``). Hydra used to name a point by its override string (``/`` written ``.``, items
joined by ``__``): ``attention=unfused__model=mla__profile=none__recompute=control__size=h200__...``,
up to 166 characters. The naming rule is now ``recipes.config.slug`` of Hydra's
``override_dirname`` (the overrides joined by ``,``), at most ``MAX_DIRNAME`` (64) characters, so an
old directory's new name is ``slug(old_name.replace("__", ","))``. Points keep their files; only
their directory is renamed (``git mv``).

The override strings are then no longer readable from the tree, so each sweep directory gets a
``manifest.json``, one entry per point directory::

    {"<point dir>": {"overrides": ["model=mla", "recompute=selective/core_attn", "train.train_iters=6", ...],
                     "old_name": "<the directory's former name>",
                     "name": "<result.json's name>", "status": "<result.json's status>"}}

The overrides are recovered from the old name: a config group's value (a key without a dot that
is a folder of ``conf/``: ``recompute``, ``model``, ``attention``, ``size``, ``profile``...) gets its
``/`` back (``recompute=selective.core_attn`` -> ``recompute=selective/core_attn``); a dotted key
keeps its value as written. Each group override is checked against result.json's ``choices``.

Idempotent: a point listed in the manifest is known by its ``old_name``; it is renamed again only
when ``slug`` now names it differently (the rule changed), and its entry is rewritten from the old
name and result.json. So a second run changes nothing, and a sweep that gained old-style points (a
new GPU run copied in) gets only those renamed and added. A shortened name (``-`` and 8 hex digits)
missing from the manifest is refused: its overrides cannot be read back from it.
``manifest_problems`` is what ``checks/test_committed_data.py`` asserts on.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's recipes, not an installed copy

from recipes.config import MAX_DIRNAME, slug  # noqa: E402  (after the repo is on sys.path)

H200 = REPO / "docs" / "h200"
CONF = REPO / "conf"
MANIFEST = "manifest.json"
#: slug's ending for a name it shortened: ``-`` and 8 hex digits of the full overrides' SHA-1
HASHED = re.compile(r"-[0-9a-f]{8}$")


def is_group(key: str) -> bool:
    """A Hydra config group (a folder of conf/), whose choice may hold a ``/``."""
    return "." not in key and (CONF / key).is_dir()


def overrides_of(old_name: str) -> list[str]:
    """The override strings an old-style point directory name was made from, in its (Hydra's sorted) order."""
    if old_name == "defaults":  # slug's name for a point with no overrides
        return []
    out = []
    for item in old_name.split("__"):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{old_name!r}: {item!r} is not key=value")
        out.append(f"{key}={value.replace('.', '/')}" if is_group(key) else item)
    return out


def new_name(old_name: str) -> str:
    """The point's directory name under the current rule (``recipes.config.slug``)."""
    return slug(old_name.replace("__", ","))


def name_of(overrides: list[str]) -> str:
    """The directory Hydra names a point with these overrides: ``slug`` of its ``override_dirname``
    (the overrides sorted, joined by ``,``)."""
    return slug(",".join(sorted(overrides)))


def point_dirs(sweep: Path) -> list[Path]:
    """The point directories of a sweep (those holding a result.json)."""
    return sorted(p for p in sweep.iterdir() if (p / "result.json").is_file())


def sweep_dirs(root: Path) -> list[Path]:
    """The sweep directories under ``root`` (those with at least one point)."""
    return sorted(p for p in root.iterdir() if p.is_dir() and point_dirs(p))


def read_manifest(sweep: Path) -> dict:
    path = sweep / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {}


def entry(point: Path, old_name: str) -> dict:
    """A manifest entry for a point, its overrides checked against result.json's choices."""
    result = json.loads((point / "result.json").read_text())
    overrides = overrides_of(old_name)
    choices = result.get("choices") or {}
    for item in overrides:
        key, _, value = item.partition("=")
        if is_group(key) and key in choices and str(choices[key]) != value:
            raise ValueError(f"{point}: override {item} but result.json chose {key}={choices[key]}")
    return {"overrides": overrides, "old_name": old_name, "name": result.get("name"), "status": result.get("status")}


def rename_sweep(sweep: Path, git: bool = True, dry_run: bool = False) -> list[tuple[str, str]]:
    """Rename the sweep's old-style points and (re)write its manifest; the (old, new) renames."""
    manifest = read_manifest(sweep)
    renames = []
    for point in point_dirs(sweep):
        if point.name in manifest:  # renamed before: again only if the naming rule changed since
            old_name = manifest.pop(point.name)["old_name"]
        elif HASHED.search(point.name):
            raise ValueError(f"{point}: a shortened name not in {MANIFEST}; its overrides cannot be read back")
        else:
            old_name = point.name
        target = sweep / new_name(old_name)
        manifest[target.name] = entry(point, old_name)
        if target == point:
            continue
        if target.exists():
            raise FileExistsError(f"{point} -> {target}: the target exists")
        renames.append((point.name, target.name))
        if dry_run:
            continue
        if git:
            subprocess.run(["git", "mv", str(point.resolve()), str(target.resolve())], check=True, cwd=sweep.resolve())
        else:
            point.rename(target)
    text = json.dumps(dict(sorted(manifest.items())), indent=2) + "\n"
    path = sweep / MANIFEST
    if not dry_run and (not path.exists() or path.read_text() != text):
        path.write_text(text)
    return renames


def manifest_problems(sweep: Path) -> list[str]:
    """What is wrong with a sweep's names and manifest (empty when nothing is)."""
    problems = []
    manifest = read_manifest(sweep)
    if not manifest:
        return [f"{sweep.name}: no {MANIFEST}"]
    points = {p.name: p for p in point_dirs(sweep)}
    for name, point in points.items():
        if len(name) > MAX_DIRNAME:
            problems.append(f"{sweep.name}/{name}: {len(name)} characters (at most {MAX_DIRNAME})")
        record = manifest.get(name)
        if record is None:
            problems.append(f"{sweep.name}/{name}: not in {MANIFEST}")
            continue
        named_by = {name_of(record["overrides"])} | ({new_name(record["old_name"])} if "old_name" in record else set())
        for named in named_by:  # a point renamed from an old name, or one a sweep named itself
            if named != name:
                problems.append(f"{sweep.name}/{name}: recipes.config.slug names it {named}")
        result = json.loads((point / "result.json").read_text())
        for key in ("name", "status"):
            if record.get(key) != result.get(key):
                problems.append(f"{sweep.name}/{name}: {key} {record.get(key)!r} in {MANIFEST}, "
                                f"{result.get(key)!r} in result.json")
    for name in manifest:
        if name not in points:
            problems.append(f"{sweep.name}/{name}: in {MANIFEST} but no such point directory")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", type=Path, default=H200, help="folder of sweep directories (docs/h200)")
    parser.add_argument("--no-git", action="store_true", help="rename with the file system, not git mv")
    parser.add_argument("--dry-run", action="store_true", help="print the renames, change nothing")
    args = parser.parse_args(argv)
    total = 0
    for sweep in sweep_dirs(args.root):
        try:
            renames = rename_sweep(sweep, git=not args.no_git, dry_run=args.dry_run)
        except (ValueError, FileExistsError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        for old, new in renames:
            print(f"{sweep.name}/{old} -> {new}")
            total += 1
    problems = [] if args.dry_run else [p for s in sweep_dirs(args.root) for p in manifest_problems(s)]
    print(f"{total} point(s) renamed{' (dry run)' if args.dry_run else ''}; {len(problems)} problem(s)")
    for problem in problems:
        print(f"  {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
