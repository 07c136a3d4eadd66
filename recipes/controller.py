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

from launch.torchrun import free_port
from recipes.results import load_result, merge_result, summary, write_json_atomic
from recipes.validate import ConfigError, recompute_option, validate

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Statuses that count as a complete result (a sweep re-run skips them unless rerun=true).
COMPLETE = ("ok", "oom")


def hydra_choices() -> dict[str, str]:
    """The config-group choices of this run (model, recompute, ...), or {} outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    return {k: v for k, v in HydraConfig.get().runtime.choices.items() if not k.startswith("hydra")}


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
             recompute_option(cfg)]
    return " ".join(str(p) for p in parts)


def worker_command(cfg: dict, run_dir: Path) -> list[str]:
    """torchrun for several processes; a single process is started directly (same environment)."""
    launch = cfg["launcher"]
    if launch["nproc_per_node"] * launch["nnodes"] == 1:
        return [sys.executable, "-m", "recipes.worker", str(run_dir)]
    from launch.torchrun import torchrun_command

    program = ["-m", "recipes.worker", str(run_dir)]
    if launch["name"] == "slurm":  # this node's torchrun; every node of the Slurm job starts one
        from launch.slurm import slurm_rendezvous

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


#: Keys that do not change what a point measures: a stored result with other values still counts.
NOT_MEASURED = ("rerun", "dry_run", "name", "output_dir", "logger")


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
    plain = OmegaConf.to_container(cfg, resolve=True)
    run_dir = run_directory(cfg)
    name = run_name(cfg, choices)
    if in_multirun():
        print(sweep_progress(name), flush=True)
    try:
        validate(plain)  # before any worker starts
    except ConfigError as err:
        if not in_multirun():
            raise
        result = {"schema_version": 1, "name": name, "choices": choices, "run_dir": str(run_dir),
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
    from launch.slurm import node_rank, wait_for_rank_files

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
    from recipes.profile import write_timeline_pngs

    write_timeline_pngs(result, run_dir)
    if result["status"] == "failed" and not result.get("ranks"):
        result["log_tail"] = log_path.read_text()[-4000:]
    write_json_atomic(run_dir / "result.json", result)
    print_run(result)
    from recipes.logger import log_run

    log_run(plain, result)
    return result


def print_run(result: dict) -> None:
    """A short console summary of one run."""
    row = summary(result)
    status = row["status"]
    parts = [f"[{status}] {row['name']}"]
    if row.get("peak_allocated_gib") is not None:
        parts.append(f"peak alloc {row['peak_allocated_gib']:.2f} GiB")
    if row.get("peak_reserved_gib") is not None:
        parts.append(f"reserved {row['peak_reserved_gib']:.2f} GiB")
    if row.get("ledger_bytes") is not None:
        parts.append(f"ledger {row['ledger_bytes'] / 2**20:.2f} MiB")
    if row.get("step_time_s") is not None:
        parts.append(f"step {row['step_time_s'] * 1e3:.1f} ms")
    if row.get("tokens_per_s") is not None:
        parts.append(f"{row['tokens_per_s']:.0f} tok/s")
    if row.get("mfu") is not None:
        parts.append(f"MFU {row['mfu'] * 100:.1f}%")
    print(" | ".join(parts))
    ranks = result.get("ranks") or []
    if len(ranks) > 1:  # every rank, by its parallel coordinates; the worst decides whether it fits
        hosts = len({r.get("host") for r in ranks}) > 1
        for r in ranks:
            print(f"  {rank_line(r, r.get('rank') == result.get('worst_rank'), hosts)}")
    from recipes.profile import top_contributors

    if line := top_contributors(result):  # profile=peak: what drives the peak
        print(f"  {line}")
    for r in result.get("ranks") or []:  # runs with validation (data.eval_interval): the loss curve
        evals = [e for e in r.get("eval_loss") or [] if e.get("loss") is not None]
        train = [x for x in r.get("loss") or [] if x is not None]
        if evals and train:
            print(f"  train/loss {train[0]:.3f} -> {train[-1]:.3f} | val/loss "
                  + ", ".join(f"{e['loss']:.3f} (step {e['step']})" for e in evals))
            break
    if status != "ok":
        print(f"  error: {result.get('error')}")
    warnings = list(result.get("warnings", []))
    for r in result.get("ranks") or []:  # label findings are per rank (a label may run on some only)
        warnings += [w for w in r.get("warnings") or [] if w not in warnings]
    for warning in warnings:
        print(f"  warning: {warning}")
    phases = time_breakdown(result)
    if phases:
        print("  time: " + ", ".join(f"{k} {v:.1f}s" for k, v in phases.items()))


#: Worker timeline marks, in order, and the phase each one ends (recipes/worker.py).
_PHASES = [("main_start", "start+imports"), ("megatron_imported", "megatron imports"),
           ("device_ready", "device init"), ("process_group_ready", "process group"),
           ("distributed_ready", "parallel state"), ("built", "build"),
           ("warmed_up", "warm-up"), ("steady_done", "timed steps"), ("profile_done", "profile"),
           ("ledgers_done", "control ledgers"), ("end", "findings+exit")]


def time_breakdown(result: dict) -> dict[str, float]:
    """Where a point's wall time went (rank 0's timeline from the launch): the fixed costs that
    decide how long a sweep takes, next to the timed steps that decide the comparison."""
    ranks = result.get("ranks") or []
    marks = dict((ranks[0].get("timeline") or {}) if ranks else {})
    launched = result.get("launched")
    if not marks or launched is None:
        return {}
    marks["end"] = launched + result.get("wall_s", 0.0)
    phases, previous = {}, launched
    for key, name in _PHASES:
        if key in marks:
            phases[name] = marks[key] - previous
            previous = marks[key]
    phases["wall"] = result.get("wall_s", 0.0)
    return phases


def rank_line(r: dict, worst: bool = False, host: bool = False) -> str:
    """One rank of a multi-rank run: coordinates, memory, ledger and what its schedule holds, time."""
    coords = r.get("coords") or {}
    label = f"rank {r.get('rank')}"
    if coords:
        label += " (" + " ".join(f"{k}{coords[k]}" for k in ("tp", "pp", "cp", "ep", "dp") if k in coords) + ")"
    if host:
        label += f" @{r.get('host')}"
    parts = [label + (" WORST" if worst else ""), str(r.get("status"))]
    mem, timing = r.get("memory") or {}, r.get("timing") or {}
    if mem.get("peak_allocated_gib") is not None:
        parts.append(f"peak alloc {mem['peak_allocated_gib']:.2f} GiB")
    if mem.get("peak_reserved_gib") is not None:
        parts.append(f"reserved {mem['peak_reserved_gib']:.2f} GiB")
    if (r.get("ledger") or {}).get("total_bytes") is not None:
        parts.append(f"ledger {r['ledger']['total_bytes'] / 2**20:.2f} MiB")
    pipe = r.get("pipeline") or {}
    if pipe.get("in_flight_forwards", 1) > 1:  # the schedule holds several forwards' activations
        held = (f"{pipe['in_flight_forwards']} forwards of {pipe['num_model_chunks']} chunks"
                if pipe.get("num_model_chunks", 1) > 1 else f"{pipe['in_flight_forwards']} micro-batches")
        parts.append(f"in flight {pipe['in_flight_ledger_bytes'] / 2**20:.2f} MiB ({held} of "
                     f"{pipe['num_microbatches']})")
    if timing.get("step_time_s") is not None:
        parts.append(f"step {timing['step_time_s'] * 1e3:.1f} ms")
    losses = [x for x in r.get("loss") or [] if x is not None]
    if losses:
        parts.append(f"loss {losses[-1]:.3f}")
    return " | ".join(parts)
