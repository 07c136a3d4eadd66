"""The project's command line: ``python -m recipes <command> [args]``.

    python -m recipes estimate model=moe size=h200 --all      # predict memory per rank, no run
    python -m recipes advise multirun/moe/... --budget-gib 80 # the guide's choice for a budget
    python -m recipes report multirun/moe/...                 # table, CSV and plot of a sweep
    python -m recipes plan --budget-gib 70 model=mla size=h200_long  # recompute x offload x micro-batch
    python -m recipes calibrate --out h100.yaml               # measure this GPU into a hardware profile
    python -m recipes preprocess --stdlib --output-prefix data/stdlib --append-eod

Training itself is ``python train.py ...`` (Hydra).
"""

from __future__ import annotations

import importlib
import sys

#: command -> module whose ``main(argv)`` runs it
COMMANDS = {
    "estimate": "recipes.predict.estimate_command",
    "advise": "recipes.analyze.advise",
    "report": "recipes.analyze.report",
    "preprocess": "recipes.data.preprocess",
    "plan": "recipes.analyze.frontier",
    "calibrate": "recipes.measure.calibrate",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nerror: unknown command {argv[0]!r}; use one of {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        return 0
    module = importlib.import_module(COMMANDS[argv[0]])  # imported on demand: each pulls in its own stack
    sys.argv = [f"python -m recipes {argv[0]}"] + argv[1:]
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
