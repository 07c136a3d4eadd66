"""Hydra's runtime as a run sees it: the config-group choices and overrides of this run, whether it is
a point of a multirun, and the sweep's points (what Hydra's basic sweeper makes of its multirun.yaml)."""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from recipes.files import REPO_ROOT


def hydra_choices() -> dict[str, str]:
    """The config-group choices of this run (model, recompute, ...), or {} outside Hydra."""
    # lazy: Hydra's runtime state, only inside a Hydra run
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    return {k: v for k, v in HydraConfig.get().runtime.choices.items() if not k.startswith("hydra")}


def hydra_overrides() -> list[str]:
    """This run's command-line overrides (a sweep point's own values), or [] outside Hydra: what a
    point's short directory name stands for, kept in its result and the sweep's manifest."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []

def in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def sweep_jobs(master: DictConfig) -> list[list[str]]:
    """The override lists of every job Hydra's basic sweeper makes of a multirun.yaml (sweep file
    params + command line), in order."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (master.hydra.sweeper.get("params") or {}).items()]
    overrides = OverridesParser.create().parse_overrides(params + list(master.hydra.overrides.task))
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


def num_sweep_points(master: DictConfig) -> int:
    """How many jobs Hydra's basic sweeper makes of a multirun.yaml."""
    return len(sweep_jobs(master))


def swept_recompute(plain: dict, master: DictConfig) -> list[dict]:
    """The recompute section of every point of a multirun (its multirun.yaml, ``master``), read from
    the sweep's ``recompute=`` and ``recompute.*`` overrides over this point's section."""
    sections = []
    for job in sweep_jobs(master):
        section = OmegaConf.create(plain["recompute"])
        for override in job:
            key, _, value = override.partition("=")
            if key == "recompute" and (REPO_ROOT / "conf" / "recompute" / f"{value}.yaml").exists():
                section = OmegaConf.merge(section, OmegaConf.load(REPO_ROOT / "conf" / "recompute" / f"{value}.yaml"))
            elif key.startswith("recompute."):
                section = OmegaConf.merge(section, OmegaConf.from_dotlist([override[len("recompute."):]]))
        sections.append(OmegaConf.to_container(section))
    return sections


def sweep_progress(name: str) -> str:
    """``[point i/N] name | elapsed | ETA`` for this sweep point. Elapsed counts from the sweep's
    start (Hydra writes multirun.yaml just before the first point); the ETA assumes the remaining
    points take the mean time of those done (skipped points are quick, so it errs low on resume)."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    i = int(hc.job.num)
    master = Path(hc.sweep.dir) / "multirun.yaml"
    try:
        n = num_sweep_points(OmegaConf.load(master))
        elapsed = time.time() - master.stat().st_mtime
    except Exception:  # another sweeper plugin, glob(): the point number alone still helps
        return f"[point {i + 1}] {name}"
    eta = _clock(elapsed / i * (n - i)) if i else "-"
    return f"[point {i + 1}/{n}] {name} | elapsed {_clock(elapsed)} | ETA {eta}"


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(max(0.0, seconds)), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"
