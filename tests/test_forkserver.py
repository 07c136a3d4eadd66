"""The fork server (launch/forkserver.py): a fresh child per request with the request's environment,
directory and output; exit codes as subprocess reports them; its children die with it; it refuses to
serve after CUDA or a thread started; sweep points forked from it measure what their own processes do."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
from conftest import REPO
from test_faults import alive, gone_within, train
from test_wandb import WANDB_POINT, wandb_sweep

from launch.forkserver import SHARED_SERVER_ENV, ForkServer, env_key
from launch.process import end_group

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    p for p in [str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH")] if p))


@pytest.fixture(scope="module")
def server():
    server = ForkServer(["forkserver_targets"], ENV, str(REPO))
    yield server
    server.close()


def test_a_child_gets_the_requests_environment_directory_and_output(server, tmp_path):
    proc = server.spawn("forkserver_targets:hello", ["hi", "3"], dict(ENV, POINT="p1"), str(tmp_path))
    out = proc.stdout.read()
    assert proc.wait(timeout=30) == 3
    assert f"hi from {proc.pid} in {tmp_path} with p1" in out and "to stderr" in out
    assert proc.pid != server.proc.pid
    again = server.spawn("forkserver_targets:hello", ["again", "0"], dict(ENV, POINT="p2"), str(tmp_path))
    assert "with p2" in again.stdout.read() and again.wait(timeout=30) == 0 and again.pid != proc.pid


def test_ending_a_childs_group_ends_what_it_started(server, tmp_path):
    proc = server.spawn("forkserver_targets:sleep_with_a_child", ["60"], ENV, str(tmp_path))
    grandchild = int(proc.stdout.readline().split()[1])
    assert proc.poll() is None and alive(grandchild)
    assert os.getsid(proc.pid) == proc.pid  # its own session and process group, as start_group makes
    end_group(proc, grace_s=5)
    assert proc.returncode == -signal.SIGTERM
    assert gone_within(grandchild, 10)


def test_the_server_ends_without_the_interpreters_teardown(tmp_path):
    """Closing the server ends it with os._exit: the controller waits for that exit at the end of every
    sweep, and a teardown of torch and megatron would add its seconds there."""
    mark = tmp_path / "torn_down"
    server = ForkServer(["forkserver_targets:mark_teardown"], dict(ENV, TEARDOWN_MARK=str(mark)), str(REPO))
    server.close()
    assert server.proc.returncode == 0 and not mark.exists()


def test_a_child_dies_with_the_server(tmp_path):
    server = ForkServer(["forkserver_targets"], ENV, str(REPO))
    proc = server.spawn("forkserver_targets:sleep_with_a_child", ["60"], ENV, str(tmp_path))
    proc.stdout.readline()
    os.kill(server.proc.pid, signal.SIGKILL)
    assert gone_within(proc.pid, 10), "a forked worker outlived its server"
    assert proc.wait(timeout=10) == -9  # what the controller records: killed
    server.close()


@pytest.mark.parametrize("preload,reason", [
    ("forkserver_targets:start_a_thread", r"runs threads \(\d+, \d+ after import torch; new: [^,]+ x1\)"),
    ("forkserver_targets:initialize_cuda", "CUDA is initialized"),
    ("no_such_module", "preloading failed: ModuleNotFoundError"),
])
def test_it_refuses_to_serve_what_a_fork_would_break(preload, reason):
    with pytest.raises(RuntimeError, match=reason):
        ForkServer([preload], ENV, str(REPO))


def test_the_thread_baseline_includes_what_cuda_is_available_starts(monkeypatch):
    """megatron-core asks ``torch.cuda.is_available()`` at import; on a GPU machine (with the server's
    PYTORCH_NVML_BASED_CUDA_CHECK=1) that starts NVML's thread. The server asks first and counts it
    in the baseline, so the refusal catches only threads the imports start beyond it."""
    import threading
    from collections import Counter

    import torch

    from launch import forkserver

    asked = []
    # the server runs no Python thread but its main one; this test's process runs pytest's and others'
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or True)
    monkeypatch.setattr(forkserver, "_threads", lambda: Counter(python=16, nvml=len(asked)))
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 1)
    assert forkserver._preload([])["nvml"] == 1
    assert forkserver._unsafe(Counter(python=16, nvml=1)) is None
    # without NVML is_available would initialize the driver: not asked, so its thread is refused later
    asked.clear()
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)
    assert forkserver._preload([])["nvml"] == 0 and not asked


@pytest.mark.gpu
def test_a_forked_child_uses_cuda_after_megatron_is_imported(tmp_path):
    """On a GPU: the server imports megatron-core (which asks for CUDA at import) and a child forked
    from it still creates its own CUDA context."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    server = ForkServer(["forkserver_targets", "megatron.core"], ENV, str(REPO))
    try:
        proc = server.spawn("forkserver_targets:use_cuda", [], ENV, str(tmp_path))
        out = proc.stdout.read()
        assert proc.wait(timeout=120) == 0 and "cuda 4.0" in out, out
    finally:
        server.close()


