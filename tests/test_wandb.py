"""W&B streams from inside the run: rank 0 of the worker opens the run, logs every ``train.log_interval``
steps and every validation at the training step, and finishes it with the summary and the status.

Everything is offline (``logger.mode=offline``, the default): the tests read the run files W&B wrote
(``tests/wandb_files.py``), so they check what ``wandb sync`` would upload.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, compose, subprocess_env
from omegaconf import OmegaConf
from wandb_files import offline_runs

from recipes.analyze import logger
from recipes.files import write_json_atomic
from recipes.results import RankResult
from recipes.run import worker

#: What every progress interval logs on a CPU (perf/mfu and mem/peak_allocated_gib need a GPU).
CPU_KEYS = {"train/loss", "train/lr", "train/grad_norm", "perf/step_time_s", "perf/tokens_per_s"}


def _env() -> dict:
    """This environment for a subprocess: without the single-process world other tests export (RANK...)
    and without this process's W&B service (a process started with it would log through it)."""
    return {k: v for k, v in subprocess_env().items() if k != "WANDB_SERVICE"}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # whatever the config says, nothing leaves this machine
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small indexed dataset (byte tokenizer) with a validation split."""
    from recipes.data.preprocess import preprocess

    root = tmp_path_factory.mktemp("corpus")
    (root / "docs.jsonl").write_text("\n".join(json.dumps({"text": f"document {i}: " + "some words here. " * 30})
                                               for i in range(10)) + "\n")
    preprocess([root / "docs.jsonl"], str(root / "c"), append_eod=True, progress_interval=-1)
    return str(root / "c_text_document"), str(root / "cache")


def test_a_run_streams_every_interval_and_validation_at_its_step(corpus, megatron_world, tmp_path, capsys):
    """7 steps, a progress line every 3 (and at the last step), validation every 2: W&B rows at steps 2..7
    with the progress keys at 3, 6, 7 and val/loss at 2, 4, 6; one console line per interval."""
    prefix, cache = corpus
    cfg = compose("size=tiny", "logger=wandb", "data=indexed", f"data.paths=[{prefix}]", "data.split='80,20,0'",
                  f"data.cache_dir={cache}", "data.eval_interval=2", "data.eval_iters=1", "train.train_iters=7",
                  "train.log_interval=3", "measure.start_step=2", "measure.steps=2", "measure.profile=none")
    logger.write_identity(tmp_path, cfg["logger"], "standard_attn sdpa none", {"model": "standard_attn"}, [], False)
    run = logger.open_run(cfg, tmp_path, rank=0)
    assert run, "the W&B run did not open"
    result = RankResult(rank=0)
    worker.train_and_measure(cfg, result, tmp_path, logger=run)
    write_json_atomic(tmp_path / "ranks" / "rank0.json", result.as_dict())
    run.finish(worker.run_summary(tmp_path, cfg))

    progress = [l for l in capsys.readouterr().out.splitlines() if l.startswith("[progress]")]
    assert [l.split(" | ")[0] for l in progress] == ["[progress] step 3/7", "[progress] step 6/7",
                                                     "[progress] step 7/7"]
    (wb,) = _finished_runs(tmp_path)  # finished in this process: its exit record may land a moment later
    assert wb.name.startswith("standard_attn sdpa none ") and len(wb.name.split()[-1]) == 6
    assert wb.group == tmp_path.parent.name and wb.job_type == "train"
    assert wb.config["choices"] == {"model": "standard_attn"} and wb.config["train"]["train_iters"] == 7
    assert sorted(wb.history) == [2, 3, 4, 6, 7]
    for step in (3, 6, 7):
        assert CPU_KEYS <= set(wb.history[step]), (step, wb.history[step])
        assert "perf/mfu" not in wb.history[step]  # on a CPU there is no peak to compare with
    assert [s for s in sorted(wb.history) if "val/loss" in wb.history[s]] == [2, 4, 6]
    assert wb.history[6]["val/loss"] == result["eval_loss"][2]["loss"]
    assert wb.history[7]["train/loss"] == pytest.approx(result["loss"][-1])
    assert wb.history[7]["train/lr"] == result["lr"][-1]
    assert wb.summary["status"] == "ok" and wb.summary["perf/step_time_s"] == result["timing"]["step_time_s"]
    assert wb.summary["perf/host_wait_s"] == result["timing"]["host_wait_s"]  # near 0: a host-bound step
    assert "rank0/mem/peak_allocated_gib" in wb.summary or not torch.cuda.is_available()
    assert wb.exit_code == 0
    assert logger.read_identity(tmp_path)["finished"] is True


def test_progress_metrics_keep_their_names_on_a_gpu():
    row = {"step": 5, "loss": 2.0, "lr": 1e-4, "grad_norm": 0.5, "step_time_s": 0.1, "tokens_per_s": 9e4,
           "mfu": 0.4, "peak_allocated_gib": 20.5, "eta_s": 3.0, "val_loss": None}
    assert logger.interval_metrics(row) == {
        "train/loss": 2.0, "train/lr": 1e-4, "train/grad_norm": 0.5, "perf/step_time_s": 0.1,
        "perf/tokens_per_s": 9e4, "perf/mfu": 0.4, "mem/peak_allocated_gib": 20.5}


def test_names_are_unique_per_directory_and_group_the_sweep(tmp_path):
    sweep = tmp_path / "multirun" / "moe" / "size=h200"
    a = logger.run_identity({}, "moe sdpa none", sweep / "recompute=none", multirun=True)
    b = logger.run_identity({}, "moe sdpa none", sweep / "recompute=none__train.seed=2", multirun=True)
    assert a["name"] != b["name"] and a["name"].startswith("moe sdpa none ")
    assert a["group"] == b["group"] == "moe/size=h200" and a["job_type"] == "point"
    assert logger.run_identity({}, "moe sdpa none", sweep / "recompute=none", multirun=True) == a  # a re-run keeps it
    custom = logger.run_identity({"group": "g", "job_type": "bench"}, "x", tmp_path / "r", multirun=False)
    assert custom["group"] == "g" and custom["job_type"] == "bench"


def _failing_worker(tmp_path, monkeypatch, error: BaseException, *overrides: str) -> int:
    """worker.main with ``error`` raised where training would run (as tests/test_worker_faults.py does)."""
    cfg = compose("logger=wandb", *overrides)
    OmegaConf.save(OmegaConf.create(cfg), tmp_path / "config.yaml")
    logger.write_identity(tmp_path, cfg["logger"], "standard_attn sdpa none", {}, [], True)
    monkeypatch.setattr(worker, "init_distributed", lambda cfg, marks=None: None)
    monkeypatch.setattr(worker, "rank_coordinates", lambda: {"rank": 0, "tp": 0, "pp": 0, "cp": 0, "ep": 0, "dp": 0})

    def measure(cfg, result, run_dir=None, logger=None):
        logger.log({"train/loss": 6.0}, 1)
        raise error

    monkeypatch.setattr(worker, "train_and_measure", measure)
    monkeypatch.delenv("RANK", raising=False)
    return worker.main(str(tmp_path))


def test_an_oom_point_finishes_its_run_with_its_status(tmp_path, monkeypatch):
    code = _failing_worker(tmp_path, monkeypatch, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    (wb,) = _finished_runs(tmp_path)
    assert code == 3 and wb.exit_code == 3 and wb.job_type == "point"
    assert wb.summary["status"] == "oom" and wb.summary["error"].startswith("CUDA out of memory")
    assert wb.history == {1: {"train/loss": 6.0}}


def test_an_offline_run_keeps_its_config_and_summary_readable(tmp_path, monkeypatch):
    """wandb 0.31 offline writes only its transaction log: the config and the summary are also plain
    files where an online run has them (``files/config.yaml``, ``files/wandb-summary.json``)."""
    import yaml

    _failing_worker(tmp_path, monkeypatch, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    (files,) = [d / "files" for d in tmp_path.glob("wandb/offline-run-*")]
    config = yaml.safe_load((files / logger.OFFLINE_CONFIG).read_text())
    assert config["model"]["family"] == "standard_attn" and config["run_dir"] == str(tmp_path)
    summary = json.loads((files / logger.OFFLINE_SUMMARY).read_text())
    assert summary["status"] == "oom" and summary["error"].startswith("CUDA out of memory")


def test_a_cpu_run_s_summary_has_its_profiled_peak():
    """A CPU run has no allocator peaks: its memory figure in W&B is the profiled peak (profile=peak)."""
    rank = {"rank": 0, "status": "ok", "device": "cpu", "profile": {"peak_bytes": 3 * 2**20},
            "ledger": {"total_bytes": 2**20}}
    metrics = logger.run_metrics({"status": "ok", "worst_rank": 0, "ranks": [rank]})
    assert metrics["mem/profiled_peak_gib"] == metrics["rank0/mem/profiled_peak_gib"] == 3 / 1024
    assert "mem/peak_allocated_gib" not in metrics


KILLED = """
import json, os, sys, time
from pathlib import Path
from recipes.analyze import logger
progress = Path(sys.argv[1]) / "progress.jsonl"
progress.write_text(json.dumps({"step": 1, "loss": 7.0, "time": time.time() - 60}) + "\\n")  # an earlier process
run = logger.open_run(json.loads(sys.argv[2]), sys.argv[1], rank=0)
for step, loss in ((2, 6.0), (3, 5.5)):  # as Progress.log: W&B, then the row
    run.log({"train/loss": loss}, step, commit=True)
    with open(progress, "a") as f:
        f.write(json.dumps({"step": step, "loss": loss, "lr": 1e-3, "time": time.time()}) + "\\n")
