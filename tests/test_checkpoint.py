"""Checkpoints (megatron-core dist_checkpointing): resume is exact, bad input is refused, saves are atomic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import compose

from recipes.errors import ConfigError
from recipes.run.checkpoint import LATEST, CheckpointError, find_resume, read_meta
from recipes.run.window import MEASURED_KEYS

SCHEDULE = ("train.lr=1e-3", "train.min_lr=1e-4", "train.lr_warmup_iters=3", "train.lr_decay_style=cosine",
            "train.train_iters=20", "measure.profile=none")
OFFLOAD_EMULATED = ("offload.emulate_on_cpu=true", "offload.min_offloaded_tensor_size=0")


def train(cfg: dict, run_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The worker's loop in this process: (rank result, parameters after the run)."""
    from recipes.run.worker import train_and_measure
    from recipes.run.world import reseed

    reseed(cfg)
    result: dict = {"rank": 0}
    trainer = train_and_measure(cfg, result, run_dir)
    params = {f"{i}.{n}": p.detach().clone() for i, c in enumerate(trainer.chunks) for n, p in c.named_parameters()}
    return result, params


@pytest.mark.parametrize("family, extra", [
    *[pytest.param(f, (), id=f) for f in ("standard_attn", "moe", "mla", "gdn")],
    pytest.param("standard_attn", ("model.compile=layer",), id="standard_attn-compiled", marks=pytest.mark.slow),
    # the resumed process's offload manager plans again in its first step: the losses must not notice
    pytest.param("moe", ("offload=expert_fc1-moe_act", "offload.offload_modules=[core_attn,attn_proj,expert_fc1,moe_act]",
                         *OFFLOAD_EMULATED), id="moe-offload"),
])
def test_resume_is_bit_exact(megatron_world, tmp_path, family, extra):
    """20 steps straight == 10 steps, a checkpoint, a new process state, 10 more (losses, lr, weights)."""
    base = (f"model={family}", *SCHEDULE, *extra)
    straight, weights = train(compose(*base), tmp_path / "straight")
    run = tmp_path / "resumed"
    parts = (*base, "checkpoint=default", "checkpoint.interval=5", "train.exit_interval=10")
    first, _ = train(compose(*parts), run)
    assert first["status"] == "stopped" and first["stopped_at"] == 10 and len(first["loss"]) == 10
    assert "starting from step 0" in first["checkpoint_notes"][0]
    assert (run / "checkpoints" / LATEST).read_text().strip() == "step_00000010"
    second, resumed_weights = train(compose(*parts), run)
    assert second["resumed_from"]["step"] == 10 and second["first_step"] == 11
    assert second["loss"] == straight["loss"][10:]
    assert second["lr"] == straight["lr"][10:]
    # the resumed process ran no window: what the first measured (offload's bytes, MoE's routing too)
    # comes from the checkpoint, so result.json reads the same
    assert set(first) - set(second) == {"stopped_at", "stop_reason"}, set(first) - set(second)
    for key in MEASURED_KEYS:
        assert second.get(key) == first.get(key), key
    if "offload" in first:
        assert first["offload"]["moved_per_step"]["d2h_bytes"] > 0
    assert weights.keys() == resumed_weights.keys()
    for name in weights:
        assert torch.equal(weights[name], resumed_weights[name]), name
    complete = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert complete == ["step_00000010", "step_00000015", "step_00000020"]  # keep_last=3
    assert read_meta(run / "checkpoints" / "step_00000020")["step"] == 20


@pytest.fixture(scope="module")
def saved(megatron_world, tmp_path_factory) -> Path:
    """A run directory with checkpoints at steps 2 and 4 of the tiny dense model."""
    run = tmp_path_factory.mktemp("saved")
    train(compose("train.train_iters=4", "measure.start_step=2", "measure.profile=none", "checkpoint=default",
                  "checkpoint.interval=2"), run)
    return run


def test_another_model_is_refused_before_training_with_what_differs(saved):
    from recipes.run.checkpoint import check_compatible

    with pytest.raises(ConfigError) as err:
        check_compatible(saved / "checkpoints" / "step_00000004", compose("model=moe", "model.num_layers=4"))
    text = str(err.value)
    assert "model.family: checkpoint 'standard_attn', this run 'moe'" in text
    assert "model.num_layers: checkpoint 2, this run 4" in text


def test_a_changed_schedule_is_refused(megatron_world, saved):
    cfg = compose("train.train_iters=8", "measure.start_step=2", "measure.profile=none", "checkpoint=default",
                  "train.lr_decay_style=cosine")
    with pytest.raises(ConfigError, match="lr_decay_style: checkpoint 'constant', now 'cosine'"):
        train(cfg, saved)


def test_another_batch_shape_loads_with_a_note_naming_the_saved_value(megatron_world, saved, tmp_path):
    """Allowed (the data continues at the saved sample), but said: the next steps are not the saved run's."""
    cfg = compose("train.train_iters=5", "measure.start_step=5", "measure.profile=none", "checkpoint=default",
                  f"checkpoint.resume={saved / 'checkpoints' / 'step_00000004'}", "train.global_batch_size=2")
    same, _ = train(cfg, tmp_path / "same")
    assert not any("saved with train." in n for n in same["checkpoint_notes"])
    cfg["train"]["global_batch_size"] = 4
    other, _ = train(cfg, tmp_path / "other")
    assert other["resumed_from"]["step"] == 4 and ("saved with train.global_batch_size=2, resumed with 4: the data "
                                                   "continues at the saved sample") in " ".join(other["checkpoint_notes"])
    assert "train.global_batch_size=2 continues it exactly" in " ".join(other["checkpoint_notes"])


def test_partial_checkpoints_are_named_and_never_used(saved, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(saved, run)
    ckpts = run / "checkpoints"
    (ckpts / "tmp.step_00000006").mkdir()  # a save that died before its rename
    shutil.copytree(ckpts / "step_00000004", ckpts / "step_00000008")
    (ckpts / "step_00000008" / "meta.json").unlink()  # renamed by hand, never finished
    cfg = compose("checkpoint=default")
    path, notes = find_resume(cfg, run)
    assert path == ckpts / "step_00000004"
    assert any("tmp.step_00000006" in n and "ignored" in n for n in notes)
    assert any("step_00000008" in n and "ignored" in n for n in notes)


def test_resume_auto_without_a_checkpoint_starts_fresh_and_says_so(tmp_path):
    path, notes = find_resume(compose("checkpoint=default"), tmp_path)
    assert path is None and "no checkpoint" in notes[-1] and "starting from step 0" in notes[-1]
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        find_resume(compose(f"checkpoint.resume={tmp_path}"), tmp_path)


def test_a_failed_save_stops_training_with_a_clear_error(megatron_world, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cfg = compose("train.train_iters=3", "measure.start_step=2", "measure.profile=none", "checkpoint=default",
                  f"checkpoint.dir={blocker}/ckpt")
    with pytest.raises(CheckpointError, match="cannot create .*training stopped"):
        train(cfg, tmp_path)
    assert not (blocker.parent / LATEST).exists()
