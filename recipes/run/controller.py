"""The controller: compose once, validate, freeze the config, start the workers, record the result.

``train.py`` calls ``run(cfg)`` inside ``@hydra.main``. Workers are a fresh process group per run
(per sweep point), so CUDA memory and NCCL state start clean and memory comparisons are fair. How
they start is ``recipes.run.workers``; what Hydra says of the run and its sweep, ``recipes.run.multirun``.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from launch.affinity import usable_cores
from launch.slurm import node_rank, wait_for_rank_files
from recipes.analyze.logger import close_unfinished, usable_logger, write_identity
from recipes.config import RunConfig, typed
from recipes.errors import ConfigError
from recipes.files import UnreadableFile, write_json_atomic, write_json_or_fallback
from recipes.measure.timeline import write_timeline_pngs
from recipes.offload import option_of as offload_option_of
from recipes.predict.estimate import planned_host_bytes, predict
from recipes.recipe import apply_recipe
from recipes.recompute import option_of
from recipes.results import NOT_MEASURED, load_result, merge_result
from recipes.run import multirun, workers
from recipes.run.console import print_run
from recipes.validate import gpu_count, validate
from recipes.validate.offload import host_memory_available, host_memory_problem
from recipes.validate.parallel import validate_cores
from recipes.validate.run import output_problem, peak_memory_problem
from recipes.validate.values import check_bool_overrides

#: Statuses that count as a complete result (a sweep re-run skips them unless rerun=true).
COMPLETE = ("ok", "oom")
#: The process's exit code for what a run ended as (docs/outputs.md). A sweep exits with the code of
#: its worst point among refused, failed and busy; its oom points are measurements (they do not fit).
EXIT_CODES = {"ok": 0, "failed": 1, "refused": 2, "oom": 3, "busy": 4}
#: Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130
#: What each run of this process ended as, with whether it was a sweep point: train.py's exit code.
OUTCOMES: list[tuple[str, bool]] = []
#: The run directory being worked on (train.py names it when the user interrupts).
CURRENT: dict[str, Path] = {}


def exit_code(outcomes: list[tuple[str, bool]] | None = None) -> int:
    """0 when every run did what was asked; else the code of what went wrong (``EXIT_CODES``)."""
    outcomes = OUTCOMES if outcomes is None else outcomes
    single = [status for status, multirun in outcomes if not multirun]
    if single:
        return EXIT_CODES.get(single[-1], 0)
    statuses = {status for status, _ in outcomes}
    return next((EXIT_CODES[s] for s in ("refused", "failed", "busy") if s in statuses), 0)


class PointLock:
    """An exclusive ``fcntl.flock`` on ``RUN_DIR/.lock`` while a run works on its directory, so two sweeps
    (or runs) never run the same point at once. The second waits up to ``wait_s`` for the first to
    finish (then usually finds its result complete and skips it), else gives up and says so. The lock
    goes with the process, however it ends (the kernel releases it)."""

    def __init__(self, run_dir: Path, name: str, wait_s: float):
        self.path, self.name, self.wait_s = Path(run_dir) / ".lock", name, wait_s
        self.file = None

    def acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a+")
        deadline, said = time.monotonic() + self.wait_s, False
        while True:
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:
                    holder = self.path.read_text().strip() or "?"
                    print(f"[wait] {self.name}: another run (pid {holder}) is running {self.path.parent}; "
                          f"waiting up to {self.wait_s:.0f} s for it (lock_wait_s)", flush=True)
                    said = True
                if time.monotonic() >= deadline:
                    self.file.close()  # not ours: leave the holder's pid
                    self.file = None
                    return False
                time.sleep(0.5)
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"{os.getpid()}\n")
        self.file.flush()
        return True

    def release(self) -> None:
        if self.file is not None:
            self.file.truncate(0)  # no pid of a finished run (only the holder writes)
            self.file.close()  # closing the descriptor releases the flock
            self.file = None


def run_directory(cfg: DictConfig) -> Path:
    """Where this run writes: ``output_dir``, else Hydra's run or sweep-point directory."""
    if cfg.output_dir:
        return Path(cfg.output_dir)
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def run_name(cfg: DictConfig, choices: dict[str, str]) -> str:
    """``model attention recompute [offload=...]`` unless the user named the run (``recipe`` for ``model``
    when one is named: it sets the model); the recompute part says what the values recompute
    (recipes.recompute.option_of), whatever option they were composed from."""
    if cfg.name:
        return cfg.name
    parts = [choices.get("recipe") or choices.get("model", cfg.model.family), choices.get("attention", cfg.attention.backend),
             option_of(cfg)]
    offload = offload_option_of(cfg)
    return " ".join(str(p) for p in parts) + (f" offload={offload}" if offload != "none" else "")


