"""The controller: compose once, validate, freeze the config, start the workers, record the result.

``train.py`` calls ``run(cfg)`` inside ``@hydra.main``. Workers are a fresh process group per run
(per sweep point), so CUDA memory and NCCL state start clean and memory comparisons are fair.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from launch.affinity import usable_cores
from launch.forkserver import ForkServer, env_key
from launch.process import end_group, start_group
from launch.slurm import node_rank, slurm_rendezvous, wait_for_rank_files
from launch.torchrun import ONE_RANK_ENV, torchrun_command
from recipes.analyze.logger import close_unfinished, usable_logger, write_identity
from recipes.build.upstream import start_share_storage_build
from recipes.data.indexed import validate_data
from recipes.errors import ConfigError
from recipes.files import REPO_ROOT, UnreadableFile, write_json_atomic
from recipes.measure.profile import write_timeline_pngs
from recipes.offload import option_of as offload_option_of
from recipes.predict.estimate import planned_host_bytes
from recipes.recipe import apply_recipe
from recipes.recompute import option_of
from recipes.results import NOT_MEASURED, load_result, merge_result
from recipes.run.console import print_run
from recipes.validate import gpu_count, validate
from recipes.validate.offload import host_memory_problem
from recipes.validate.parallel import validate_cores
from recipes.validate.share_storage import share_storage_labels

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
    """``model attention recompute [offload=...]`` unless the user named the run (``recipe`` for ``model``
    when one is named: it sets the model); the recompute part says what the values recompute
    (recipes.recompute.option_of), whatever option they were composed from."""
    if cfg.name:
        return cfg.name
    parts = [choices.get("recipe") or choices.get("model", cfg.model.family), choices.get("attention", cfg.attention.backend),
             option_of(cfg)]
    offload = offload_option_of(cfg)
    return " ".join(str(p) for p in parts) + (f" offload={offload}" if offload != "none" else "")


def worker_command(cfg: dict, run_dir: Path) -> list[str]:
    """torchrun for several processes; a single process is started directly (same environment)."""
    launch = cfg["launcher"]
    if launch["nproc_per_node"] * launch["nnodes"] == 1:
        return [sys.executable, "-m", "recipes.run.worker", str(run_dir)]
    program = ["-m", "recipes.run.worker", str(run_dir)]
    if launch["name"] == "slurm":  # this node's torchrun; every node of the Slurm job starts one
        return torchrun_command(launch, program, slurm_rendezvous(launch))
    return torchrun_command(launch, program)


#: What the fork server imports before it forks a sweep point's worker: the worker and the megatron
#: modules it loads (upstream.apply_all imports the transformer, MoE and optimizer ones), none of which
#: touches CUDA; the rest a worker imports on its own.
WORKER_PRELOAD = ["recipes.run.worker", "recipes.build.upstream:apply_all", "recipes.build.attention",
                  "recipes.build.experts", "recipes.build.dispatch", "megatron.core.models.gpt",
                  "megatron.core.pipeline_parallel", "megatron.core.distributed", "megatron.core.datasets.gpt_dataset"]
#: In a run directory while its workers run: the pid the controller started (the worker, or torchrun).
WORKER_PID = "worker.pid"
#: This controller's fork server (one per environment; started at the first point that uses it).
FORK_SERVER: dict = {"server": None, "failed": None}


def uses_fork_server(cfg: dict) -> bool:
    """Sweep points of one process on this machine fork from the server (``fork_server``, default on)."""
    launch = cfg["launcher"]
    return (bool(cfg.get("fork_server")) and in_multirun() and launch["name"] == "local"
            and launch["nproc_per_node"] * launch["nnodes"] == 1 and FORK_SERVER["failed"] is None)


def fork_server(env: dict[str, str]) -> ForkServer | None:
    """The fork server for ``env`` (a new one when the environment changed, e.g. a point with
    ``measure.expandable_segments``), or None, said once, when it cannot serve."""
    server = FORK_SERVER["server"]
    if server is not None and server.env_key != env_key(env):
        server.close()
        server = FORK_SERVER["server"] = None
    if server is None:
        try:
            server = FORK_SERVER["server"] = ForkServer(WORKER_PRELOAD, env, str(REPO_ROOT))
        except (RuntimeError, OSError) as err:
            FORK_SERVER["failed"] = str(err)
            print(f"[fork-server] not used ({err}): each point starts its own process", flush=True)
            return None
        import atexit

        atexit.register(server.close)
    return server


def worker_environment(cfg: dict) -> dict[str, str]:
    env = dict(os.environ)
    # each point's W&B run gets its own service process: not the one this controller may have started
    # (a killed worker's run would stay open in it, and the controller could not close it)
    env.pop("WANDB_SERVICE", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if cfg["parallel"]["tensor_model_parallel_size"] > 1:
        # megatron's tensor-parallel layers rely on one hardware queue to order their async all-gather
        # and reduce-scatter before the gradient GEMMs. Not set otherwise: one queue makes every stream
        # wait behind the others' work (activation offload's copies then stall compute: docs/offload-log.md)
        env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg["launcher"]["nproc_per_node"])))
    if cfg["measure"]["expandable_segments"]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if env.get("RANK") is None and cfg["launcher"]["nproc_per_node"] * cfg["launcher"]["nnodes"] == 1:
        env.update(ONE_RANK_ENV)  # its port 0: the worker's store binds a free one itself
    return env



#: Signals forwarded to the workers, with the handler they replaced (submitit's requeue under Slurm),
#: which ``run`` calls once the run is recorded.
RECEIVED: list = []
#: The signal that stopped this controller's sweep: the points after the one it stopped do not start
#: (a re-run of the same command runs them; the stopped one resumes from its checkpoint).
STOPPED: dict = {}
#: Worker output lines the controller echoes to its console (the rest only goes to worker.log).
ECHOED = ("[progress]", "[checkpoint]", "[signal]", "[eval]", "warning: W&B")


def run_workers(command: list[str], env: dict[str, str], log, server: ForkServer | None = None,
                run_dir: Path | None = None) -> subprocess.CompletedProcess:
    """Start the workers (``command``, or with a fork ``server`` one worker forked for ``run_dir``), copy
    their output into ``log``, echo the live progress lines, and forward SIGTERM/SIGUSR1 (a preemption,
    Slurm's time-limit warning) to them: they save a checkpoint at the next step boundary and exit, and
    this controller records the run as ``preempted``."""
    import signal

    # its own process group, killed with the controller (launch.process): no orphaned workers
    if server is not None:
        proc = server.spawn("recipes.run.worker:serve", [str(run_dir)], env, str(REPO_ROOT))
    else:
        proc = start_group(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                           text=True, bufsize=1)
    pid_file = run_dir / WORKER_PID if run_dir is not None else None
    if pid_file is not None:  # which process runs this point (a forked worker's command line is the server's)
        pid_file.write_text(f"{proc.pid}\n")
    forwarded = (signal.SIGTERM, signal.SIGUSR1)

    def forward(signum, _frame):
        proc.send_signal(signum)
        RECEIVED.append((signum, previous[signal.Signals(signum)]))
        STOPPED.setdefault("signal", signal.Signals(signum).name)

    def pump() -> None:
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith(ECHOED):
                    print(line, end="", flush=True)
        except (ValueError, OSError):  # the log closed under it: Ctrl-C, and a process still holds the pipe
            pass

    previous = {sig: signal.signal(sig, forward) for sig in forwarded}
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait()
        reader.join(timeout=10)  # a process the workers left behind may hold the pipe open
    except BaseException:  # Ctrl-C, an error here: the workers go too
        end_group(proc)
        reader.join(timeout=5)  # their last output reaches the log before it closes
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if pid_file is not None:
            pid_file.unlink(missing_ok=True)
    end_group(proc, grace_s=0)  # anything the workers left behind in their group
    return subprocess.CompletedProcess(command, proc.returncode)


def in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def changed_keys(stored: dict | None, current: dict) -> list[str]:
    """Top-level config sections that differ between a stored result and this run (resume check)."""
    stored = stored or {}
    keys = (set(stored) | set(current)) - set(NOT_MEASURED)
    return sorted(k for k in keys if stored.get(k) != current.get(k))


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


#: The background build of megatron's share_storage extension (one per controller process).
SHARE_STORAGE_BUILD: dict = {}


def build_share_storage_ahead(plain: dict, env: dict[str, str]) -> None:
    """On a GPU machine whose sweep (or run) has a point that recomputes through megatron's
    ``CheckpointWithoutOutput``, start building its ``share_storage`` extension now, beside the first
    points (``recipes.build.upstream.start_share_storage_build``; nothing when it is built)."""
    if SHARE_STORAGE_BUILD or not gpu_count():
        return
    sections = []
    if in_multirun():
        from hydra.core.hydra_config import HydraConfig

        try:
            sections = swept_recompute(plain, OmegaConf.load(Path(HydraConfig.get().sweep.dir) / "multirun.yaml"))
        except Exception:  # another sweeper plugin: this point still counts
            pass
    num_gpus = gpu_count()
    points = [plain, *({**plain, "recompute": section} for section in sections)]
    if any(share_storage_labels(point, num_gpus) for point in points):
        SHARE_STORAGE_BUILD["process"] = start_share_storage_build(env)


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
    """One run (one sweep point), recorded in ``OUTCOMES`` for train.py's exit code (``exit_code``)."""
    result = _run(cfg)
    OUTCOMES.append((result.get("status", "ok"), in_multirun()))
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
                submitting: bool = False) -> None:
    """Every check a point passes before its workers start: the rules (``recipes.validate``), activation
    offload's predicted host copies against the node's memory, the data files. ``submitting``: checked
    on the machine that submits a Slurm job, not the node, so the host copies only against the job's
    memory (``job_memory_gib``) or ``offload.host_memory_gib`` where given."""
    validate(plain, num_gpus=num_gpus)  # the rules first: the estimator predicts only what passes them
    if not submitting or job_memory_gib is not None or (plain.get("offload") or {}).get("host_memory_gib") is not None:
        planned = planned_host_bytes(plain, "cuda" if submitting else "auto")
        problem = host_memory_problem(plain, planned, job_memory_gib)
        if problem:
            raise ConfigError(*problem)
    validate_data(plain)  # files, .idx header and .bin size, tokenizer sidecar (cheap)


