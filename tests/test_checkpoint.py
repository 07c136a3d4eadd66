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
            "train.train_iters=10", "measure.start_step=2", "measure.steps=2", "measure.profile=none")
OFFLOAD_EMULATED = ("offload.emulate_on_cpu=true", "offload.min_offloaded_tensor_size=0")


def train(cfg: dict, run_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The worker's loop in this process: (rank result, parameters after the run)."""
    from recipes.results import RankResult
    from recipes.run.worker import train_and_measure
    from recipes.run.world import reseed

    reseed(cfg)
    result = RankResult(rank=0)
    trainer = train_and_measure(cfg, result, run_dir)
    params = {f"{i}.{n}": p.detach().clone() for i, c in enumerate(trainer.chunks) for n, p in c.named_parameters()}
    return result.as_dict(), params


@pytest.mark.parametrize("family, extra", [
    *[pytest.param(f, (), id=f) for f in ("standard_attn", "moe", "mla", "gdn")],
    # attention, not layer: the same torch.compile of a forward, compiled in less time (the test: 14 s, not 23 s)
    pytest.param("standard_attn", ("model.compile=attention",), id="standard_attn-compiled",
                 marks=pytest.mark.slow),
    # the resumed process's offload manager plans again in its first step: the losses must not notice
    pytest.param("moe", ("offload=expert_fc1-moe_act", "offload.offload_modules=[core_attn,attn_proj,expert_fc1,moe_act]",
                         *OFFLOAD_EMULATED), id="moe-offload"),
])
def test_resume_is_bit_exact(megatron_world, tmp_path, family, extra):
    """10 steps straight == 5 steps, a checkpoint, a new process state, 5 more (losses, lr, weights)."""
    base = (f"model={family}", *SCHEDULE, *extra)
    straight, weights = train(compose(*base), tmp_path / "straight")
    run = tmp_path / "resumed"
    parts = (*base, "checkpoint=default", "checkpoint.interval=2", "train.exit_interval=5")
    first, _ = train(compose(*parts), run)
    assert first["status"] == "stopped" and first["stopped_at"] == 5 and len(first["loss"]) == 5
    assert "starting from step 0" in first["checkpoint_notes"][0]
    assert (run / "checkpoints" / LATEST).read_text().strip() == "step_00000005"
    second, resumed_weights = train(compose(*parts), run)
    assert second["resumed_from"]["step"] == 5 and second["first_step"] == 6
    assert second["loss"] == straight["loss"][5:]
    assert second["lr"] == straight["lr"][5:]
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
    assert complete == ["step_00000006", "step_00000008", "step_00000010"]  # keep_last=3 (2, 4 and 5 pruned)
    assert read_meta(run / "checkpoints" / "step_00000010")["step"] == 10


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
    assert any("skipped checkpoint" in n and "step_00000008" in n for n in notes)


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


def test_a_save_starts_no_process(saved):
    """megatron's write results come back through this process's own queue
    (``recipes.build.upstream.write_checkpoint_results_through_a_thread_queue``), not a manager process
    per rank; the saves above completed through it."""
    import multiprocessing
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    assert isinstance(filesystem_async._results_queue, queue.Queue)  # a Manager's queue is a proxy, not this
    assert not [p for p in multiprocessing.active_children() if "Manager" in p.name]
    assert sorted(p.name for p in saved.glob("checkpoints/step_*")) == ["step_00000002", "step_00000004"]


# --- checkpoints that cannot lose or run code --------------------------------------------------------


def _copy(saved: Path, tmp_path: Path) -> Path:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(saved, run)
    return run


class _Marker:
    """Unpickling it creates ``path`` (what a crafted checkpoint could do with any command)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_tampered_metadata_file_is_refused_before_anything_is_unpickled(megatron_world, saved, tmp_path):
    import pickle

    run = _copy(saved, tmp_path)
    newest = run / "checkpoints" / "step_00000004"
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Marker(probe)))  # the payload works: unpickling it creates the file
    assert probe.exists()
    marker = tmp_path / "code_ran"
    size = (newest / ".metadata").stat().st_size  # the same size: only its hash tells it apart
    payload = pickle.dumps(_Marker(marker))
    (newest / ".metadata").write_bytes(payload + b" " * (size - len(payload)))
    from recipes.run.checkpoint import load_checkpoint

    cfg = compose("train.train_iters=4", "measure.start_step=2", "measure.profile=none", "checkpoint=default",
                  f"checkpoint.resume={newest}")
    with pytest.raises(ConfigError, match=r"does not verify .*\.metadata: .*sha256") as err:
        find_resume(cfg, run)
    assert str(newest) in str(err.value) and "checkpoint.resume" in str(err.value)
    from conftest import build_trainer

    trainer = build_trainer(cfg)
    try:
        with pytest.raises(ConfigError, match="does not verify"):
            load_checkpoint(trainer, cfg, newest)  # called directly: it verifies before it reads
    finally:
        trainer.close()
    path, notes = find_resume(compose("checkpoint=default"), run)  # auto: the previous one
    assert path == run / "checkpoints" / "step_00000002"
    assert any(f"skipped checkpoint {newest}" in n and ".metadata" in n for n in notes)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "emptied_meta", "extra_file", "no_manifest"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one_and_names_it(megatron_world, saved, tmp_path, damage):
    from recipes.run.manifest import MANIFEST

    run = _copy(saved, tmp_path)
    newest = run / "checkpoints" / "step_00000004"
    if damage == "truncated":
        shard = max((p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "emptied_meta":
        (newest / "meta.json").write_text("")
    elif damage == "extra_file":
        (newest / "__9_0.distcp").write_bytes(b"x")
    else:
        (newest / MANIFEST).unlink()
    cfg = compose("train.train_iters=4", "measure.start_step=2", "measure.profile=none", "checkpoint=default")
    path, notes = find_resume(cfg, run)
    assert path == run / "checkpoints" / "step_00000002"
    assert any(n.startswith(f"skipped checkpoint {newest}") for n in notes), notes
    if damage == "truncated":  # and the run goes on from there, saving step 4 again over the damaged one
        result, _ = train(cfg, run)
        assert result["resumed_from"]["step"] == 2 and len(result["loss"]) == 2
        assert any(f"skipped checkpoint {newest}" in n for n in result["checkpoint_notes"])
        assert find_resume(cfg, run)[0] == newest


def test_no_checkpoint_that_verifies_is_refused_not_started_over(saved, tmp_path):
    from recipes.run.manifest import MANIFEST

    run = _copy(saved, tmp_path)
    for ckpt in (run / "checkpoints").glob("step_*"):
        (ckpt / MANIFEST).unlink()
    with pytest.raises(ConfigError, match="(?s)no checkpoint under .* verifies.*python -m recipes.run.manifest trust"):
        find_resume(compose("checkpoint=default"), run)
    from recipes.run.manifest import trust

    trust(run / "checkpoints" / "step_00000004")
    assert find_resume(compose("checkpoint=default"), run)[0] == run / "checkpoints" / "step_00000004"


def test_a_save_failing_with_a_base_exception_stops_naming_step_directory_and_error(megatron_world, tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    assert not issubclass(CheckpointException, Exception)  # why the save catches BaseException

    def failing(*args, **kwargs):
        raise CheckpointException("write failed: no space left on device", {})

    monkeypatch.setattr(dist_checkpointing, "save", failing)
    cfg = compose("train.train_iters=3", "measure.start_step=2", "measure.profile=none", "checkpoint=default")
    with pytest.raises(CheckpointError) as err:
        train(cfg, tmp_path)
    text = str(err.value)
    assert "step 3" in text and str(tmp_path / "checkpoints" / "tmp.step_00000003") in text
    assert "CheckpointException" in text and "no space left" in text and "training stopped" in text
    assert not (tmp_path / "checkpoints" / LATEST).exists()


def _fake_checkpoint(root: Path, step: int) -> Path:
    import json

    from recipes.run.checkpoint import FORMAT, step_name
    from recipes.run.manifest import trust

    d = root / step_name(step)
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"format": FORMAT, "step": step}))
    trust(d)
    return d


@pytest.mark.parametrize("keep", [-3, -1, 0, None, 1, 2])
def test_retention_never_deletes_the_newest_complete_checkpoint(tmp_path, keep):
    from recipes.run.checkpoint import _prune

    root = tmp_path / "checkpoints"
    made = [_fake_checkpoint(root, s) for s in (2, 4, 6)]
    later = _fake_checkpoint(root, 10)  # a later step of a run this one resumed before: not ours to delete
    deleted = _prune(root, keep, made[-1])
    left = sorted(p for p in root.iterdir())
    assert made[-1] in left and later in left
    if keep is None or keep < 1:
        assert deleted == [] and len(left) == 4
    else:
        assert left == sorted([*made[-keep:], later])


def test_raising_train_iters_continues_the_learning_rate_curve(megatron_world, tmp_path):
    """A finished 12-step cosine run extended to 18 steps follows the curve of an uninterrupted 18-step run
    whose decay ends at step 12: no jump, no second warm-up, min_lr past the horizon."""
    schedule = ("train.lr=1e-3", "train.min_lr=1e-4", "train.lr_warmup_iters=3", "train.lr_decay_style=cosine",
                "measure.profile=none", "measure.start_step=2")
    straight, _ = train(compose(*schedule, "train.train_iters=18", "train.lr_decay_iters=12"), tmp_path / "straight")
    run = tmp_path / "extended"
    first, _ = train(compose(*schedule, "train.train_iters=12", "checkpoint=default"), run)
    assert first["status"] == "ok" and first["lr"] == straight["lr"][:12]
    second, _ = train(compose(*schedule, "train.train_iters=18", "checkpoint=default"), run)
    assert second["resumed_from"]["step"] == 12 and second["first_step"] == 13
    assert second["lr"] == straight["lr"][12:] and second["lr"][0] == pytest.approx(1e-4)
    assert any("decay still ends at step 12" in n for n in second["checkpoint_notes"])
    # train.lr_decay_iters moves the horizon from the checkpoint's step on, and says so
    moved = tmp_path / "moved"
    import shutil

    shutil.copytree(run, moved, ignore=shutil.ignore_patterns("step_00000018"))
    (moved / "checkpoints" / LATEST).write_text("step_00000012\n")
    third, _ = train(compose(*schedule, "train.train_iters=18", "train.lr_decay_iters=24", "checkpoint=default"), moved)
    assert third["resumed_from"]["step"] == 12 and third["lr"][0] > second["lr"][0]
    assert any("train.lr_decay_iters=24: the decay now ends at that step" in n for n in third["checkpoint_notes"])
