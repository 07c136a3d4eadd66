"""What a sweep is checked for before any of its points runs or is submitted: the Hydra callback
(``conf/config.yaml``: ``hydra.callbacks.launch_check``). A Slurm submission is checked on the
submitting machine (``launch.slurm``: the cluster and the job's shape) and each of its points as the
controller checks a local one, so a refusal costs no queue time.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf, open_dict

from launch.slurm import (
    check_output_dir,
    check_recipe_submission,
    check_submission,
    describe_torchrun,
    sbatch_preview,
    sweep_point_overrides,
)
from recipes.errors import ConfigError
from recipes.recipe import apply_recipe
from recipes.run.controller import check_point


def check_points(config: Any, slurm: bool = True) -> None:
    """Every point of a sweep passes the checks the controller runs before a launch
    (``recipes.run.controller.check_point``), here, before any point runs or is submitted: a refusal costs
    no queue time and no finished point. ``slurm``: the job's machine has ``launcher.nproc_per_node``
    GPUs, and activation offload's host copies are checked against the memory the job asks for per node
    (``hydra.launcher.mem_gb``) or ``offload.host_memory_gib``: this machine is not the node. Locally:
    this machine's GPUs, cores and memory, and where each point writes."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from launch.affinity import usable_cores
    from recipes.errors import from_hydra
    from recipes.files import CONF_DIR
    from recipes.validate.parallel import validate_cores

    loader = GlobalHydra.instance().config_loader()
    nothing = "nothing was submitted" if slurm else "no point was run"
    for overrides in sweep_point_overrides(config):
        where = f"sweep point {' '.join(overrides) or 'defaults'}; {nothing}"
        try:
            point = loader.load_sweep_config(config, overrides)
        except (HydraException, OmegaConfBaseException) as err:  # a typo in one point's value
            refusal = from_hydra(err, str(CONF_DIR))
            raise ConfigError(refusal.option, f"{refusal.problem} ({where})", refusal.fix) from err
        with open_dict(point):
            del point["hydra"]
        plain = OmegaConf.to_container(point, resolve=True)
        try:
            if slurm:
                if plain.get("recipe"):  # its published layout, as the controller will run it
                    plain, _ = apply_recipe(plain, on_gpu=True)
                check_point(plain, num_gpus=max(1, plain["launcher"]["nproc_per_node"]),
                            job_memory_gib=config.hydra.launcher.get("mem_gb"), submitting=True)
            else:
                plain, _ = apply_recipe(plain, overrides=overrides)
                check_point(plain)
                validate_cores(plain, usable_cores())
        except ConfigError as err:
            raise ConfigError(err.option, f"{err.problem} ({where})", err.fix) from err


class LaunchCheck(Callback):
    """Hydra callback (conf/config.yaml): checks a sweep before any point runs (``output_dir``), and a
    Slurm submission on the submitting machine (every point validated as the local path does)."""

    def __init__(self) -> None:
        self.registers_resolvers = True  # a non-empty state, so unpickling calls __setstate__

    def on_run_start(self, config, **kwargs) -> None:
        if str(config.hydra.launcher.get("_target_", "")).endswith("SlurmLauncher"):
            _refuse(ConfigError("hydra/launcher=submitit_slurm", "Hydra launchers only start -m sweeps: "
                                "this single run would run here, not on Slurm", "add -m (a sweep of "
                                "one point is one Slurm job)"))

    def on_multirun_start(self, config, **kwargs) -> None:
        try:
            check_output_dir(config)
            check_submission(config)
            recipe_note = check_recipe_submission(config)
            check_sweep_dir(config)
            check_points(config, slurm=str(config.hydra.launcher.get("_target_", "")).endswith("SlurmLauncher"))
        except ConfigError as err:
            _refuse(err)
        if config.get("dry_run") and str(config.hydra.launcher.get("_target_", "")).endswith("SlurmLauncher"):
            hl = OmegaConf.to_container(config.hydra.launcher, resolve=True)
            script = sbatch_preview(hl)
            path = Path(str(config.hydra.sweep.dir)) / "slurm_dry_run.sbatch"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(script)
            launcher = OmegaConf.to_container(config.launcher, resolve=True)
            if recipe_note:
                print(f"[dry-run] {recipe_note}")
            print(f"[dry-run] sbatch script for each sweep point: {path}\n{script}\n"
                  f"[dry-run] each node's controller then runs:\n  {describe_torchrun(launcher)}")
            sys.exit(0)  # nothing submitted

    def __setstate__(self, state: dict) -> None:
        """Unpickled inside a Slurm job (submitit carries Hydra's callbacks there): register this
        project's OmegaConf resolvers, which train.py registers at import in the submitting process."""
        self.__dict__.update(state)
        from recipes.config import register_configs

        register_configs()


def check_sweep_dir(config: Any) -> None:
    """The sweep's directory can be written (not a file, not read-only), before any point runs."""
    from recipes.validate.run import output_problem

    if problem := output_problem(str(config.hydra.sweep.dir)):
        raise ConfigError("hydra.sweep.dir", problem[1], "set hydra.sweep.dir to a writable directory")


def _refuse(err: ConfigError) -> None:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
