"""Slurm: one job per sweep point through Hydra's submitit launcher, torchrun on every node inside it.

    python train.py -m launcher=slurm hydra.launcher.partition=gpu hydra.launcher.cpus_per_task=64 \\
        launcher.nnodes=2 launcher.nproc_per_node=8 parallel=tp2_pp2 recompute=none,full

How the pieces fit (conf/launcher/slurm.yaml sets them up):

1. On the login node, Hydra's ``submitit_slurm`` launcher writes one sbatch array (one element per
   sweep point) and submits it. ``recipes.run.submission.LaunchCheck`` runs first and refuses what cannot
   work there (no ``sbatch``, an unknown partition, nodes < 1, a node count that disagrees with
   ``launcher.nnodes``), before anything is submitted. With ``dry_run=true`` it writes the sbatch
   script that would be submitted and stops (no ``sbatch`` needed).
2. In each job, srun starts one task per node (``hydra.launcher.tasks_per_node=1``); each task runs
   the controller (``recipes.run.controller.run``), which starts *its node's* torchrun:
   ``--nnodes=$SLURM_NNODES --node-rank=$SLURM_NODEID --master-addr=<first node>``
   (``slurm_rendezvous``). So there is no srun inside srun, and the nodes meet in torchrun's static
   rendezvous on the first node, at a port derived from the job id.
3. Only node 0's controller writes the config, merges ``ranks/rank*.json`` (after waiting for the
   other nodes' files on the shared file system) and logs; the others return once their workers exit.

The same controller path runs inside an allocation you made yourself (``output_dir`` on a shared
file system, the same for every node: Hydra's default run directory carries each node's clock):
``salloc -N 2 --gpus-per-node=8 --cpus-per-task=64``, then ``srun --ntasks-per-node=1 python train.py
launcher=slurm launcher.nnodes=2 launcher.nproc_per_node=8 hydra/launcher=basic output_dir=<dir> ...``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from launch.torchrun import Rendezvous
from recipes.errors import ConfigError

#: The submitit plugin's Slurm launcher class (hydra/launcher=submitit_slurm).
SLURM_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list (``gpu[01-03,07],login2``) as host names, in order."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        match = re.match(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not match:
            hosts.append(item)
            continue
        prefix, ranges, rest = match.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts += [f"{prefix}{n:0{len(lo)}d}{tail}" for tail in expand_nodelist(rest) or [""]]
    return hosts


def node_rank(launcher: Mapping[str, Any], env: Mapping[str, str] = os.environ) -> int:
    """This node's rank in a ``launcher=slurm`` run (0 otherwise). Only node 0 records the run."""
    if launcher["name"] != "slurm":
        return 0
    return int(env.get("SLURM_NODEID", "0"))


def slurm_rendezvous(launcher: Mapping[str, Any], env: Mapping[str, str] = os.environ) -> Rendezvous:
    """Where this Slurm job's nodes meet, from srun's environment; refused outside a fitting job."""
    job = env.get("SLURM_JOB_ID")
    if job is None:
        raise ConfigError("launcher=slurm", "not inside a Slurm job (SLURM_JOB_ID is unset)",
                          "submit it: python train.py -m launcher=slurm hydra.launcher.partition=<p> "
                          "..., or run here with launcher=local")
    nnodes = int(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or 1)
    if nnodes != launcher["nnodes"]:
        raise ConfigError("launcher.nnodes", f"{launcher['nnodes']} node(s) asked for, but Slurm job "
                          f"{job} has {nnodes}", f"set launcher.nnodes={nnodes} (launcher=slurm passes it "
                          "to hydra.launcher.nodes), or allocate that many nodes")
    tasks = int(env.get("SLURM_NTASKS") or nnodes)
    if tasks != nnodes:
        raise ConfigError("hydra.launcher.tasks_per_node", f"{tasks} Slurm tasks on {nnodes} node(s): "
                          "each node must run one controller, which starts its own torchrun",
                          "set hydra.launcher.tasks_per_node=1 (srun --ntasks-per-node=1) and put the "
                          "processes per node in launcher.nproc_per_node")
    hosts = expand_nodelist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "localhost")
    port = launcher["master_port"] or 20000 + int(re.sub(r"\D", "", job) or 0) % 20000
    return Rendezvous(nnodes=nnodes, node_rank=int(env.get("SLURM_NODEID", "0")),
                      master_addr=hosts[0], master_port=port)