os._exit(9)  # as the kernel's OOM killer ends a worker: no finish, W&B's buffer lost
"""


def _finished_runs(run_dir, wait_s: float = 20.0) -> list:
    """The offline runs with an exit record. W&B's service process writes the file: on a loaded machine
    (CI's two cores under pytest-xdist) the record can land a moment after ``finish`` returned."""
    deadline = time.monotonic() + wait_s
    while True:
        finished = [r for r in offline_runs(run_dir) if r.exit_code is not None]
        if finished or time.monotonic() > deadline:
            return finished
        time.sleep(0.25)


def test_a_killed_worker_s_run_is_closed_by_the_controller(tmp_path):
    """A worker killed mid-run never finishes its W&B run: the controller closes that same run (same id)
    with the merged result's status."""
    cfg = compose("logger=wandb")
    logger.write_identity(tmp_path, cfg["logger"], "standard_attn sdpa none", {}, [], True)
    done = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path), json.dumps(cfg)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 9, done.stderr
    result = {"run_dir": str(tmp_path), "status": "failed", "error": "workers exited with code -9", "ranks": []}
    assert logger.close_unfinished(cfg["logger"], result)
    run_id = logger.read_identity(tmp_path)["id"]
    # One W&B run in two directories; W&B appends -1 to the second when both start in the same second.
    dirs = sorted(path.name for path in tmp_path.glob("wandb/offline-run-*"))  # the killed one may be empty
    assert len(dirs) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", d) for d in dirs), dirs
    (wb,) = _finished_runs(tmp_path)
    assert wb.id == run_id and wb.exit_code == 1 and wb.summary["status"] == "failed"
    # the killed process's rows, re-logged from progress.jsonl (not the earlier process's step 1)
    assert wb.history == {2: {"train/loss": 6.0, "train/lr": 1e-3}, 3: {"train/loss": 5.5, "train/lr": 1e-3}}
    assert not logger.close_unfinished(cfg["logger"], result)  # once