def _run(cfg: DictConfig) -> dict:
    """Validate, write config, launch, merge, report, log.

    A refused configuration raises ``ConfigError`` for a single run; in a sweep it is recorded as a
    ``refused`` point and the sweep goes on.
    """
    choices = hydra_choices()
    plain, recipe_notes = apply_recipe(OmegaConf.to_container(cfg, resolve=True))  # recipe=: depth, layout
    for note in recipe_notes:
        print(f"[recipe] {note}", flush=True)
    name = run_name(cfg, choices)
    if in_multirun() and cfg.output_dir:  # launch.slurm.check_output_dir refuses it before the first point
        raise ConfigError("output_dir", "a -m sweep gives every point its own directory; output_dir would "
                          "give them all one", "drop output_dir; choose the sweep's directory with hydra.sweep.dir")
    run_dir = run_directory(cfg)
    CURRENT["run_dir"] = run_dir
    if in_multirun():
        print(sweep_progress(name), flush=True)
        if STOPPED:  # SIGTERM (a preemption, `timeout`, `kill`) ends the sweep, not just its current point
            print(f"[signal] {name}: not started, the sweep received {STOPPED['signal']} (the same command "
                  "runs the points left)", flush=True)
            return {"status": "not_started", "name": name, "run_dir": str(run_dir)}
    try:
        check_point(plain)  # before any worker starts
        validate_cores(plain, usable_cores())  # launcher.cpu_cores_per_rank on this machine
    except ConfigError as err:
        if not in_multirun():
            raise
        result = {"schema_version": 1, "name": name, "choices": choices, "overrides": hydra_overrides(),
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


def _launch(cfg: DictConfig, plain: dict, name: str, choices: dict, run_dir: Path, node: int) -> dict:
    previous = stored(run_dir) if node == 0 and not cfg.rerun else None
    if previous is not None:
        changed = changed_keys(previous.get("config"), plain)
        if previous.get("status") in COMPLETE and not changed:
            print(f"[skip] {name}: complete result in {run_dir} (rerun=true to run again)")
            return previous
        # output_dir=<a run directory>: never overwritten silently, unless this run continues it from its
        # checkpoints (checkpoint.resume: the worker refuses a checkpoint of another model, naming what differs)
        continues = bool(plain["checkpoint"]["resume"]) and previous.get("status") not in COMPLETE
        if changed and not in_multirun() and not continues:
            raise ConfigError("output_dir", f"{run_dir} holds a run with other {', '.join(changed)} "
                              f"(status {previous.get('status')})", "add rerun=true to replace it, or choose "
                              "another output_dir")
        if previous.get("status") in COMPLETE:
            print(f"[rerun] {name}: the stored result was measured with other {', '.join(changed)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    if node == 0:
        OmegaConf.save(OmegaConf.create(plain), run_dir / "config.yaml")
    if cfg.dry_run:
        print(f"[dry-run] {name}: config written to {run_dir / 'config.yaml'}")
        return {"status": "dry_run", "name": name, "run_dir": str(run_dir)}
    for stale in (run_dir / "ranks").glob("rank*.json") if node == 0 else ():
        stale.unlink()
    if node == 0:  # logger=wandb: the run's W&B name, group, job type and Hydra choices, for the worker
        write_identity(run_dir, plain["logger"], name, choices, hydra_overrides(), in_multirun())
    start = time.time()  # the workers' timelines are relative to this launch time
    log_path = run_dir / ("worker.log" if node == 0 else f"worker.node{node}.log")
    command = worker_command(plain, run_dir)
    env = worker_environment(plain)
    build_share_storage_ahead(plain, env)
    server = fork_server(env) if uses_fork_server(plain) else None
    with open(log_path, "a" if plain["checkpoint"]["resume"] else "w") as log:
        returncode = run_workers(command, env, log, server, run_dir if node == 0 else None).returncode
    if node:
        print(f"[node {node}] {name}: workers exited with code {returncode}; node 0 records {run_dir}")
        return {"status": "node", "node_rank": node, "name": name, "run_dir": str(run_dir)}
    launch_error = None
    if returncode:
        launch_error = f"workers exited with code {returncode}; see {log_path}"
    meta = {
        "name": name,
        "choices": choices,
        "overrides": hydra_overrides(),
        "run_dir": str(run_dir),
        "wall_s": time.time() - start,
        "launched": start,
        "launch_command": " ".join(command) if server is None else f"forked by the fork server (pid "
                          f"{server.proc.pid}) as: {' '.join(command)}",
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
    close_unfinished(plain["logger"], result)  # only a W&B run a killed worker left open; warns, never raises
    while RECEIVED:  # under Slurm's submitit launcher: its own handler requeues the job now
        signum, handler = RECEIVED.pop(0)
        if callable(handler):
            handler(signum, None)
    return result
