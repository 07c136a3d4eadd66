"""How the controller starts a point's workers: their command (one process, or torchrun), their
environment, the fork server a sweep's points fork from, and the process group whose output it logs
and echoes and to which it forwards a preemption's signals."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from omegaconf import OmegaConf

from launch.forkserver import SHARED_SERVER_ENV, ForkServer, env_key
from launch.process import PREEMPT_SIGNALS, end_group, start_group
from launch.slurm import slurm_rendezvous
from launch.torchrun import ONE_RANK_ENV, torchrun_command
from recipes.config import typed
from recipes.files import REPO_ROOT
from recipes.run import multirun
from recipes.validate import gpu_count
from recipes.validate.run import DETERMINISTIC_ENV
from recipes.validate.share_storage import share_storage_labels


def worker_command(cfg: dict, run_dir: Path) -> list[str]:
    """torchrun for several processes; a single process is started directly (same environment)."""
    cfg = typed(cfg)
    launch = cfg.launcher
    if launch.nproc_per_node * launch.nnodes == 1:
        return [sys.executable, "-m", "recipes.run.worker", str(run_dir)]
    program = ["-m", "recipes.run.worker", str(run_dir)]
    if launch.name == "slurm":  # this node's torchrun; every node of the Slurm job starts one
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
    """Whether this point's workers fork from a fork server (``fork_server``, default on): a sweep's
    points on this machine, and every run when a shared server is named (``RECIPES_FORK_SERVER``). A
    point of several processes forks a rank group (``launch.forkserver``), on a CPU machine only: on GPUs
    its ranks start through torchrun until a rank group's NCCL start is measured there."""
    cfg = typed(cfg)
    launch = cfg.launcher
    if not cfg.get("fork_server") or launch.name != "local" or launch.nnodes != 1:
        return False
    if launch.nproc_per_node > 1 and gpu_count():
        return False
    return multirun.in_multirun() or bool(os.environ.get(SHARED_SERVER_ENV))


def fork_server(env: dict[str, str]) -> ForkServer | None:
    """The fork server for ``env``: the shared one ``RECIPES_FORK_SERVER`` names if it imported under
    ``env``, else (in a sweep) this controller's own, a new one when the environment changed (e.g. a
    point with ``measure.expandable_segments``); None, said once, when none can serve."""
    server = FORK_SERVER["server"]
    if server is not None and server.env_key != env_key(env):
        server.close()
        server = FORK_SERVER["server"] = None
    if server is not None:
        return server
    shared = os.environ.get(SHARED_SERVER_ENV)
    if shared and FORK_SERVER["failed"] is None:
        try:
            server = FORK_SERVER["server"] = ForkServer.connect(shared, env)
        except (RuntimeError, OSError) as err:
            print(f"[fork-server] {SHARED_SERVER_ENV}={shared} not used ({err})", flush=True)
    if server is None and multirun.in_multirun() and FORK_SERVER["failed"] is None:
        try:
            server = FORK_SERVER["server"] = ForkServer(WORKER_PRELOAD, env, str(REPO_ROOT))
        except (RuntimeError, OSError) as err:
            FORK_SERVER["failed"] = str(err)
            print(f"[fork-server] not used ({err}): each point starts its own process", flush=True)
            return None
    if server is not None:
        import atexit

        atexit.register(server.close)
    return server


def worker_environment(cfg: dict) -> dict[str, str]:
    cfg = typed(cfg)
    env = dict(os.environ)
    # each point's W&B run gets its own service process: not the one this controller may have started
    # (a killed worker's run would stay open in it, and the controller could not close it)
    env.pop("WANDB_SERVICE", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if cfg.parallel.tensor_model_parallel_size > 1:
        # megatron's tensor-parallel layers rely on one hardware queue to order their async all-gather
        # and reduce-scatter before the gradient GEMMs. Not set otherwise: one queue makes every stream
        # wait behind the others' work (activation offload's copies then stall compute: docs/offload.md)
        env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.launcher.nproc_per_node)))
    if cfg.measure.expandable_segments:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if cfg.train.deterministic:  # read once, as CUDA, cuBLAS and NCCL start (validate refused other values)
        for key, value in DETERMINISTIC_ENV.items():
            env.setdefault(key, value)
    if env.get("RANK") is None and cfg.launcher.nproc_per_node * cfg.launcher.nnodes == 1:
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
                run_dir: Path | None = None, nproc: int = 1) -> subprocess.CompletedProcess:
    """Start the workers (``command``, or with a fork ``server`` the ``nproc`` ranks forked for ``run_dir``), copy
    their output into ``log``, echo the live progress lines, and forward ``PREEMPT_SIGNALS`` (SIGTERM,
    SIGUSR1, SIGUSR2: a preemption, Slurm's time-limit warning) to them: they save a checkpoint at the next step boundary and exit, and
    this controller records the run as ``preempted``."""
    import signal

    # its own process group, killed with the controller (launch.process): no orphaned workers
    if server is not None:
        proc = server.spawn("recipes.run.worker:serve", [str(run_dir)], env, str(REPO_ROOT), nproc=nproc)
    else:
        proc = start_group(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                           text=True, bufsize=1)
    pid_file = run_dir / WORKER_PID if run_dir is not None else None
    if pid_file is not None:  # which process runs this point (a forked worker's command line is the server's)
        pid_file.write_text(f"{proc.pid}\n")
    forwarded = PREEMPT_SIGNALS

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


#: The background build of megatron's share_storage extension (one per controller process).
SHARE_STORAGE_BUILD: dict = {}


def build_share_storage_ahead(plain: dict, env: dict[str, str]) -> None:
    """On a GPU machine whose sweep (or run) has a point that recomputes through megatron's
    ``CheckpointWithoutOutput``, start building its ``share_storage`` extension now, beside the first
    points (``recipes.build.upstream.start_share_storage_build``; nothing when it is built)."""
    if SHARE_STORAGE_BUILD or not gpu_count():
        return
    sections = []
    if multirun.in_multirun():
        from hydra.core.hydra_config import HydraConfig

        try:
            sections = multirun.swept_recompute(plain, OmegaConf.load(Path(HydraConfig.get().sweep.dir) / "multirun.yaml"))
        except Exception:  # another sweeper plugin: this point still counts
            pass
    num_gpus = gpu_count()
    points = [plain, *({**plain, "recompute": section} for section in sections)]
    if any(share_storage_labels(point, num_gpus) for point in points):
        from recipes.build.upstream import start_share_storage_build  # lazy: torch, after validation

        SHARE_STORAGE_BUILD["process"] = start_share_storage_build(env)
