"""A real worker process: SIGTERM mid-run saves a checkpoint and exits 0 (status preempted); the
re-run resumes from it; the live progress lines reach the controller's console and progress.jsonl."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, compose, start_train, subprocess_env, train_in_process
from test_parallel import SAVED, SCHEDULE, TWO_RANK_LAYOUTS, layout_run, model_of, two_ranks
from wandb_files import offline_runs

from recipes.results import load_result
from recipes.run.checkpoint import read_meta

RUN = ["size=tiny", "measure.profile=none", "measure.start_step=2", "checkpoint=default",
       "checkpoint.interval=1000", "train.log_interval=5"]


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly_then_resumes(tmp_path):
    out = tmp_path / "run"
    proc = start_train([*RUN, "train.train_iters=100000", f"output_dir={out}"], tmp_path, stderr=subprocess.STDOUT)
    lines = []
    for line in proc.stdout:  # the controller echoes the worker's progress lines as they come
        lines.append(line)
        if line.startswith("[progress] step 10/"):
            proc.send_signal(signal.SIGTERM)  # to the controller, which forwards it to the worker
            break
    rest, _ = proc.communicate(timeout=300)
    lines += rest.splitlines(keepends=True)
    assert proc.returncode == 0, "".join(lines)
    text = "".join(lines)
    assert "[signal] SIGTERM at step" in text and "[checkpoint] saved step" in text
    result = load_result(out)
    rank = result["ranks"][0]
    assert result["status"] == "preempted" and rank["signal"] == "SIGTERM"
    stopped = rank["stopped_at"]
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"
    progress = [json.loads(l) for l in (out / "progress.jsonl").read_text().splitlines()]
    assert progress[0]["step"] == 5 and {"loss", "lr", "grad_norm", "tokens_per_s", "eta_s"} <= progress[0].keys()

    again = subprocess.run([sys.executable, str(REPO / "train.py"), *RUN, f"train.train_iters={stopped + 5}",
                            f"output_dir={out}"], cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    resumed = load_result(out)
    assert resumed["status"] == "ok"
    assert resumed["ranks"][0]["resumed_from"]["step"] == stopped
    assert len(resumed["ranks"][0]["loss"]) == 5
    assert f"resuming from {out / 'checkpoints' / f'step_{stopped:08d}'}" in again.stdout
    assert resumed["ranks"][0]["timing"] == rank["timing"]


def launch(cwd: Path, out: Path, *overrides: str) -> dict:
    """``train.py`` with ``overrides`` into ``out``: its result (the run must succeed)."""
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides, f"output_dir={out}"], cwd=cwd,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return load_result(out)


#: dp2 is not its own case: ep2 shards the dense parameters' optimizer over two data-parallel ranks
@pytest.mark.slow
@pytest.mark.parametrize("layout", [pytest.param(name, marks=two_ranks(name)) for name in TWO_RANK_LAYOUTS])
def test_resume_is_bit_exact_under_two_gloo_processes(tmp_path, shared_runs, layout):
    """Two gloo processes (tensor, pipeline or expert parallel): 6 steps straight (test_parallel's
    ``layout_run``, a checkpoint at step 3) == 3, a checkpoint, a new process group, 3 more; losses and
    grad norms bit-identical on every rank."""
    run = layout_run(shared_runs, layout)
    straight_result = load_result(run)
    assert straight_result["status"] == "ok"
    second = launch(tmp_path, tmp_path / "resumed", *SCHEDULE, *SAVED, *TWO_RANK_LAYOUTS[layout],
                    f"checkpoint.resume={run / 'checkpoints' / 'step_00000003'}")
    assert second["status"] == "ok"
    for rank in (0, 1):  # under pp2 the first stage has no loss (None), and both stages a grad norm
        ref, got = straight_result["ranks"][rank], second["ranks"][rank]
        assert got["resumed_from"]["step"] == 3
        assert len(got["loss"]) == 3
        assert got["loss"] == ref["loss"][3:] and got["grad_norm"] == ref["grad_norm"][3:], rank
        assert any(g is not None for g in got["grad_norm"]), rank


@pytest.mark.slow
@pytest.mark.parametrize("saved_under", [pytest.param(name, marks=two_ranks(name)) for name in ("tp2", "pp2")])
def test_a_two_process_checkpoint_loads_on_one(shared_runs, megatron_world, saved_under):
    """dist_checkpointing reshards: saved under tensor or pipeline parallel 2, resumed on one process
    (this one: the worker's loop, as conftest's ``train_in_process`` runs it) with the saved run's
    global batch (pp2's is 8), the next steps' losses equal the two-process run's within fp32 rounding
    (model and AdamW moments resharded)."""
    run = layout_run(shared_runs, saved_under)
    two = load_result(run)
    saved = run / "checkpoints" / "step_00000003"
    last_stage = next(r for r in two["ranks"] if r["loss"] and r["loss"][0] is not None)
    # rank 0 logs the loss even where only the last pipeline stage has it (pp2: rank 1)
    progress = [json.loads(l) for l in (run / "progress.jsonl").read_text().splitlines()]
    assert [(p["step"], p["loss"]) for p in progress] == [(3, last_stage["loss"][2]), (6, last_stage["loss"][5])]
    (wb,) = offline_runs(run)
    assert [wb.history[s]["train/loss"] for s in (3, 6)] == [p["loss"] for p in progress]
    batch = read_meta(saved)["global_batch_size"]
    rank = train_in_process(compose(*SCHEDULE, *SAVED, *model_of(saved_under), f"checkpoint.resume={saved}",
                                    f"train.global_batch_size={batch}", "checkpoint.save=false",
                                    "train.log_interval=0"))
    assert rank["resumed_from"]["step"] == 3 and any("RNG states start from the seed" in n
                                                     for n in rank["checkpoint_notes"])
    assert not any("saved with train." in n for n in rank["checkpoint_notes"])  # the same batch shape
    assert rank["loss"] == pytest.approx(last_stage["loss"][3:], rel=1e-5)
