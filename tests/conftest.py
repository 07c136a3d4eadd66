"""Shared test helpers: compose real configs, and run megatron-core in this process on a CPU.

``compose(...)`` returns the resolved run config (a plain dict, exactly what a worker reads).
``megatron_world`` initializes a single-process gloo group once per session; ``train_in_process``
and ``gradients`` build a fresh ``Trainer`` on it (same parallel sizes: 1), so tests avoid the
seconds a subprocess start costs while running the same worker code; ``measured`` is ``gradients``
once a process per config, for the tests that share points.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

#: ``make test`` runs the suite on the CPU on every machine, as CI does: its unit tests compare CPU
#: numbers (bit-exact gradients, byte ledgers, one device for every tensor), and on an H200 164 of them
#: failed with the GPU visible. ``make test-gpu`` (``RECIPES_TEST_GPU=1 pytest -m gpu``) runs the
#: GPU-marked tests on the GPU. Hidden before anything asks torch for CUDA; subprocesses inherit it.
ON_GPU = os.environ.get("RECIPES_TEST_GPU") == "1"
if not ON_GPU:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402

#: One share of the cores per pytest-xdist worker (``make test``'s -n auto: one worker per core), for
#: the tests and the runs they start: by default each would take every core's thread (16 workers x 16
#: threads on an H200's host, where the suite had reached 26% after 380 s).
_THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONF = str(REPO / "conf")

from launch.torchrun import ONE_RANK_ENV  # noqa: E402  (after the repo is on sys.path)


def pytest_collection_modifyitems(items: list) -> None:
    """Under ``make test``'s workers (pytest-xdist, ``--dist loadgroup``) the GPU tests run one after
    another in one worker: they measure memory and time on a device the others would share."""
    hidden = pytest.mark.skipif(True, reason="a GPU test: make test runs the suite on the CPU; make test-gpu runs these")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.xdist_group("gpu"))
            if not ON_GPU:
                item.add_marker(hidden, append=False)


def subprocess_env() -> dict:
    """This environment without the single-process world other tests export (RANK, MASTER_PORT...)."""
    return {k: v for k, v in os.environ.items() if k not in ONE_RANK_ENV}


#: The train.py processes ``start_train`` started; ``_no_train_left_behind`` ends them after each test.
STARTED: list[subprocess.Popen] = []


@contextlib.contextmanager
def sigint_default():
    """SIGINT handled (Python's KeyboardInterrupt) while processes start, so they start with its default
    action. A shell starts a background job (this suite under ``nohup`` or ``&``) with SIGINT ignored,
    Python keeps that and a child inherits it: Ctrl-C sent to a train.py the suite started would do
    nothing, where a terminal's user would see it stop."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def start_train(args: list[str], cwd: Path, stderr: int = subprocess.PIPE) -> subprocess.Popen:
    """``train.py`` as a terminal would run it: its own session (Ctrl-C or a kill reaches the whole sweep
    through its group), SIGINT's default action (``sigint_default``), output captured (``stderr``:
    ``subprocess.STDOUT`` merges it). Its group is killed after the test if it still runs."""
    with sigint_default():
        proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env=subprocess_env(),
                                stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    STARTED.append(proc)
    return proc


@pytest.fixture(autouse=True)
def _no_train_left_behind():
    """A test that fails mid-sweep leaves no train.py running: a sweep of 100000-step points would take a
    core from the rest of the suite. Its workers and fork server die with it (``launch.process``)."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session", autouse=True)
def shared_fork_server(tmp_path_factory):
    """One fork server per pytest worker that the train.py runs of the tests fork their workers from
    (``RECIPES_FORK_SERVER``, launch/forkserver.py): it imports torch and megatron-core once, where each
    rank of each run would (9 CPU-s a rank on a 2-core machine: a two-rank run took 6.5 s with it,
    19.7 s through torchrun). Started under the environment a controller gives its workers, so every run
    with that environment uses it; a test that changes the environment, or needs processes of its own
    (``own_processes``), starts them as a user's run does. ``RECIPES_TEST_FORK_SERVER=0``: none."""
    if ON_GPU or os.environ.get("RECIPES_TEST_FORK_SERVER") == "0":
        yield None
        return
    from launch.forkserver import SHARED_SERVER_ENV
    from launch.process import start_group
    from recipes.run.workers import WORKER_PRELOAD, worker_environment

    path = tmp_path_factory.getbasetemp() / "fork-server.sock"
    path.unlink(missing_ok=True)
    os.environ[SHARED_SERVER_ENV] = str(path)
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # what train.py sets before it starts its workers
    env = {k: v for k, v in worker_environment(compose()).items() if k not in ONE_RANK_ENV}
    log = open(path.with_suffix(".log"), "w")
    proc = start_group([sys.executable, "-m", "launch.forkserver", "--listen", str(path), *WORKER_PRELOAD],
                       env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True)
    if not proc.stdout.readline().startswith("ready"):  # the runs start their own processes
        os.environ.pop(SHARED_SERVER_ENV)
    yield proc
    os.environ.pop(SHARED_SERVER_ENV, None)
    proc.kill()
    proc.wait()
    log.close()


@pytest.fixture
def own_processes(monkeypatch):
    """No shared fork server for this test's runs: it checks the processes a user's run starts."""
    from launch.forkserver import SHARED_SERVER_ENV

    monkeypatch.delenv(SHARED_SERVER_ENV, raising=False)


class SharedRuns:
    """Runs that several tests read, made once a session: a multi-process ``train.py`` run costs a
    process start a rank (imports of torch and megatron-core, seconds each), which a test that only
    reads the run's files need not pay again. Under pytest-xdist the workers share one directory and
    a lock, so the first worker to ask makes the run and the others wait for it."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def get(self, name: str, make):
        """The directory ``name``, made by ``make(directory)`` unless an earlier call completed it."""
        from filelock import FileLock

        path = self.root / name
        with FileLock(str(path) + ".lock", timeout=1800):
            if not (path / ".complete").exists():
                if path.exists():  # a run that failed: made again, so this test sees its failure
                    import shutil

                    shutil.rmtree(path)
                path.mkdir()
                make(path)
                (path / ".complete").touch()
        return path


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> SharedRuns:
    base = tmp_path_factory.getbasetemp()
    return SharedRuns((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared")


#: Composed configs of this process by overrides: Hydra's composition costs a few tenths of a second a
#: call on two cores, and the suite composes the same few configs hundreds of times.
_COMPOSED: dict[tuple[str, ...], dict] = {}


def compose(*overrides: str) -> dict:
    """The resolved config for these overrides, as the worker would read it (a copy of its own: tests
    edit what they get). Composed once a process from conf/; a test that points ``recipes.config`` at a
    copy of conf/ composes afresh."""
    import copy

    from recipes import config

    if Path(config.CONF_DIR) != Path(CONF):
        return config.compose_config(overrides)
    if overrides not in _COMPOSED:  # a refusal raises here each time: nothing kept
        _COMPOSED[overrides] = config.compose_config(overrides)
    return copy.deepcopy(_COMPOSED[overrides])


@pytest.fixture(scope="session")
def megatron_world():
    """A single-process gloo world with megatron's parallel state (all sizes 1)."""
    for key, value in ONE_RANK_ENV.items():  # MASTER_PORT 0: the store binds a free port itself
        os.environ.setdefault(key, value)
    from recipes.run.world import init_distributed

    init_distributed(compose())
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def build_trainer(cfg: dict):
    """A fresh Trainer for ``cfg`` (reseeded, so equal seeds give equal weights)."""
    from recipes.run.world import fresh_trainer

    return fresh_trainer(cfg)


def train_in_process(cfg: dict) -> dict:
    """Run the worker's measurement loop in this process; returns the rank result dict (its JSON)."""
    from recipes.results import RankResult
    from recipes.run.worker import train_and_measure
    from recipes.run.world import reseed

    reseed(cfg)
    result = RankResult(rank=0)
    train_and_measure(cfg, result)
    return result.as_dict()


#: ``measured`` results of this process by resolved config.
_MEASURED: dict[str, tuple] = {}


def measured(cfg: dict) -> tuple:
    """``gradients(cfg)``, measured once a process for each resolved config: the tests that compare
    options against one reference (a family's ``recompute=none`` and ``control``) or measure the same
    point (a label's ledger, its bit-exactness) share one forward-backward. A fresh Trainer gives the
    same step for the same config (reseeded; tests/test_determinism.py holds it bit for bit), so a
    shared result is the one a second build would measure. Read-only: the gradients are the cached
    tensors."""
    import json

    key = json.dumps(cfg, sort_keys=True)
    if key not in _MEASURED:
        _MEASURED[key] = gradients(cfg)
    loss, grads, ledger, counts = _MEASURED[key]
    return loss, dict(grads), dict(ledger), {k: dict(v) for k, v in counts.items()}


def gradients(cfg: dict, record_ledger: bool = True, before=None):
    """(loss, {param name: grad}, ledger bytes by kind, checkpoint counts) of one step, no update;
    ``before(trainer)`` runs first (to hook the built model)."""
    trainer = build_trainer(cfg)
    try:
        if before:
            before(trainer)
        loss = trainer.compute_gradients(record_ledger=record_ledger)
        grads = {
            name: p.grad.detach().clone()
            for chunk in trainer.chunks
            for name, p in chunk.named_parameters()
            if p.grad is not None
        }
        return loss, grads, dict(trainer.ledger.bytes_by_kind), trainer.counter.as_dict()
    finally:
        trainer.close()