def test_logging_failures_are_warnings_not_lost_results(tmp_path, monkeypatch, capsys):
    import wandb

    def broken(*args, **kwargs):
        raise RuntimeError("wandb.init failed: network")

    monkeypatch.setattr(wandb, "init", broken)
    cfg = compose("logger=wandb")
    assert not logger.open_run(cfg, tmp_path, rank=0)  # the do-nothing twin: training goes on
    assert "warning: W&B opening the run failed for" in capsys.readouterr().err

    class Run:
        summary: dict = {}

        def log(self, *args, **kwargs):
            raise OSError("disk full")

        def finish(self, exit_code=0):
            raise OSError("disk full")

    run = logger.WandbRun(Run(), tmp_path, "p")
    run.log({"train/loss": 1.0}, 1)
    run.log({"train/loss": 1.0}, 2)
    run.finish({"status": "ok", "ranks": []})
    err = capsys.readouterr().err
    assert err.count("warning: W&B logging failed for p (OSError: disk full)") == 1  # once, then quiet
    assert "warning: W&B finishing the run failed for p" in err


def test_only_rank_0_opens_a_run(tmp_path):
    assert not logger.open_run(compose("logger=wandb"), tmp_path, rank=1)
    assert not logger.open_run(compose("logger=none"), tmp_path, rank=0)
    assert not list(tmp_path.glob("wandb"))


