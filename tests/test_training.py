"""A run trains for train.train_iters steps: the measured window inside it, and the LR schedule."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose, train_in_process

from recipes.errors import ConfigError
from recipes.run.schedule import build_scheduler, schedule_differences
from recipes.run.window import measure_window
from recipes.validate import validate

QUICK = ("measure.profile=none", "measure.ledger=false")


@pytest.mark.parametrize("train_iters,start,steps,first,expected", [
    (8, 4, 5, 1, (4, 8)),  # the default: all of an 8-step sweep point after 3 steps
    (6, 3, 5, 1, (3, 6)),  # cut at the end of the run
    (20000, 4, 5, 1, (4, 8)),  # a long run measures the same steps, then trains on
    (20, 4, 5, 11, None),  # resumed past the window: the checkpoint carries the measurements
    (20, 4, 5, 6, (7, 11)),  # resumed inside it: as many steps after its own first step
    (20, 4, 5, 20, None),  # nothing left to measure
])
def test_measure_window(train_iters, start, steps, first, expected):
    cfg = compose(f"train.train_iters={train_iters}", f"measure.start_step={start}", f"measure.steps={steps}")
    assert measure_window(cfg, first) == expected


def test_a_run_trains_every_step_and_times_only_the_window(megatron_world):
    result = train_in_process(compose("train.train_iters=12", *QUICK))
    assert len(result["loss"]) == len(result["grad_norm"]) == len(result["lr"]) == 12
    assert result["window"] == [4, 8] and result["timing"]["steps"] == 5


def _expected_lr(step0: int, lr: float, min_lr: float, warmup: int, decay: int, style: str) -> float:
    """Megatron-LM's formula (optimizer_param_scheduler.py get_lr), written out for the test."""
    if step0 <= warmup:
        return lr * step0 / warmup
    ratio = (step0 - warmup) / (decay - warmup)
    coeff = {"linear": 1 - ratio, "cosine": 0.5 * (math.cos(math.pi * ratio) + 1)}[style]
    return min_lr + coeff * (lr - min_lr)


@pytest.mark.parametrize("style", ["cosine", "linear"])
def test_lr_schedule_is_megatrons_formula(megatron_world, style):
    """Recorded per step: the lr each step ran at (step k runs at the value for k-1 steps done)."""
    lr, min_lr, warmup, iters = 1e-3, 1e-5, 3, 13
    cfg = compose(f"train.train_iters={iters}", f"train.lr={lr}", f"train.min_lr={min_lr}",
                  f"train.lr_warmup_iters={warmup}", f"train.lr_decay_style={style}", *QUICK)
    lrs = train_in_process(cfg)["lr"]
    assert lrs[0] == 0.0  # lr_warmup_init
    assert lrs[warmup] == pytest.approx(lr, rel=1e-12)  # warm-up end
    mid = warmup + (iters - warmup) // 2
    assert lrs[mid] == pytest.approx(_expected_lr(mid, lr, min_lr, warmup, iters, style), rel=1e-12)
    assert lrs[-1] == pytest.approx(_expected_lr(iters - 1, lr, min_lr, warmup, iters, style), rel=1e-12)
    for k, value in enumerate(lrs):
        assert value == pytest.approx(_expected_lr(k, lr, min_lr, warmup, iters, style), rel=1e-12, abs=1e-15)


def test_wsd_and_weight_decay_schedule():
    """WSD: constant until its anneal, then down to min_lr; weight decay rises linearly."""
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([param], lr=1.0)
    train = compose("train.lr=1.0", "train.min_lr=0.1", "train.lr_decay_style=WSD", "train.train_iters=100",
                    "train.lr_wsd_decay_iters=10", "train.lr_wsd_decay_style=linear",
                    "train.start_weight_decay=0.0", "train.end_weight_decay=0.1",
                    "train.weight_decay_incr_style=linear")["train"]
    sched = build_scheduler(opt, train)
    seen = {}
    for k in range(101):
        seen[k] = (opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"])
        sched.step(1)
    assert seen[90][0] == 1.0 and seen[95][0] == pytest.approx(0.55) and seen[100][0] == pytest.approx(0.1)
    assert seen[0][1] == 0.0 and seen[50][1] == pytest.approx(0.05) and seen[100][1] == pytest.approx(0.1)


def test_schedule_differences_ignore_the_length_of_a_constant_schedule():
    base = {"max_lr": 1e-4, "min_lr": 0.0, "lr_decay_style": "constant", "lr_decay_steps": 10,
            "wd_incr_style": "constant", "wd_incr_steps": 10, "num_steps": 10}
    assert schedule_differences(base, {**base, "lr_decay_steps": 20, "wd_incr_steps": 20, "num_steps": 0}) == []
    cosine = {**base, "lr_decay_style": "cosine"}
    assert schedule_differences(cosine, {**cosine, "lr_decay_steps": 20}) == [
        "lr_decay_steps: checkpoint 10, now 20"]


@pytest.mark.parametrize("overrides,option", [
    (["train.lr_decay_style=step"], "train.lr_decay_style"),
    (["train.lr_warmup_iters=8"], "train.lr_warmup_iters"),
    (["train.min_lr=1"], "train.min_lr"),
    (["train.lr_decay_style=WSD"], "train.lr_wsd_decay_iters"),
    (["train.start_weight_decay=0.1", "train.end_weight_decay=0.0", "train.weight_decay_incr_style=linear"],
     "train.end_weight_decay"),
    (["train.start_weight_decay=0.0"], "train.weight_decay_incr_style"),
])
def test_bad_schedules_are_refused_with_the_option(overrides, option):
    with pytest.raises(ConfigError) as err:
        validate(compose(*overrides), num_gpus=0, te_available=False)
    assert option in str(err.value)


def test_the_timing_records_the_hosts_work_and_its_wait_at_the_grad_norm_read(megatron_world, monkeypatch):
    """timing.host_work_s and timing.host_wait_s: each measured step's host time until the step
    returned, split into its waits inside ``Tensor.item`` (where megatron reads the grad norm, the
    step's one sync on a GPU) and the rest. Here every measured step reads one value that takes 50 ms
    to come: that is wait, not work, and the planner's timeline takes it as the host's margin."""
    import time

    from recipes.run.trainer import Trainer

    plain_item, plain_step = torch.Tensor.item, Trainer.train_step

    def slow_item(tensor):
        time.sleep(0.05)
        return plain_item(tensor)

    def step_with_a_read(self, *args, **kwargs):
        out = plain_step(self, *args, **kwargs)
        torch.zeros(1).item()
        return out

    monkeypatch.setattr(torch.Tensor, "item", slow_item)
    monkeypatch.setattr(Trainer, "train_step", step_with_a_read)
    timing = train_in_process(compose("size=tiny", "profile=none", "train.train_iters=3",
                                      "measure.start_step=2"))["timing"]
    assert timing["host_wait_s"] >= 0.05
    assert 0 < timing["host_work_s"] <= timing["step_time_s"] - 0.05