def wait_for_rank_files(run_dir: Path, world: int, timeout_s: float = 60.0) -> int:
    """Node 0: wait until every rank's result is visible on the shared file system; return the count.

    Other nodes' workers write theirs as they exit, which a network file system may show late.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        found = len(list((Path(run_dir) / "ranks").glob("rank*.json")))
        if found >= world or time.monotonic() > deadline:
            return found
        time.sleep(1.0)


def _values(node: Any, key: str):
    """(dotted key, value) of every leaf under ``node`` (plain mappings and lists)."""
    if isinstance(node, Mapping):
        for k, v in node.items():
            yield from _values(v, f"{key}.{k}")
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _values(v, f"{key}[{i}]")
    else:
        yield key, node


def check_launcher_values(launcher: Any) -> None:
    """Refuse a ``hydra.launcher.*`` value holding a newline or another control character: submitit writes
    each value into one line of the job script (``#SBATCH --x=<value>``, the setup lines, the command),
    quoting but not escaping newlines, so a newline would start a line of its own, which runs."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(launcher, resolve=True) if OmegaConf.is_config(launcher) else launcher
    for key, value in _values(plain, "hydra.launcher"):
        bad = sorted({c for c in str(value) if ord(c) < 32 or ord(c) == 127}) if isinstance(value, str) else []
        if bad:
            raise ConfigError(key, f"{value!r} holds the control character(s) {', '.join(map(repr, bad))}: the job "
                              "script takes each value on one line, and a newline would start a line of its own "
                              "that runs as a command", "remove it (several setup lines are a list: "
                              "hydra.launcher.setup='[line one,line two]')")


def check_submission(config: Any, which: Callable[[str], str | None] = shutil.which,
                     run: Callable[..., Any] = subprocess.run) -> None:
    """Refuse a Slurm submission that cannot work, before anything is submitted.

    ``config`` is the composed root config with its ``hydra`` node (a callback's view).
    """
    hl, launcher = config["hydra"]["launcher"], config["launcher"]
    check_launcher_values(hl)  # every launcher: submitit_local writes a script too
    if not str(hl.get("_target_", "")).endswith("SlurmLauncher"):
        return
    nodes, tasks = hl["nodes"], hl["tasks_per_node"]
    if not config.get("dry_run"):
        if which("sbatch") is None:
            raise ConfigError("hydra/launcher=submitit_slurm", "sbatch is not on PATH: this machine "
                              "cannot submit Slurm jobs", "run the command on a Slurm login node, add "
                              "dry_run=true to only write the sbatch script, or drop launcher=slurm / "
                              "hydra/launcher=submitit_slurm to run here (launcher=local)")
    if nodes is None or nodes < 1:
        raise ConfigError("hydra.launcher.nodes", f"{nodes} node(s) cannot run anything",
                          "set launcher.nnodes>=1 (launcher=slurm passes it to hydra.launcher.nodes)")
    if tasks != 1:
        raise ConfigError("hydra.launcher.tasks_per_node", f"{tasks} tasks per node would start "
                          f"{tasks} controllers and torchruns on each node",
                          "set hydra.launcher.tasks_per_node=1 and launcher.nproc_per_node=<GPUs per node>")
    if launcher["name"] != "slurm" and nodes > 1:
        raise ConfigError("launcher", f"launcher={launcher['name']} starts torchrun on one node, but the "
                          f"job has {nodes}", f"use launcher=slurm launcher.nnodes={nodes}")
    if launcher["name"] == "slurm" and launcher["nnodes"] != nodes:
        raise ConfigError("launcher.nnodes", f"launcher.nnodes={launcher['nnodes']} but "
                          f"hydra.launcher.nodes={nodes}", "set launcher.nnodes only (launcher=slurm "
                          "passes it to hydra.launcher.nodes)")
    gpus = hl.get("gpus_per_node")
    if gpus and launcher["nproc_per_node"] > gpus:
        raise ConfigError("launcher.nproc_per_node", f"{launcher['nproc_per_node']} processes per node "
                          f"but hydra.launcher.gpus_per_node={gpus}",
                          f"set launcher.nproc_per_node<={gpus} (launcher=slurm asks for one GPU each)")
    if launcher["nproc_per_node"] > 1 and not hl.get("cpus_per_task"):
        raise ConfigError("hydra.launcher.cpus_per_task", f"one Slurm task per node runs all "
                          f"{launcher['nproc_per_node']} workers of the node, and Slurm gives a task one "
                          "CPU unless told", "set hydra.launcher.cpus_per_task=<CPU cores per node>")
    if hl.get("timeout_min") is not None and hl["timeout_min"] < 1:
        raise ConfigError("hydra.launcher.timeout_min", f"{hl['timeout_min']} minutes", "use >= 1")
    if which("sinfo") is None:
        return
    out = run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=60)
    names = [p.strip() for p in out.stdout.split() if p.strip()]
    known = [p.rstrip("*") for p in names]
    partition = hl.get("partition")
    if partition is not None and partition not in known:
        raise ConfigError("hydra.launcher.partition", f"partition {partition!r} does not exist here "
                          f"(sinfo lists: {', '.join(names) or 'none'})",
                          "set hydra.launcher.partition=<one of those>")
    if partition is None and not any(p.endswith("*") for p in names):
        raise ConfigError("hydra.launcher.partition", "no partition given and this cluster has no "
                          f"default (sinfo lists: {', '.join(names) or 'none'})",
                          "set hydra.launcher.partition=<one of those>")