#: What each point of ``wandb_sweep`` sets besides its recompute (none, full) and the logger.
WANDB_POINT = ("size=tiny", "train.train_iters=3", "measure.start_step=2", "profile=none")


def wandb_sweep(shared_runs) -> tuple[Path, dict]:
    """A two-point sweep with logger=wandb in ``multirun/s`` of a directory made once a session, and its
    exit code and output. Its points fork from the fork server (a sweep's default): tests/test_forkserver.py
    compares them with a point run in a process of its own (a sweep costs a fork server's imports)."""

    def make(path: Path) -> None:
        env = {**_env(), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}  # as the autouse fixture sets them
        done = subprocess.run([sys.executable, str(REPO / "train.py"), "-m", "recompute=none,full", *WANDB_POINT,
                               "logger=wandb", f"hydra.sweep.dir={path / 'multirun' / 's'}"], cwd=path, env=env,
                              capture_output=True, text=True, timeout=300)
        (path / "done.json").write_text(json.dumps({"returncode": done.returncode, "stdout": done.stdout,
                                                    "stderr": done.stderr}))

    path = shared_runs.get("wandb-sweep", make)
    return path / "multirun" / "s", json.loads((path / "done.json").read_text())


@pytest.mark.slow
def test_two_sweep_points_are_two_runs_in_one_group_and_the_report_is_one(shared_runs):
    """A real ``-m`` sweep with logger=wandb: each point's worker logs its own run (distinct names, the
    sweep's group, job type point); the report's run keeps one id however often the report is re-run."""
    from recipes.analyze import report

    sweep, done = wandb_sweep(shared_runs)
    assert done["returncode"] == 0, done["stdout"] + done["stderr"]
    assert done["stdout"].count("[progress] step 3/3") == 2  # the controller echoes each worker's line
    points = sorted(p.parent for p in sweep.glob("*/result.json"))
    runs = [offline_runs(p) for p in points]
    assert [len(r) for r in runs] == [1, 1], runs
    a, b = runs[0][0], runs[1][0]
    assert a.name != b.name and {a.name.rsplit(" ", 1)[0], b.name.rsplit(" ", 1)[0]} == {
        "standard_attn sdpa none", "standard_attn sdpa full"}
    assert a.group == b.group == "s" and a.job_type == b.job_type == "point"
    assert a.config["choices"]["recompute"] in ("none", "full")
    assert sorted(a.history) == [3] and CPU_KEYS <= set(a.history[3])
    assert a.summary["status"] == "ok" and a.exit_code == 0 == b.exit_code
    first = offline_runs(sweep)
    assert [r.job_type for r in first] == ["report"]
    # As a user re-runs it: its own process, whose exit closes W&B's service and so the run's file (read
    # in this process, the file could be read before W&B's service had written it; CI saw it empty once).
    rerun = subprocess.run([sys.executable, "-m", "recipes", "report", str(sweep)], cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    again = offline_runs(sweep)
    assert len(again) == 2 and again[0].id == again[1].id == report.report_run_id(Path(sweep))
