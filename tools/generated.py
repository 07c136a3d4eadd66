"""What the doc generators share: a section between markers, rewritten or checked (make docs / check-data)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
END = "<!-- END GENERATED -->"


def replace_section(text: str, begin: str, body: str, doc: Path) -> str:
    """``text`` with everything between ``begin`` and ``END`` replaced by ``body`` (markers kept)."""
    head, sep, rest = text.partition(begin)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise SystemExit(f"{doc.relative_to(ROOT)} lacks the markers {begin} ... {END}")
    return f"{head}{begin}\n{body}\n{END}{tail}"


def main(doc: Path, render: Callable[[str], str], stale: str, fresh: str, wrote: str,
         argv: list[str] | None, description: str) -> int:
    """Rewrite ``doc`` with ``render``, or with ``--check`` exit 1 (printing ``stale``) when it differs."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help=f"exit 1 if {doc.relative_to(ROOT)} is out of date")
    args = parser.parse_args(argv)
    old = doc.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print(f"{doc.relative_to(ROOT)} {stale}", file=sys.stderr)
            return 1
        print(f"{doc.relative_to(ROOT)}: {fresh}")
        return 0
    doc.write_text(new)
    print(f"wrote {doc.relative_to(ROOT)}{wrote}")
    return 0
