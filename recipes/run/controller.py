"""The controller: compose once, validate, freeze the config, start the workers, record the result.

``train.py`` calls ``run(cfg)`` inside ``@hydra.main``. Workers are a fresh process group per run
(per sweep point), so CUDA memory and NCCL state start clean and memory comparisons are fair.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from launch.slurm import node_rank, slurm_rendezvous, wait_for_rank_files
from launch.torchrun import free_port, torchrun_command
from recipes.analyze.logger import log_run
from recipes.data.indexed import validate_data
from recipes.errors import ConfigError
from recipes.files import REPO_ROOT, write_json_atomic
from recipes.measure.profile import write_timeline_pngs
from recipes.recipe import apply_recipe
from recipes.recompute import option_of
from recipes.results import NOT_MEASURED, load_result, merge_result
from recipes.run.console import print_run
from recipes.validate import validate

#: Statuses that count as a complete result (a sweep re-run skips them unless rerun=true).
COMPLETE = ("ok", "oom")


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


def run_directory(cfg: DictConfig) -> Path:
    """Where this run writes: ``output_dir``, else Hydra's run or sweep-point directory."""
    if cfg.output_dir:
        return Path(cfg.output_dir)
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def run_name(cfg: DictConfig, choices: dict[str, str]) -> str:
    """``model attention recompute`` unless the user named the run; the recompute part says what the
    values recompute (recipes.validate.recompute_option), whatever option they were composed from."""
    if cfg.name:
        return cfg.name
    parts = [choices.get("model", cfg.model.family), choices.get("attention", cfg.attention.backend),
             option_of(cfg)]
    return " ".join(str(p) for p in parts)


def worker_command(cfg: dict, run_dir: Path) -> list[str]:
    """torchrun for several processes; a single process is started directly (same environment)."""
    launch = cfg["launcher"]
    if launch["nproc_per_node"] * launch["nnodes"] == 1:
        return [sys.executable, "-m", "recipes.run.worker", str(run_dir)]
    program = ["-m", "recipes.run.worker", str(run_dir)]
    if launch["name"] == "slurm":  # this node's torchrun; every node of the Slurm job starts one
        return torchrun_command(launch, program, slurm_rendezvous(launch))
    return torchrun_command(launch, program)


def worker_environment(cfg: dict) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron's TP/SP comm ordering
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg["launcher"]["nproc_per_node"])))
    if cfg["measure"]["expandable_segments"]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if env.get("RANK") is None and cfg["launcher"]["nproc_per_node"] * cfg["launcher"]["nnodes"] == 1:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return env



def in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def changed_keys(stored: dict | None, current: dict) -> list[str]:
    """Top-level config sections that differ between a stored result and this run (resume check)."""
    stored = stored or {}
    keys = (set(stored) | set(current)) - set(NOT_MEASURED)
    return sorted(k for k in keys if stored.get(k) != current.get(k))


def num_sweep_points(master: DictConfig) -> int:
    """How many jobs Hydra's basic sweeper makes of a multirun.yaml (sweep file params + command line)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (master.hydra.sweeper.get("params") or {}).items()]
    overrides = OverridesParser.create().parse_overrides(params + list(master.hydra.overrides.task))
    return sum(len(batch) for batch in BasicSweeper.split_arguments(overrides, None))


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


def run(cfg: DictConfig) -> dict:
    """One run (one sweep point): validate, write config, launch, merge, report, log.

    A refused configuration raises ``ConfigError`` for a single run; in a sweep it is recorded as a
    ``refused`` point and the sweep goes on.
    """
    choices = hydra_choices()
    plain, recipe_notes = apply_recipe(OmegaConf.to_container(cfg, resolve=True))  # recipe=: depth, layout
    for note in recipe_notes:
        print(f"[recipe] {note}", flush=True)
    run_dir = run_directory(cfg)
    name = run_name(cfg, choices)
    if in_multirun():
        print(sweep_progress(name), flush=True)
    try:
        validate(plain)  # before any worker starts
        validate_data(plain)  # files, .idx header, tokenizer sidecar (cheap)
    except ConfigError as err:
        if not in_multirun():
            raise
        result = {"schema_version": 1, "name": name, "choices": choices, "overrides": hydra_overrides(),
                  "run_dir": str(run_dir),
                  "status": "refused", "error": str(err), "config": plain, "ranks": []}
        write_json_atomic(run_dir / "result.json", result)
        print_run(result)
        return result
    existing = run_dir / "result.json"
    if existing.exists() and not cfg.rerun:
        previous = load_result(existing)
        changed = changed_keys(previous.get("config"), plain)
        if previous.get("status") in COMPLETE and not changed:
            print(f"[skip] {name}: complete result in {run_dir} (rerun=true to run again)")
            return previous
        if previous.get("status") in COMPLETE:
            print(f"[rerun] {name}: the stored result was measured with other {', '.join(changed)}")
    node = node_rank(plain["launcher"])  # launcher=slurm: every node launches, node 0 records
    run_dir.mkdir(parents=True, exist_ok=True)
    if node == 0:
        OmegaConf.save(OmegaConf.create(plain), run_dir / "config.yaml")
    if cfg.dry_run:
        print(f"[dry-run] {name}: config written to {run_dir / 'config.yaml'}")
        return {"status": "dry_run", "name": name, "run_dir": str(run_dir)}
    for stale in (run_dir / "ranks").glob("rank*.json") if node == 0 else ():
        stale.unlink()
    start = time.time()  # the workers' timelines are relative to this launch time
    log_path = run_dir / ("worker.log" if node == 0 else f"worker.node{node}.log")
    command = worker_command(plain, run_dir)
    with open(log_path, "w") as log:
        proc = subprocess.run(command, env=worker_environment(plain),
                              stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    if node:
        print(f"[node {node}] {name}: workers exited with code {proc.returncode}; node 0 records {run_dir}")
        return {"status": "node", "node_rank": node, "name": name, "run_dir": str(run_dir)}
    launch_error = None
    if proc.returncode:
        launch_error = f"workers exited with code {proc.returncode}; see {log_path}"
    meta = {
        "name": name,
        "choices": choices,
        "overrides": hydra_overrides(),
        "run_dir": str(run_dir),
        "wall_s": time.time() - start,
        "launched": start,
        "launch_command": " ".join(command),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": plain,
    }
    world = plain["launcher"]["nproc_per_node"] * plain["launcher"]["nnodes"]
    if plain["launcher"]["nnodes"] > 1:  # the other nodes' rank files, over a shared file system
        wait_for_rank_files(run_dir, world)
    result = merge_result(run_dir, meta, world, launch_error)
    write_timeline_pngs(result, run_dir)
    if result["status"] == "failed" and not result.get("ranks"):
        result["log_tail"] = log_path.read_text()[-4000:]
    write_json_atomic(run_dir / "result.json", result)
    print_run(result)
    log_run(plain, result)
    return result