def changed_keys(stored: dict | None, current: dict) -> list[str]:
    """Top-level config sections that differ between a stored result and this run (resume check)."""
    stored = stored or {}
    keys = (set(stored) | set(current)) - set(NOT_MEASURED)
    return sorted(k for k in keys if stored.get(k) != current.get(k))


def changed_values(stored: dict | None, current: dict, sections: list[str], limit: int = 4) -> str:
    """``model.num_layers 2 -> 3, ...``: the settings of ``sections`` that differ, for a message."""
    found = []
    for section in sections:
        old, new = (stored or {}).get(section), current.get(section)
        if isinstance(old, dict) and isinstance(new, dict):
            found += [f"{section}.{k} {old.get(k)} -> {new.get(k)}" for k in sorted(set(old) | set(new))
                      if old.get(k) != new.get(k)]
        else:
            found.append(f"{section} {old} -> {new}")
    return ", ".join(found[:limit]) + (f" and {len(found) - limit} more" if len(found) > limit else "")


def run(cfg: DictConfig) -> dict:
    """One run (one sweep point), recorded in ``OUTCOMES`` for train.py's exit code (``exit_code``)."""
    result = _run(cfg)
    OUTCOMES.append((result.get("status", "ok"), multirun.in_multirun()))
    return result


def stored(run_dir: Path) -> dict | None:
    """What a run directory already holds: its result.json, else its config.yaml (a run that never
    finished), else None. An unreadable result is named and treated as absent: the point runs again."""
    existing = run_dir / "result.json"
    if existing.exists():
        try:
            return load_result(existing)
        except UnreadableFile as err:
            print(f"warning: {err}; treated as incomplete: this point runs again", file=sys.stderr, flush=True)
            return None
    if (run_dir / "config.yaml").exists():
        try:
            return {"status": "incomplete", "config": OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))}
        except Exception:  # a truncated config.yaml: nothing complete to keep
            return None
    return None


def check_point(plain: dict, num_gpus: int | None = None, job_memory_gib: float | None = None,
                submitting: bool = False, single: bool = False) -> None:
    """Every check a point passes before its workers start: the rules (``recipes.validate``), activation
    offload's predicted host copies against the node's memory, the predicted peak against this machine
    (``single``: a single run on a GPU too; a sweep's GPU point that runs out is a measurement), the data
    files. ``submitting``: checked on the machine that submits a Slurm job, not the node, so the host
    copies only against the job's memory (``job_memory_gib``) or ``offload.host_memory_gib`` where given."""
    num_gpus = gpu_count() if num_gpus is None else num_gpus
    # the rules first: the estimator predicts only what passes them (a submission's node checks its own build)
    validate(plain, num_gpus=num_gpus, this_machine=not submitting)
    cfg = typed(plain)  # its keys checked: the typed config the estimator and the data checks take
    if not submitting or job_memory_gib is not None or cfg.offload.host_memory_gib is not None:
        planned = planned_host_bytes(cfg, "cuda" if submitting else "auto")
        problem = host_memory_problem(cfg, planned, job_memory_gib)
        if problem:
            raise ConfigError(*problem)
    if not submitting and (single or not num_gpus):
        problem = peak_memory_problem(cfg, *_peak_and_capacity(cfg, num_gpus))
        if problem:
            raise ConfigError(*problem)
    from recipes.data.indexed import validate_data  # lazy: numpy, once the rules passed

    validate_data(cfg)  # files, .idx header and .bin size, tokenizer sidecar (cheap)


