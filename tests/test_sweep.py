"""Sweeps end to end: real ``train.py -m`` subprocesses of the tiny model on a CPU.

A sweep is killed after its first point and re-run: the finished point is skipped, a worker crash
is recorded and the sweep goes on, and the report's table, CSV and plot come out at the end. Each
point costs a process start (~8 s), so the sweeps stay at three points and three steps.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, compose, start_train, subprocess_env

from launch.torchrun import ONE_RANK_ENV
from recipes.config import slug
from recipes.files import write_json_atomic
from recipes.results import load_result

TINY = ["size=tiny", "train.train_iters=3", "measure.start_step=2"]
SWEEP = ["-m", "sweep=standard_attn", "recompute=none,control,full", *TINY]
#: Same command, same directory: multirun/<sweep file>/<the command line's overrides>.
SWEEP_DIR = "multirun/standard_attn/" + slug("measure.start_step=2,recompute=none,control,full,size=tiny,train.train_iters=3")


def point(recompute: str) -> str:
    """A point's directory, named as Hydra's sweep subdir names it: the swept key first (cut at 64
    characters, with its hash)."""
    return slug(f"recompute={recompute},measure.start_step=2,size=tiny,train.train_iters=3")


def test_names_lead_with_what_the_sweep_sweeps(tmp_path):
    """A long point name cut at 64 characters keeps the swept value; the sweep's name (its W&B group)
    says what it sweeps and what it fixes, not one point's values."""
    sweep_name = slug("data.eval_interval=6,model=moe,recompute=none,selective/moe_act,full")
    assert sweep_name == "recompute=none,selective.moe_act,full__data.eval_interval=6__model=moe"
    master = tmp_path / "multirun.yaml"
    master.write_text("hydra:\n  overrides:\n    task: [model=moe, 'recompute=none,selective/moe_act,full', "
                      "data.eval_interval=6, measure.start_step=3, train.train_iters=12]\n  sweeper:\n    params: null\n")
    long = "data.eval_interval=6,measure.start_step=3,model=moe,recompute=selective/moe_act,train.train_iters=12"
    name = slug(long, str(tmp_path))
    assert name.startswith("recompute=selective.moe_act__data.eval_interval=6") and len(name) <= 64
    assert slug(long.replace("selective/moe_act", "full"), str(tmp_path)) != name
    # a sweep file's swept keys (hydra.sweeper.params) lead too
    master.write_text("hydra:\n  overrides:\n    task: [size=h200]\n  sweeper:\n    params: {recompute: 'none,full'}\n")
    assert slug("recompute=full,size=h200", str(tmp_path)) == "recompute=full__size=h200"
    assert slug("model=moe,recompute=full", str(tmp_path)) == "recompute=full__model=moe"
    # a point a sweep ran before the swept keys led keeps its directory: the same command resumes it
    (tmp_path / "model=moe__recompute=none").mkdir()
    assert slug("model=moe,recompute=none", str(tmp_path)) == "model=moe__recompute=none"
    # names without a sweep are as before
    assert slug("recompute=selective/core_attn,size=h200") == "recompute=selective.core_attn__size=h200"


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    """``train.py`` in its own session (so the whole sweep can be killed), its output in one stream."""
    return start_train(args, cwd, stderr=subprocess.STDOUT)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 120.0):
    """Poll ``condition()`` until it returns something truthy; fail if the sweep ends first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        assert proc.poll() is None, f"sweep ended early:\n{proc.stdout.read()}"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail("timed out waiting for the sweep")


def worker_pid(run_dir: Path) -> int | None:
    """The pid of the worker process started for ``run_dir``: the controller's ``worker.pid`` there (a
    worker forked by the fork server has the server's command line), else the process whose command
    line names the directory."""
    try:
        pid = int((run_dir / "worker.pid").read_text())
        if Path(f"/proc/{pid}").exists():
            return pid
    except (OSError, ValueError):
        pass
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"recipes.run.worker" in cmdline and str(run_dir).encode() in cmdline:
                return int(proc.name)
    return None


def test_sweep_survives_kill_and_crash_and_resumes(tmp_path):
    sweep = tmp_path / SWEEP_DIR
    first = sweep / point("none") / "result.json"
    # 1. Killed (the whole process group) right after the first point finished.
    proc = start(SWEEP, tmp_path)
    wait_for(first.exists, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert load_result(first)["status"] == "ok"
    stamp = first.stat().st_mtime_ns
    # 2. Same command: the finished point is skipped; the control's worker dies (SIGKILL, as the
    #    kernel's OOM killer would), which is recorded as failed, and the sweep goes on to full.
    proc = start(SWEEP, tmp_path)
    os.kill(wait_for(lambda: worker_pid(sweep / point("control")), proc), signal.SIGKILL)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1, out  # a point failed: the sweep says so, after writing its report
    assert first.stat().st_mtime_ns == stamp and out.count("[skip]") == 1
    assert "[point 1/3] standard_attn sdpa none" in out and "[point 3/3]" in out and "ETA" in out
    results = {r: load_result(sweep / point(r)) for r in ("none", "control", "full")}
    assert {r: x["status"] for r, x in results.items()} == {"none": "ok", "control": "failed", "full": "ok"}
    assert "exited with code -9" in results["control"]["error"]
    full = results["full"]["ranks"][0]
    none = results["none"]["ranks"][0]
    assert full["ledger"]["total_bytes"] < none["ledger"]["total_bytes"]  # real measurements
    md = (sweep / "report.md").read_text()
    assert "standard_attn sdpa full" in md and "failed" in md and "ledger vs control" in md
    csv_rows = (sweep / "report.csv").read_text().splitlines()
    assert len(csv_rows) == 4 and csv_rows[0].startswith("point,rank,worst")
    png = (sweep / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    if any(r["ranks"] and r["ranks"][0].get("profile") for r in results.values()):  # profile=peak
        assert (sweep / "timelines.png").stat().st_size > 10_000 and "timelines.png" in md


def test_same_command_same_directory(tmp_path):
    """Dry-run sweeps (no workers): the directory follows the command, rerun/logger do not move it,
    and a stored result counts only if it was measured with the same config."""
    args = [sys.executable, str(REPO / "train.py"), "-m", "sweep=moe", "recompute=none,selective/moe_act",
            "measure.repeat=0", "dry_run=true"]  # one process a point (sweep=moe repeats each 3 times)
    done = subprocess.run([*args, "rerun=true"], cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    sweep = tmp_path / "multirun/moe/recompute=none,selective.moe_act__measure.repeat=0"  # swept values first
    points = sorted(p.parent for p in sweep.glob("*/config.yaml"))
    assert [p.name for p in points] == ["recompute=none__measure.repeat=0", "recompute=selective.moe_act__measure.repeat=0"]
    for point in points:  # results as if measured; the second one with another seed
        config = yaml.safe_load((point / "config.yaml").read_text())
        config["train"]["seed"] += "moe_act" in point.name
        write_json_atomic(point / "result.json", {"name": point.name, "status": "ok", "config": config, "ranks": []})
    done = subprocess.run([*args, "logger=wandb"], cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [p.name for p in (tmp_path / "multirun").glob("*/*")] == [sweep.name]
    assert "[skip] moe sdpa none" in done.stdout
    assert "[rerun] moe sdpa selective/moe_act: the stored result was measured with other train" in done.stdout


def test_unknown_option_in_a_sweep_file_fails_before_any_point(tmp_path):
    (tmp_path / "conf/sweep").mkdir(parents=True)
    (tmp_path / "conf/sweep/bad.yaml").write_text(
        "# @package _global_\nhydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n"
        "      recompute: none,selective/no_such_label\n")
    done = subprocess.run([sys.executable, str(REPO / "train.py"), "sweep=bad", *TINY,
                           f"hydra.searchpath=[file://{tmp_path / 'conf'}]", f"hydra.sweep.dir={tmp_path / 'out'}"],
                          cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "selective/no_such_label" in done.stderr
    assert not list(tmp_path.rglob("result.json")) and not list(tmp_path.rglob("config.yaml"))


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "conf/sweep").glob("*.yaml")))
def test_every_sweep_point_composes_and_validates(name):
    """Each sweep file names real options, and each of its points passes the pre-launch checks."""
    from recipes.validate import validate

    params = yaml.safe_load((REPO / f"conf/sweep/{name}.yaml").read_text())["hydra"]["sweeper"]["params"]
    assert "none" in params["recompute"].split(",") and "control" in params["recompute"].split(",")
    keys = list(params)
    for values in itertools.product(*(str(params[k]).split(",") for k in keys)):
        cfg = compose(f"sweep={name}", *(f"{k}={v}" for k, v in zip(keys, values)))
        validate(cfg)


def test_make_sweep_runs_the_sweep_file():
    if subprocess.run(["which", "make"], capture_output=True).returncode:
        pytest.skip("make is not installed")
    done = subprocess.run(["make", "-n", "sweep", "SWEEP=moe", "ARGS=train.seq_length=128"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "train.py -m sweep=moe size=tiny train.seq_length=128" in done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="a real out-of-memory needs a GPU")
def test_gpu_oom_is_recorded_and_the_sweep_goes_on(tmp_path):
    """A memory cap far below the tiny model's needs: that point is ``oom`` with the allocator's
    numbers, the next point runs, and the advisor counts the oom point as not fitting."""
    from recipes.analyze import advise, candidates

    done = subprocess.run([sys.executable, str(REPO / "train.py"), "-m", "measure.memory_fraction=0.00001,null",
                           *TINY, f"hydra.sweep.dir={tmp_path}"], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    results = {r["config"]["measure"]["memory_fraction"]: r for r in
               (load_result(p) for p in tmp_path.glob("*/result.json"))}
    assert results[0.00001]["status"] == "oom" and results[None]["status"] == "ok"
    assert results[0.00001]["ranks"][0]["memory_at_failure"]["reserved_gib"] is not None
    advice = advise.advise(candidates.measured_candidates(tmp_path), budget_gib=100)
    assert advice["choice"]["status"] == "ok"
    assert [c["status"] for c in advice["not_fitting"]] == ["oom"]
    assert (tmp_path / "report.png").stat().st_size > 10_000


def _bench_entrypoint():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_entrypoint", REPO / "benchmarks" / "bench_entrypoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_entrypoint_repeats_alternate_fresh_processes(monkeypatch, capsys):
    """`bench_entrypoint.py --repeats 2`: two pairs, each a train.py run then a bare loop, and the median
    ratio (the H200 showed that one MoE pair is not enough to resolve 2%). Each side's process is checked
    in test_bench_entrypoint_sides_run_in_fresh_processes; here, the order and the table."""
    bench = _bench_entrypoint()
    calls = []
    monkeypatch.setattr(bench, "entrypoint", lambda o, s, w: calls.append("train.py") or {
        "ranks": [{"timing": {"step_time_s": 0.011, "step_time_min_s": 0.010}}]})
    monkeypatch.setattr(bench, "bare_in_subprocess", lambda o, s, w: calls.append("bare") or (0.010, 0.010))
    monkeypatch.setattr(sys, "argv", ["bench_entrypoint.py", "recompute=none", "--repeats", "2", "--steps", "2"])
    bench.main()
    out = capsys.readouterr().out
    assert calls == ["train.py", "bare"] * 2
    assert [line.split(" | ")[3] for line in out.splitlines() if line.startswith(("| 1 |", "| 2 |"))] == ["1.100"] * 2
    assert "median ratio 1.100 over 2 pairs" in out


@pytest.mark.slow
def test_bench_entrypoint_sides_run_in_fresh_processes(monkeypatch):
    """Each side of a pair in its own process, timing its steps: train.py (its result's step times) and the
    bare loop (``--bare-only``). The inherited MASTER_PORT is held by a live listener, as a test session's
    or torchrun's is: the bare loop must not reuse it."""
    import socket

    bench = _bench_entrypoint()
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    for key in ONE_RANK_ENV:  # the single-process world other tests export: the bench's processes are their own
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    timing = bench.entrypoint(["recompute=none"], steps=2, warmup=1)["ranks"][0]["timing"]
    assert timing["step_time_s"] > 0 and timing["step_time_min_s"] > 0
    monkeypatch.setenv("MASTER_PORT", str(held.getsockname()[1]))
    median, fastest = bench.bare_in_subprocess(["recompute=none"], steps=2, warmup=1)
    assert median >= fastest > 0


@pytest.mark.parametrize("args,says", [
    (["--repeats", "2", "--kernels"], "without --repeats"),  # --kernels acts on one process's bare loop
    (["--repeats", "four"], "e.g. --repeats 4"),
    (["--repeats"], "e.g. --repeats 4"),
    (["--steps", "0"], "e.g. --steps 4"),
])
def test_bench_entrypoint_refuses_bad_arguments_by_name(args, says):
    proc = subprocess.run([sys.executable, "benchmarks/bench_entrypoint.py", *args],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--" in proc.stderr and says in proc.stderr, proc.stderr[-500:]


def test_a_sweep_knows_every_points_recompute_before_its_first():
    """The controller reads the whole sweep's recompute options from multirun.yaml (the sweep file's
    params and the command line), so the first point can start what a later one needs."""
    from omegaconf import OmegaConf

    from recipes.run.multirun import swept_recompute
    from recipes.validate.share_storage import share_storage_labels

    plain = compose("recompute=none")
    master = OmegaConf.create({"hydra": {"sweeper": {"params": {"recompute": "none,control,selective/mlp,full"}},
                                         "overrides": {"task": ["size=tiny", "recompute.mlp_replays_fc2=false"]}}})
    sections = swept_recompute(plain, master)
    assert [s["recompute_granularity"] for s in sections] == [None, "selective", "selective", "full"]
    assert [share_storage_labels({**plain, "recompute": s}, 1) for s in sections] == [[], [], ["mlp"], []]
    replays_fc2 = OmegaConf.create({"hydra": {"sweeper": {"params": {"recompute": "selective/mlp"}},
                                              "overrides": {"task": ["recompute.mlp_replays_fc2=true"]}}})
    assert [share_storage_labels({**plain, "recompute": s}, 1) for s in swept_recompute(plain, replays_fc2)] == [[]]


@pytest.mark.parametrize("recompute,gpus,started", [("selective/mlp", 1, True), ("selective/moe_act-layernorm", 1, True),
                                                    ("none", 1, False), ("full", 1, False),
                                                    ("selective/mlp", 0, False)])
def test_a_gpu_run_that_recomputes_without_output_builds_megatrons_extension_ahead(monkeypatch, recompute, gpus,
                                                                                     started):
    from recipes.build import upstream
    from recipes.run import workers

    calls = []
    monkeypatch.setattr(workers, "SHARE_STORAGE_BUILD", {})
    monkeypatch.setattr(workers, "gpu_count", lambda: gpus)
    monkeypatch.setattr(upstream, "start_share_storage_build", lambda env: calls.append(env) or "proc")
    plain = compose(f"recompute={recompute}")
    workers.build_share_storage_ahead(plain, {"X": "1"})
    workers.build_share_storage_ahead(plain, {"X": "1"})  # once a controller
    assert calls == ([{"X": "1"}] if started else [])
