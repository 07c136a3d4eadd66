"""Preemption through submitit, without a cluster: Hydra's ``submitit_local`` launcher runs the point as a
submitit job, the test signals the job as Slurm does before its time limit (SIGUSR2, what submitit's
sbatch asks for), and the job saves a checkpoint, exits with submitit's requeue code, is started again
by submitit's local controller and resumes from the saved step to the end. Launcher values that would
break the job script are refused before anything is submitted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from conftest import CONF, start_train

from launch.process import PREEMPT_SIGNALS
from recipes.errors import ConfigError
from recipes.results import load_result


def test_the_signal_submitits_sbatch_asks_for_is_one_the_run_saves_on(tmp_path):
    """The script's ``--signal=<SIG>@<s>`` names a signal the controller forwards and the worker saves on."""
    from launch.slurm import sbatch_preview
    from recipes.run.worker import StopSignal

    hl = _hydra_config("launcher=slurm", "hydra.launcher.partition=gpu", f"hydra.sweep.dir={tmp_path}").hydra.launcher
    from omegaconf import OmegaConf

    script = sbatch_preview(OmegaConf.to_container(hl, resolve=True))
    (line,) = [l for l in script.splitlines() if l.startswith("#SBATCH --signal=")]
    name = "SIG" + line.split("=", 1)[1].split("@")[0]
    assert getattr(signal, name) in PREEMPT_SIGNALS and getattr(signal, name) in StopSignal.SIGNALS
    assert int(hl.max_num_timeout) > 0  # a job at its time limit is requeued, not ended


def _hydra_config(*overrides: str):
    from hydra import compose, initialize_config_dir

    from recipes.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize("override", [
    "hydra.launcher.partition='gpu\necho pwned'", "+hydra.launcher.comment='a\rb'",
    "hydra.launcher.setup=['source env\nrm -rf x']", "hydra.job.name='x\ty'",
])
def test_launcher_values_with_control_characters_are_refused_before_submitting(tmp_path, override):
    from launch.slurm import check_submission

    try:
        cfg = _hydra_config("launcher=slurm", f"hydra.sweep.dir={tmp_path}", override)
    except Exception as err:  # noqa: BLE001  the override grammar itself refused it: nothing reaches a script
        pytest.skip(f"Hydra's parser refuses {override!r} already: {err}")
    with pytest.raises(ConfigError) as err:
        check_submission(cfg, which=lambda name: f"/bin/{name}", run=lambda *a, **k: None)
    assert err.value.option.startswith("hydra.launcher.") and "control character" in str(err.value)
    assert err.value.fix


@pytest.mark.slow
def test_a_submitit_job_signalled_before_its_time_limit_saves_requeues_and_resumes(tmp_path):
    sweep = tmp_path / "sweep"
    iters = 60  # a few steps: the signal comes at the first progress row, the save ends the first start
    proc = start_train(["-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={sweep}",
                        "size=tiny", "measure.profile=none", "measure.start_step=2", "checkpoint=default",
                        "checkpoint.interval=100000", f"train.train_iters={iters}", "train.log_interval=1"],
                       tmp_path, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    run_dir = pid = None
    while time.monotonic() < deadline and proc.poll() is None:
        rows = list(sweep.glob("**/progress.jsonl"))
        if rows and rows[0].read_text().strip():
            run_dir = rows[0].parent
            pid = int((run_dir / ".lock").read_text())  # the job's process: submitit's task, our controller
            os.kill(pid, signal.SIGUSR2)  # what Slurm sends signal_delay_s before the time limit
            break
        time.sleep(0.02)
    out, _ = proc.communicate(timeout=240)
    assert run_dir is not None, out[-3000:]
    assert proc.returncode == 0, out[-3000:]
    result = load_result(run_dir)
    rank = result["ranks"][0]
    saved = rank["resumed_from"]["step"]  # the second start of the job resumed from the first's checkpoint
    assert result["status"] == "ok" and 1 <= saved < iters and rank["first_step"] == saved + 1
    assert len(rank["loss"]) == iters - saved
    log = (run_dir / "worker.log").read_text()
    assert f"[signal] SIGUSR2 at step {saved}: saving a checkpoint" in log
    assert f"[checkpoint] saved step {saved}" in log and f"resuming from {run_dir / 'checkpoints'}" in log
    submitit_logs = "".join(p.read_text() for p in (sweep / ".submitit").glob("**/*_log.*"))
    assert "Requeued job" in submitit_logs, submitit_logs[-3000:]
    steps = [json.loads(l)["step"] for l in (run_dir / "progress.jsonl").read_text().splitlines()]
    assert steps == list(range(1, iters + 1))  # every step once: the second start went on from the saved one


def test_the_worker_saves_on_each_preemption_signal():
    from recipes.run.worker import StopSignal

    for sig in PREEMPT_SIGNALS:
        stop = StopSignal().install()
        try:
            os.kill(os.getpid(), sig)
            assert stop.requested() == sig.name
        finally:
            for s in StopSignal.SIGNALS:
                signal.signal(s, signal.SIG_DFL)
    assert {signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2} <= set(PREEMPT_SIGNALS)
