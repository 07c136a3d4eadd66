"""Extending a finished run and re-running one are one obvious command each: raising train.train_iters
with checkpoints continues the saved run (its schedule too: tests/test_checkpoint.py compares the learning
rate with an uninterrupted run's), rerun=true replaces the run, its result and checkpoints included."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, compose, subprocess_env

from recipes.errors import ConfigError
from recipes.results import load_result


def _finished(tmp_path, save: bool = True):
    """A run directory holding a finished 4-step run (its result; a checkpoint of step 4 when ``save``)."""
    from recipes.run.checkpoint import FORMAT
    from recipes.run.manifest import trust

    run = tmp_path / "run"
    cfg = compose("checkpoint=default", "train.train_iters=4")
    if save:
        ckpt = run / "checkpoints" / "step_00000004"
        ckpt.mkdir(parents=True)
        (ckpt / "meta.json").write_text(json.dumps({"format": FORMAT, "step": 4}))
        trust(ckpt)
    run.mkdir(exist_ok=True)
    (run / "progress.jsonl").write_text('{"step": 4}\n')
    return run, {"status": "ok", "config": cfg}


def test_raising_train_iters_on_a_finished_run_continues_it_and_says_what_is_kept(tmp_path, capsys):
    from recipes.run.controller import extension

    run, previous = _finished(tmp_path)
    assert extension(previous, compose("checkpoint=default", "train.train_iters=8"), run, "x")
    out = capsys.readouterr().out
    assert "[extend] x: continuing" in out and "from step_00000004 to train.train_iters=8 (was 4)" in out
    assert "kept: its checkpoints, progress.jsonl" in out and "replaced at the end: result.json" in out
    # not an extension: fewer steps, another change, no checkpoints asked for
    assert not extension(previous, compose("checkpoint=default", "train.train_iters=3"), run, "x")
    assert not extension(previous, compose("checkpoint=default", "train.train_iters=8", "train.lr=1e-3"), run, "x")
    assert not extension(previous, compose("train.train_iters=8"), run, "x")


def test_extending_a_run_that_kept_no_checkpoint_is_refused_with_the_fix(tmp_path):
    from recipes.run.controller import extension

    run, previous = _finished(tmp_path, save=False)
    with pytest.raises(ConfigError) as err:
        extension(previous, compose("checkpoint=default", "train.train_iters=8"), run, "x")
    assert err.value.option == "train.train_iters" and "kept no checkpoint" in str(err.value)
    assert "rerun=true trains it again from step 0" in err.value.fix


def test_rerun_replaces_the_result_progress_and_checkpoints(tmp_path, capsys):
    from recipes.run.controller import replace

    run, _ = _finished(tmp_path)
    (run / "result.json").write_text("{}")
    (run / "notes.txt").write_text("mine")
    replace(compose("checkpoint=default"), run, "x")
    out = capsys.readouterr().out
    assert "[rerun] x: replacing" in out and "1 checkpoint(s) are deleted; training starts at step 0" in out
    assert not list((run / "checkpoints").iterdir()) and not (run / "progress.jsonl").exists()
    assert (run / "notes.txt").read_text() == "mine"  # nothing else is touched


@pytest.mark.slow
def test_one_command_extends_a_finished_run(tmp_path):
    base = ["size=tiny", "measure.profile=none", "measure.start_step=2", "checkpoint=default", "train.log_interval=0",
            "train.lr=1e-3", "train.min_lr=1e-4", "train.lr_decay_style=cosine", "train.lr_warmup_iters=2",
            f"output_dir={tmp_path / 'run'}"]

    def launch(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO / "train.py"), *base, *extra], cwd=tmp_path,
                              env=subprocess_env(), capture_output=True, text=True, timeout=300)

    first = launch("train.train_iters=6")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    lr_end = load_result(tmp_path / "run")["ranks"][0]["lr"][-1]
    more = launch("train.train_iters=9")
    assert more.returncode == 0, more.stdout[-2000:] + more.stderr[-2000:]
    assert "[extend]" in more.stdout and "decay still ends at step 6" in more.stdout
    rank = load_result(tmp_path / "run")["ranks"][0]
    assert rank["resumed_from"]["step"] == 6 and len(rank["loss"]) == 3
    assert rank["lr"] == [pytest.approx(1e-4)] * 3 and rank["lr"][0] <= lr_end  # no jump, no second warm-up