def check_output_dir(config: Any) -> None:
    """``output_dir`` names one directory; in a sweep every point would write (and overwrite) it."""
    task = [str(o) for o in config.hydra.overrides.task]
    params = config.hydra.sweeper.get("params") or {}
    if config.get("output_dir") or "output_dir" in params or any(o.lstrip("+~").startswith("output_dir=") for o in task):
        raise ConfigError("output_dir", "a -m sweep runs many points, and output_dir gives them all one "
                          "directory: each would overwrite the last", "drop output_dir and choose the sweep's "
                          "directory with hydra.sweep.dir=<dir> (each point gets its own subdirectory)")


def sweep_point_overrides(config: Any) -> list[list[str]]:
    """The overrides of every point of a multirun, as Hydra's basic sweeper expands them (sweep file
    params, then the command line)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    parsed = OverridesParser.create().parse_overrides(params + [str(o) for o in config.hydra.overrides.task])
    return [list(point) for batch in BasicSweeper.split_arguments(parsed, None) for point in batch]


def check_recipe_submission(config: Any) -> str | None:
    """A ``recipe=<name>`` sent to Slurm: only its published layout (``recipe.full_depth=true``) makes
    sense there, and that layout must validate (``recipes.recipe.apply_recipe``) before submitting.
    Returns the recipe's layout line (None without a recipe or outside the Slurm launcher)."""
    if config.get("recipe") is None or not str(config["hydra"]["launcher"].get("_target_", "")).endswith("SlurmLauncher"):
        return None
    from omegaconf import OmegaConf

    from recipes.recipe import apply_recipe, layout_text

    plain = {k: OmegaConf.to_container(config[k], resolve=True) if OmegaConf.is_config(config[k]) else config[k]
             for k in config if k != "hydra"}
    if not plain["recipe"]["full_depth"]:
        raise ConfigError("recipe.full_depth", f"recipe={plain['recipe']['name']} at reduced depth runs in one "
                          "process on one machine, but this submits a Slurm job of "
                          f"{plain['launcher']['nnodes']} node(s)", "add recipe.full_depth=true to submit the "
                          "published layout, or drop launcher=slurm to run the reduced model here")
    cfg, _ = apply_recipe(plain, on_gpu=True)
    return f"recipe={cfg['recipe']['name']}: {layout_text(cfg)}, {cfg['model']['num_layers']} layers"


def sbatch_preview(hydra_launcher: Mapping[str, Any]) -> str:
    """The sbatch script the submitit plugin would submit for one sweep point (nothing is submitted).

    The plugin's own steps (``SlurmLauncher.launch``): an ``AutoExecutor`` for Slurm, its
    parameters with non-generic names prefixed ``slurm_``; then submitit's script writer. Only the
    check that ``srun`` exists is bypassed, so this works on a machine without Slurm.
    """
    from unittest import mock

    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    params = {k: v for k, v in dict(hydra_launcher).items() if k != "_target_"}
    init = {"folder": params.pop("submitit_folder"),
            "slurm_max_num_timeout": params.pop("max_num_timeout", 0)}
    generic = set(OmegaConf.structured(BaseQueueConf).keys())
    with mock.patch.object(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 1)):
        executor = submitit.AutoExecutor(cluster="slurm", **init)
    executor.update_parameters(**{k if k in generic else f"slurm_{k}": v for k, v in params.items()})
    slurm = executor._executor  # submitit.SlurmExecutor
    return slurm._make_submission_file_text(slurm._submitit_command_str, "dry-run")


def describe_torchrun(launcher: Mapping[str, Any]) -> str:
    """The torchrun each node's controller starts inside the job (placeholders for job values)."""
    port = launcher["master_port"] or "<20000 + job id % 20000>"
    return (f"{sys.executable} -m torch.distributed.run --nproc-per-node={launcher['nproc_per_node']} "
            f"--nnodes={launcher['nnodes']} --node-rank=$SLURM_NODEID "
            f"--master-addr=<first host of $SLURM_JOB_NODELIST> --master-port={port} "
            "-m recipes.run.worker <run dir>")