def _peak_and_capacity(cfg: RunConfig, num_gpus: int) -> tuple[int | None, int | None, str, int]:
    """The estimator's peak for one rank, what holds it (this GPU's memory, or on a CPU this host's
    available memory for all its ranks), its name, and the ranks sharing it."""
    try:
        peak = predict(cfg, "cuda" if num_gpus else "cpu")["peak_bytes"]
    except Exception:  # a layout the estimator does not model: the run itself decides
        return None, None, "", 1
    if not num_gpus:
        return peak, host_memory_available(), "this machine's available memory", cfg.launcher.nproc_per_node
    import torch  # a GPU machine: torch is loaded already (gpu_count)

    return peak, torch.cuda.get_device_properties(0).total_memory, f"this GPU's memory ({torch.cuda.get_device_name(0)})", 1


def _run(cfg: DictConfig) -> dict:
    """Validate, write config, launch, merge, report, log.

    A refused configuration raises ``ConfigError`` for a single run; in a sweep it is recorded as a
    ``refused`` point and the sweep goes on.
    """
    choices = multirun.hydra_choices()
    check_bool_overrides(multirun.hydra_overrides())  # train.fused_adam=2: OmegaConf would read true
    if missing := sorted(OmegaConf.missing_keys(cfg)):  # ~model: a deleted group leaves its values unset
        group = missing[0].split(".")[0]
        raise ConfigError(missing[0], f"has no value ({len(missing)} unset: {', '.join(missing[:4])}"
                          f"{' ...' if len(missing) > 4 else ''})", f"select a {group} option ({group}=<option>; "
                          f"python train.py --help lists them) or set {missing[0]}=<value>")
    plain, recipe_notes = apply_recipe(OmegaConf.to_container(cfg, resolve=True),  # recipe=: depth, layout
                                       overrides=multirun.hydra_overrides())
    for note in recipe_notes:
        print(f"[recipe] {note}", flush=True)
    name = run_name(cfg, choices)
    if multirun.in_multirun() and cfg.output_dir:  # launch.slurm.check_output_dir refuses it before the first point
        raise ConfigError("output_dir", "a -m sweep gives every point its own directory; output_dir would "
                          "give them all one", "drop output_dir; choose the sweep's directory with hydra.sweep.dir")
    run_dir = run_directory(cfg)
    CURRENT["run_dir"] = run_dir
    if multirun.in_multirun():
        print(multirun.sweep_progress(name), flush=True)
        if workers.STOPPED:  # SIGTERM (a preemption, `timeout`, `kill`) ends the sweep, not just its current point
            print(f"[signal] {name}: not started, the sweep received {workers.STOPPED['signal']} (the same command "
                  "runs the points left)", flush=True)
            return {"status": "not_started", "name": name, "run_dir": str(run_dir)}
    try:
        check_point(plain, single=not multirun.in_multirun())  # before any worker starts
        validate_cores(plain, usable_cores())  # launcher.cpu_cores_per_rank on this machine
        if problem := output_problem(run_dir):
            raise ConfigError(*problem)
        ck = plain["checkpoint"]  # a checkpoint.dir elsewhere: unwritable, the first save would stop the run
        if ck["save"] and ck["dir"] and (problem := output_problem(os.path.expanduser(ck["dir"]))):
            raise ConfigError("checkpoint.dir", problem[1], "set checkpoint.dir to a writable directory (null: "
                              "RUN_DIR/checkpoints)")
    except ConfigError as err:
        if not multirun.in_multirun():
            raise
        result = {"schema_version": 1, "name": name, "choices": choices, "overrides": multirun.hydra_overrides(),
                  "run_dir": str(run_dir),
                  "status": "refused", "error": str(err), "config": plain, "ranks": []}
        write_json_atomic(run_dir / "result.json", result)
        print_run(result)
        return result
    plain["logger"] = usable_logger(plain["logger"])  # online without a network: offline, said once per sweep
    node = node_rank(plain["launcher"])  # launcher=slurm: every node launches, node 0 records
    lock = PointLock(run_dir, name, cfg.lock_wait_s)
    if node == 0 and plain["launcher"]["name"] == "local" and not lock.acquire():
        print(f"[busy] {name}: another run still holds {lock.path} after {cfg.lock_wait_s:.0f} s; not run here "
              "(run the same command again once it is done)", flush=True)
        return {"status": "busy", "name": name, "run_dir": str(run_dir)}
    try:
        return _launch(cfg, plain, name, choices, run_dir, node)
    finally:
        lock.release()