def test_a_rank_group_runs_its_ranks_in_one_world_as_torchrun_would(server, tmp_path):
    """nproc=3: three ranks with torchrun's environment meet at the group's store (a gloo all-reduce of
    the ranks sums to 3); the group exits with the failing rank's code once all have ended."""
    proc = server.spawn("forkserver_targets:all_reduce", ["2"], ENV, str(tmp_path), nproc=3)
    out = proc.stdout.read()
    assert proc.wait(timeout=60) == 7, out
    assert sorted(line for line in out.splitlines() if line.startswith("rank ")) == [
        f"rank {r}/3 local {r} sum 3" for r in range(3)]


def test_a_failed_rank_stops_the_others_and_signals_reach_every_rank(server, tmp_path):
    """As torchrun: one rank's failure (exit 5) ends the others with SIGTERM, and the group exits 5;
    a SIGTERM to the group (the controller forwarding a preemption) reaches each rank."""
    proc = server.spawn("forkserver_targets:wait_for_a_signal", ["1"], ENV, str(tmp_path), nproc=2)
    out = proc.stdout.read()
    assert proc.wait(timeout=60) == 5, out
    assert "rank 0 got SIGTERM" in out and re.search(r"rank 1 \(pid \d+\) ended with exit code 5: stopping the other 1", out)
    proc = server.spawn("forkserver_targets:wait_for_a_signal", ["none"], ENV, str(tmp_path), nproc=2)
    assert [proc.stdout.readline().split()[2] for _ in range(2)] == ["ready"] * 2
    proc.send_signal(signal.SIGTERM)
    out = proc.stdout.read()
    assert proc.wait(timeout=60) == 0 and "rank 0 got SIGTERM" in out and "rank 1 got SIGTERM" in out


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A shared server (--listen) as tests/conftest.py starts one, under ``ENV``."""
    import subprocess
    import sys

    path = tmp_path_factory.mktemp("shared") / "s.sock"
    proc = subprocess.Popen([sys.executable, "-m", "launch.forkserver", "--listen", str(path), "forkserver_targets"],
                            env=ENV, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("ready"), proc.stderr.read()
    yield path, proc
    proc.kill()
    proc.wait()


def test_a_shared_server_serves_its_environment_and_names_what_differs(shared, tmp_path):
    path, _ = shared
    client = ForkServer.connect(str(path), dict(ENV, MASTER_PORT="1", WANDB_MODE="disabled"))
    proc = client.spawn("forkserver_targets:hello", ["hi", "0"], dict(ENV, POINT="p1"), str(tmp_path))
    assert "with p1" in proc.stdout.read() and proc.wait(timeout=30) == 0
    client.close()
    with pytest.raises(RuntimeError, match="imported under another environment .*OMP_NUM_THREADS"):
        ForkServer.connect(str(path), dict(ENV, OMP_NUM_THREADS="7"))
    with pytest.raises(RuntimeError, match="no fork server at"):
        ForkServer.connect(str(tmp_path / "none.sock"), ENV)


def test_a_shared_servers_child_dies_with_its_controllers_connection(shared, tmp_path):
    """A shared server outlives its controllers: when one dies (its connection closes), the worker it
    had forked is killed, as a controller's own server's would die with it."""
    path, server = shared
    client = ForkServer.connect(str(path), ENV)
    proc = client.spawn("forkserver_targets:sleep_with_a_child", ["60"], ENV, str(tmp_path))
    grandchild = int(proc.stdout.readline().split()[1])
    client.sock.close()  # what the kernel does to a killed controller's socket
    assert gone_within(proc.pid, 10) and gone_within(grandchild, 10)
    assert server.poll() is None


def test_a_server_is_reused_only_for_the_same_environment():
    assert env_key(dict(ENV, MASTER_PORT="1")) == env_key(dict(ENV, MASTER_PORT="2", WANDB_MODE="disabled"))
    assert env_key(dict(ENV, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")) != env_key(ENV)


@pytest.mark.slow
def test_forked_points_measure_what_their_own_processes_do(tmp_path, shared_runs):
    """A two-point sweep forked (tests/test_wandb.py's, which logs to W&B: that touches none of the
    numbers compared), its second point again in a process of its own: equal losses and ledgers (a CPU
    is deterministic); forked, the second point starts without imports, and every point says how it
    was started."""
    sweep, done = wandb_sweep(shared_runs)
    assert done["returncode"] == 0, done["stdout"] + done["stderr"]
    alone = train(["-m", "recompute=full", *WANDB_POINT, "fork_server=false", f"hydra.sweep.dir={tmp_path / 'own'}"],
                  tmp_path, timeout=300)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    results = {}
    for flag, path in (("true", sweep), ("false", tmp_path / "own")):
        results[flag] = {r["name"]: r for r in (json.loads(p.read_text()) for p in path.glob("*/result.json"))}
        assert not list(path.glob("*/worker.pid"))  # removed once the worker is done
    assert len(results["true"]) == 2 and len(results["false"]) == 1 and results["false"].keys() <= results["true"].keys()
    for name, own in results["false"].items():
        forked = results["true"][name]
        assert forked["ranks"][0]["loss"] == own["ranks"][0]["loss"] and forked["ranks"][0]["grad_norm"] == own["ranks"][0]["grad_norm"]
        assert forked["ranks"][0]["ledger"] == own["ranks"][0]["ledger"]
        assert forked["launch_command"].startswith("forked by the fork server")
        assert not own["launch_command"].startswith("forked")
    from recipes.run.console import time_breakdown

    starts = sorted(time_breakdown(r)["start+imports"] + time_breakdown(r)["megatron imports"]
                    for r in results["true"].values())
    assert starts[0] < 1.0  # forked
    if not os.environ.get(SHARED_SERVER_ENV):  # else both forked from the test session's shared server
        assert starts[1] > 1.0  # the first point started the controller's server


def fork_servers_of(controller: int) -> list[int]:
    """The fork servers ``controller`` started (test_faults kills one's controller with -9 and checks
    that its server and worker die with it)."""
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _is_server_of(p, controller)]


def _is_server_of(proc: Path, parent: int) -> bool:
    try:
        stat = (proc / "stat").read_text()
        return b"launch.forkserver" in (proc / "cmdline").read_bytes() and int(stat.split(") ")[1].split()[1]) == parent
    except (OSError, IndexError, ValueError):
        return False


def test_only_sweep_points_of_one_local_process_fork(monkeypatch):
    from conftest import compose

    from recipes.run import multirun, workers

    monkeypatch.setattr(multirun, "in_multirun", lambda: True)
    assert workers.uses_fork_server(compose())
    assert not workers.uses_fork_server(compose("fork_server=false"))
    assert workers.uses_fork_server(compose("parallel=dp2"))  # a rank group, on a CPU machine
    monkeypatch.setattr(workers, "gpu_count", lambda: 8)
    assert not workers.uses_fork_server(compose("parallel=dp2"))  # torchrun on GPUs
    assert workers.uses_fork_server(compose())
    monkeypatch.setattr(multirun, "in_multirun", lambda: False)
    monkeypatch.delenv(SHARED_SERVER_ENV, raising=False)
    assert not workers.uses_fork_server(compose())  # one run: nothing to share the imports with
    monkeypatch.setenv(SHARED_SERVER_ENV, "/tmp/s.sock")
    assert workers.uses_fork_server(compose())  # unless a shared server is named
    assert not workers.uses_fork_server(compose("launcher=slurm"))
