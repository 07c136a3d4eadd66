"""One megatron-core training run with a chosen activation-recompute policy (see README.md).

    python train.py model=moe recompute=selective/moe_act
    python train.py -m recompute=none,control,selective/core_attn attention=unfused

The exit code says what happened (docs/outputs.md): 0 ok, 1 failed, 2 refused, 3 out of memory (a
single run), 4 a sweep point another run was still running, 130 interrupted. A sweep exits after
its report is written.
"""

import sys

import hydra
from omegaconf import DictConfig

from recipes.config import register_configs
from recipes.errors import ConfigError

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from recipes.run.controller import run

    try:
        run(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def _controller():
    """The controller module if a run got that far (it is imported lazily: --help stays quick)."""
    return sys.modules.get("recipes.run.controller")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # one line, not a traceback: completed points are on disk
        where = (_controller().CURRENT.get("run_dir") if _controller() else None) or "the run directory"
        print(f"\ninterrupted: the workers were stopped; completed results are kept ({where}); the same "
              "command resumes", file=sys.stderr)
        sys.exit(130)
    sys.exit(_controller().exit_code() if _controller() else 0)