#: ``train.*`` keys that may change when a finished run is continued further (``extension``).
EXTENDABLE = ("train_iters", "lr_decay_iters", "exit_interval", "log_interval")


def extension(previous: dict, plain: dict, run_dir: Path, name: str) -> bool:
    """Whether this run continues a finished one further: ``checkpoint.resume`` set, only
    ``train.train_iters`` raised (and the ``EXTENDABLE`` keys), a checkpoint to continue from. Says what is
    kept and what is replaced; a finished run that kept no checkpoint is refused with the fix."""
    saved = previous.get("config") or {}
    if previous.get("status") not in COMPLETE or not plain["checkpoint"]["resume"]:
        return False
    if changed_keys(saved, plain) != ["train"]:
        return False
    old, new = saved.get("train") or {}, plain["train"]
    if any(old.get(k) != new.get(k) for k in set(old) | set(new) if k not in EXTENDABLE):
        return False
    if not isinstance(old.get("train_iters"), int) or new["train_iters"] <= old["train_iters"]:
        return False
    from recipes.run.checkpoint import find_resume

    path, _ = find_resume(plain, run_dir, deep=False)  # a checkpoint that does not verify is refused here
    if path is None:
        raise ConfigError("train.train_iters", f"{run_dir} finished at step {old['train_iters']} but kept no "
                          "checkpoint to continue from", "rerun=true trains it again from step 0 with "
                          f"train.train_iters={new['train_iters']} (its result is replaced), or choose another output_dir")
    print(f"[extend] {name}: continuing {run_dir} from {path.name} to train.train_iters={new['train_iters']} "
          f"(was {old['train_iters']}); kept: its checkpoints, progress.jsonl and W&B run; replaced at the end: "
          "result.json (the measured window is carried over); the learning-rate schedule continues (its notes follow)",
          flush=True)
    return True


def replace(plain: dict, run_dir: Path, name: str) -> None:
    """``rerun=true``: this run replaces what ``run_dir`` holds, its result, progress and checkpoints,
    and trains from step 0 (a checkpoint left behind would be resumed, or mixed with the new ones)."""
    from recipes.run.checkpoint import checkpoint_root, discard

    ck = plain["checkpoint"]
    deleted = discard(checkpoint_root(plain, run_dir)) if ck["save"] or ck["resume"] else []
    (run_dir / "progress.jsonl").unlink(missing_ok=True)
    if deleted or (run_dir / "result.json").exists():
        print(f"[rerun] {name}: replacing {run_dir}: its result, progress.jsonl and {len(deleted)} checkpoint(s) "
              "are deleted; training starts at step 0", flush=True)


#: What a result.json keeps when the whole one cannot be written (``record``).
RECORD_KEYS = ("schema_version", "name", "choices", "overrides", "run_dir", "created", "wall_s", "config")


def record(run_dir: Path, result: dict) -> dict:
    """Write ``RUN_DIR/result.json``. On a full disk or an unwritable directory the run still ends with
    a record: a small result.json (status ``failed``, the error, the checkpoint) if that fits, and a
    message naming the path and what was kept (the checkpoint, worker.log, progress.jsonl)."""
    path = run_dir / "result.json"
    saved = next((r["checkpoint"] for r in result.get("ranks") or [] if r.get("checkpoint")), None)
    small = {**{k: result[k] for k in RECORD_KEYS if k in result}, "status": "failed", "checkpoint": saved,
             "ranks": [{k: r.get(k) for k in ("rank", "status", "error")} for r in result.get("ranks") or []]}
    err = write_json_or_fallback(path, result, {**small, "error": f"the full result could not be written to {path}"})
    if err is None:
        return result
    error = f"{path} could not be written ({type(err).__name__}: {err}) for a run that ended {result.get('status')}"
    kept = [f"checkpoint of step {saved['step']} at {saved['path']} (the same command resumes from it)" if saved
            else "no checkpoint", f"{run_dir / 'worker.log'}", f"{run_dir / 'progress.jsonl'} (if logged)"]
    print(f"[error] {error}; kept: {'; '.join(kept)}; free space or choose another output_dir and run the same "
          "command again", file=sys.stderr, flush=True)
    return {**result, "status": "failed", "error": error}


