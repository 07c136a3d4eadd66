"""One megatron-core training run with a chosen activation-recompute policy (see README.md).

    python train.py model=moe recompute=selective/moe_act
    python train.py -m recompute=none,control,selective/core_attn attention=unfused

The exit code says what happened (docs/outputs.md): 0 ok, 1 failed, 2 refused (also an override
Hydra cannot compose: a typo'd key, an unknown option, a value of the wrong type), 3 out of memory (a
single run), 4 a sweep point another run was still running, 130 interrupted. A sweep exits after
its report is written.
"""

import os
import sys

import hydra
from omegaconf import DictConfig

from recipes.config import CONF_DIR, register_configs
from recipes.errors import ConfigError, from_hydra

register_configs()
#: Exceptions raised inside a run (a bug, a crash): they keep their traceback and exit 1.
RAISED_IN_RUN: list[BaseException] = []


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from recipes.run.controller import run

    try:
        run(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except BaseException as err:
        RAISED_IN_RUN.append(err)
        raise


def _controller():
    """The controller module if a run got that far (it is imported lazily: --help stays quick)."""
    return sys.modules.get("recipes.run.controller")


def _usage_error(err: BaseException) -> bool:
    """Whether Hydra raised ``err`` composing the config (not a run raising it): the user's input."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return isinstance(err, (HydraException, OmegaConfBaseException)) and err not in RAISED_IN_RUN


if __name__ == "__main__":
    # Hydra then raises its composition errors here instead of printing them and exiting 1: they are
    # the user's input, refused (exit 2) in one message that names the option and the fix
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        main()
    except KeyboardInterrupt:  # one line, not a traceback: completed points are on disk
        where = (_controller().CURRENT.get("run_dir") if _controller() else None) or "the run directory"
        print(f"\ninterrupted: the workers were stopped; completed results are kept ({where}); the same "
              "command resumes", file=sys.stderr)
        sys.exit(130)
    except Exception as err:
        if not _usage_error(err):
            raise
        print(f"error: {from_hydra(err, str(CONF_DIR))}", file=sys.stderr)
        sys.exit(2)
    sys.exit(_controller().exit_code() if _controller() else 0)
