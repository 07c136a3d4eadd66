"""One megatron-core training run with a chosen activation-recompute policy (see README.md).

    python train.py model=moe recompute=selective/moe_act
    python train.py -m recompute=none,control,selective/core_attn attention=unfused
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


if __name__ == "__main__":
    main()