def _launch(cfg: DictConfig, plain: dict, name: str, choices: dict, run_dir: Path, node: int) -> dict:
    previous = stored(run_dir) if node == 0 and not cfg.rerun else None
    if previous is not None:
        changed = changed_keys(previous.get("config"), plain)
        if previous.get("status") in COMPLETE and not changed:
            print(f"[skip] {name}: complete result in {run_dir} (rerun=true to run again)")
            return previous
        extends = extension(previous, plain, run_dir, name)
        # output_dir=<a run directory>: never overwritten silently, unless this run continues it from its
        # checkpoints (checkpoint.resume: the worker refuses a checkpoint of another model, naming what differs)
        continues = bool(plain["checkpoint"]["resume"]) and (previous.get("status") not in COMPLETE or extends)
        if changed and not multirun.in_multirun() and not continues:
            raise ConfigError("output_dir", f"{run_dir} holds a run with other {', '.join(changed)} "
                              f"({changed_values(previous.get('config'), plain, changed)}; status "
                              f"{previous.get('status')})", "choose another output_dir, or add rerun=true "
                              "to replace that run (its result and checkpoints are deleted; training starts at step 0)")
        if previous.get("status") in COMPLETE and not extends:
            print(f"[rerun] {name}: the stored result was measured with other {', '.join(changed)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    if node == 0:
        OmegaConf.save(OmegaConf.create(plain), run_dir / "config.yaml")
    if cfg.dry_run:
        print(f"[dry-run] {name}: config written to {run_dir / 'config.yaml'}")
        return {"status": "dry_run", "name": name, "run_dir": str(run_dir)}
    if cfg.rerun and node == 0:  # after a dry run's return: it deletes nothing
        replace(plain, run_dir, name)
    for stale in (run_dir / "ranks").glob("rank*.json") if node == 0 else ():
        stale.unlink()
    if node == 0:  # logger=wandb: the run's W&B name, group, job type and Hydra choices, for the worker
        write_identity(run_dir, plain["logger"], name, choices, multirun.hydra_overrides(), multirun.in_multirun())
    start = time.time()  # the workers' timelines are relative to this launch time
    log_path = run_dir / ("worker.log" if node == 0 else f"worker.node{node}.log")
    command = workers.worker_command(plain, run_dir)
    env = workers.worker_environment(plain)
    workers.build_share_storage_ahead(plain, env)
    server = workers.fork_server(env) if workers.uses_fork_server(plain) else None
    with open(log_path, "a" if plain["checkpoint"]["resume"] else "w") as log:
        returncode = workers.run_workers(command, env, log, server, run_dir if node == 0 else None,
                                         nproc=plain["launcher"]["nproc_per_node"]).returncode
    if node:
        print(f"[node {node}] {name}: workers exited with code {returncode}; node 0 records {run_dir}")
        return {"status": "node", "node_rank": node, "name": name, "run_dir": str(run_dir)}
    launch_error = None
    if returncode:
        launch_error = f"workers exited with code {returncode}; see {log_path}"
    meta = {
        "name": name,
        "choices": choices,
        "overrides": multirun.hydra_overrides(),
        "run_dir": str(run_dir),
        "wall_s": time.time() - start,
        "launched": start,
        "launch_command": " ".join(command) if server is None else f"forked by the fork server (pid "
                          f"{server.pid}) as: {' '.join(command)}",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": plain,
    }
    world = plain["launcher"]["nproc_per_node"] * plain["launcher"]["nnodes"]
    if plain["launcher"]["nnodes"] > 1:  # the other nodes' rank files, over a shared file system
        wait_for_rank_files(run_dir, world)
    result = merge_result(run_dir, meta, world, launch_error)
    write_timeline_pngs(result, run_dir)  # the profiled ranks' (matplotlib loads only for one)
    if result["status"] == "failed" and not result.get("ranks"):
        result["log_tail"] = log_path.read_text()[-4000:]
    result = record(run_dir, result)
    print_run(result)
    close_unfinished(plain["logger"], result)  # only a W&B run a killed worker left open; warns, never raises
    while workers.RECEIVED:  # under Slurm's submitit launcher: its own handler requeues the job now
        signum, handler = workers.RECEIVED.pop(0)
        if callable(handler):
            handler(signum, None)
    return result
