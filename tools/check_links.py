"""Every reference in README.md and docs/*.md resolves inside the repository.

Checked in every file:
- markdown link targets: the file exists, and a ``#anchor`` is one of the target's headings;
- paths into the repository's folders (``recipes/run/controller.py``, ``docs/evidence/h200.md``), in
  backticks or not, and a name after a Python path (``recipes/run/window.py: control_ledgers``) is
  defined in that file;
- dotted module names (``recipes.predict.estimate``, ``recipes.build.gdn.check_fla_kernels``): the
  module exists and a trailing name is defined in it;
- ``make <target>``: the Makefile has that target;
- no markdown table cell is longer than ``MAX_CELL`` characters (a long cell is a paragraph in a table:
  say it under the table instead).

And in the README: every documented Makefile target is mentioned, and the config-group table lists
exactly the options under ``conf/<group>/`` (a group's options may be split over several rows that
start with the same group). Placeholders (``docs/evidence/<name>.md``, ``*.log``) are
skipped. Exit status 1 lists each problem as ``file:line: what``.

    python tools/check_links.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: top-level folders whose paths the docs mention
FOLDERS = ("recipes", "docs", "benchmarks", "tests", "conf", "tools", "launch", "checks", ".ci")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w./-])((?:{})/[\w./-]*)(:{{1,2}} ?\w+|.?)".format("|".join(re.escape(f) for f in FOLDERS)))
MODULE = re.compile(r"(?<![\w./-])recipes(?:\.[A-Za-z_]\w*)+")
MAKE = re.compile(r"(?:^|`)make ([a-z][\w-]*)")  # a command: in backticks or starting a code line
PLACEHOLDER = set("<{*[$")
#: the longest markdown table cell the docs allow
MAX_CELL = 200
#: targets the README need not mention
UNLISTED_TARGETS = {"help", "install", "clean"}


def docs() -> list[Path]:
    """The files checked: the README and the top-level docs."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors(md: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file."""
    out = set()
    for line in md.read_text().splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            out.add(text.replace(" ", "-"))
    return out


def link_ok(md: Path, target: str) -> bool:
    """A relative link target: the file exists, and its anchor is one of its headings."""
    if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
        return True
    path, _, anchor = target.partition("#")
    dest = (md.parent / path).resolve() if path else md
    if not dest.exists():
        return False
    return not anchor or dest.suffix != ".md" or anchor in anchors(dest)


def defines(source: Path, name: str) -> bool:
    """Whether a Python file defines ``name`` (a function, a class, or an assignment), at any depth."""
    name = re.escape(name)
    pattern = rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]"
    return bool(re.search(pattern, source.read_text(), re.M))


def path_problem(path: str, after: str) -> str | None:
    """What is wrong with a repository path as written in prose, or None."""
    if after[:1] in PLACEHOLDER or path.endswith("..."):
        return None
    folder, _, rest = path.partition("/")
    if 0 < len(rest) < 2:  # "docs/s" in "7,890 docs/s": a unit, not a path
        return None
    path = path.rstrip(".,")  # a full stop or comma after a path is punctuation
    if not (ROOT / path).exists():
        return f"path {path}"
    name = after.lstrip(": ")
    if path.endswith(".py") and after.startswith(":") and name and not defines(ROOT / path, name):
        return f"name {path}: {name}"
    return None


def module_ok(name: str) -> bool:
    """``recipes.a.b[.attr]``: the longest module prefix exists and the next name is defined in it."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        source = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if source.exists():
            return n == len(parts) or defines(source, parts[n])
    return False


def make_targets() -> dict[str, bool]:
    """The Makefile's targets, each with whether it is documented (``## `` after it, shown by make help)."""
    targets = {}
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([a-z][\w-]*):(?!=)", line)
        if m:
            targets[m.group(1)] = "## " in line
    return targets


def table_cells(line: str) -> list[str]:
    """The cells of a markdown table row (``|`` inside backticks or escaped does not split)."""
    cells, cell, code, i = [], "", False, 0
    text = line.strip().strip("|")
    while i < len(text):
        char = text[i]
        if char == "\\" and text[i + 1 : i + 2] == "|":
            cell, i = cell + "\\|", i + 2
            continue
        code ^= char == "`"
        if char == "|" and not code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += char
        i += 1
    return [*cells, cell.strip()]


def problems(md: Path, targets: dict[str, bool]) -> list[str]:
    """Broken references in one markdown file, and table cells over ``MAX_CELL`` characters."""
    out = []
    rel = md.relative_to(ROOT)
    fenced = False
    for number, line in enumerate(md.read_text().splitlines(), 1):
        fenced ^= line.lstrip().startswith("```")
        if not fenced and line.lstrip().startswith("|"):
            out += [f"{rel}:{number}: a table cell of {len(c)} characters (at most {MAX_CELL})"
                    for c in table_cells(line) if len(c) > MAX_CELL]
        for target in LINK.findall(line):
            if not link_ok(md, target):
                out.append(f"{rel}:{number}: link {target}")
        for path, after in PATH.findall(line):
            if problem := path_problem(path, after):
                out.append(f"{rel}:{number}: {problem}")
        for name in MODULE.findall(line):
            if name.endswith(".md"):  # a page (recipes.md), not a module
                continue
            if not module_ok(name):
                out.append(f"{rel}:{number}: module {name}")
        for target in MAKE.findall(line):
            if target not in targets:
                out.append(f"{rel}:{number}: make {target} (no such Makefile target)")
    return out


def conf_options(group: str) -> set[str]:
    """The options of a config group: its YAML files, with sub-folders (``selective/core_attn``)."""
    folder = ROOT / "conf" / group
    return {str(p.relative_to(folder).with_suffix("")) for p in folder.rglob("*.yaml")}


def readme_problems(targets: dict[str, bool]) -> list[str]:
    """The README against the Makefile (every documented target) and conf/ (the config-group table)."""
    text = (ROOT / "README.md").read_text()
    out = [
        f"README.md: make {t} is a documented target but the README does not mention it"
        for t, documented in targets.items()
        if documented and t not in UNLISTED_TARGETS and not re.search(rf"\bmake {re.escape(t)}\b", text)
    ]
    rows: dict[str, str] = {}  # a group may take several rows (a long option list split to keep cells short)
    for m in re.finditer(r"^\| `(\w+)` \| ([^|]*) \|", text, re.M):
        rows[m.group(1)] = rows.get(m.group(1), "") + " " + m.group(2)
    groups = sorted(p.name for p in (ROOT / "conf").iterdir() if p.is_dir())
    for group in groups:
        if group not in rows:
            out.append(f"README.md: config group {group} is missing from the config-group table")
            continue
        listed = set(re.findall(r"`([^`]+)`", rows[group]))
        actual = conf_options(group)
        for option in sorted(actual - listed):
            out.append(f"README.md: {group}={option} (conf/{group}/{option}.yaml) is missing from the table")
        for option in sorted(listed - actual):
            out.append(f"README.md: {group}={option} is in the table but not in conf/{group}/")
    return out


def main() -> int:
    targets = make_targets()
    found = [p for md in docs() for p in problems(md, targets)] + readme_problems(targets)
    for p in found:
        print(p)
    if found:
        print(f"{len(found)} broken reference(s)")
        return 1
    print(f"references: {len(docs())} files, every reference resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
