"""The learning-rate and weight-decay schedule: megatron-core's ``OptimizerParamScheduler``.

One scheduler step per training step, counted in steps (Megatron-LM counts samples when
``--rampup-batch-size`` is set; here the batch is fixed, so steps are the same schedule). It writes
``lr`` and ``weight_decay`` into every ``optimizer.param_groups`` entry: megatron's
DistributedOptimizer on a GPU (its groups carry ``max_lr``/``min_lr``/``wd_mult`` from
``OptimizerConfig``) and torch's AdamW on a CPU (plain groups: the scheduler's own values apply).
As in Megatron-LM, the first step runs at the schedule's value for 0 steps done (``lr_warmup_init``
when there is a warm-up), and the scheduler advances after each successful update.
"""

from __future__ import annotations

from typing import Any


def build_scheduler(optimizer, train: dict[str, Any], override: bool = False):
    """The OptimizerParamScheduler of ``train.*`` (``recipes.config.TrainConfig``) over ``optimizer``.

    On resume the checkpoint's schedule is kept, its decay horizon included when only
    ``train.train_iters`` was raised (``resumed_horizon``; another change is refused before training),
    unless ``override`` (``checkpoint.override_scheduler``): then this config's schedule applies from
    the checkpoint's step on."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    wd = train["weight_decay"]
    start_wd = wd if train["start_weight_decay"] is None else train["start_weight_decay"]
    end_wd = wd if train["end_weight_decay"] is None else train["end_weight_decay"]
    decay_iters = train["lr_decay_iters"] or train["train_iters"]
    return OptimizerParamScheduler(
        optimizer,
        init_lr=train["lr_warmup_init"],
        max_lr=train["lr"],
        min_lr=train["min_lr"],
        lr_warmup_steps=train["lr_warmup_iters"],
        lr_decay_steps=decay_iters,
        lr_decay_style=train["lr_decay_style"],
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=decay_iters,
        wd_incr_style=train["weight_decay_incr_style"],
        use_checkpoint_opt_param_scheduler=not override,
        override_opt_param_scheduler=override,
        wsd_decay_steps=train["lr_wsd_decay_iters"],
        lr_wsd_decay_style=train["lr_wsd_decay_style"],
    )


def current_lr(optimizer) -> float | None:
    """The learning rate of the optimizer's default group now (megatron's logging choice)."""
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

    groups = optimizer.param_groups
    lr = get_canonical_lr_for_logging(groups)
    if lr is None and groups:
        lr = groups[0]["lr"]
    return float(lr) if lr is not None else None


#: The scheduler's decay horizon (``train.lr_decay_iters``, else ``train.train_iters``).
HORIZON = ("lr_decay_steps", "wd_incr_steps")


def differing_keys(saved: dict, current: dict) -> list[str]:
    """The keys of two ``OptimizerParamScheduler.state_dict()`` that differ (not the step count); the
    decay length does not matter to a constant schedule, so extending such a run is no change."""
    keys = (set(saved) | set(current)) - {"num_steps"}
    if saved.get("lr_decay_style") == current.get("lr_decay_style") == "constant" and (
            saved.get("wd_incr_style") == current.get("wd_incr_style") == "constant"):
        keys -= set(HORIZON)
    return sorted(k for k in keys if saved.get(k) != current.get(k))


def schedule_differences(saved: dict, current: dict) -> list[str]:
    """What differs between two ``OptimizerParamScheduler.state_dict()``, as text."""
    return [f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}" for k in differing_keys(saved, current)]


def resumed_horizon(saved: dict, current: dict, train: dict[str, Any], where: str) -> tuple[int | None, list[str]]:
    """The decay horizon a resumed run follows (None: the checkpoint's) and what to say about it.

    Raising ``train.train_iters`` continues the saved curve: megatron's scheduler keeps the checkpoint's
    horizon (``use_checkpoint_opt_param_scheduler``), so the learning rate neither jumps nor warms up
    again; past the horizon it stays at ``train.min_lr``. Setting ``train.lr_decay_iters`` moves the
    horizon from the checkpoint's step on. Any other change of the schedule is refused (``where``: the
    checkpoint) unless ``checkpoint.override_scheduler=true``."""
    from recipes.errors import ConfigError

    keys = differing_keys(saved, current)
    other = [k for k in keys if k not in HORIZON]
    if other:
        raise ConfigError("train.lr*", f"{where} was trained with another schedule: "
                          + "; ".join(schedule_differences({k: saved.get(k) for k in other},
                                                           {k: current.get(k) for k in other})),
                          "resume with the same train.* schedule (raising train.train_iters is no change), or "
                          "checkpoint.override_scheduler=true to apply this run's schedule from the checkpoint's step on")
    if not keys:
        return None, []
    old = saved.get("lr_decay_steps")
    if train.get("lr_decay_iters") is not None:
        return int(train["lr_decay_iters"]), [f"train.lr_decay_iters={train['lr_decay_iters']}: the decay now ends at "
                                              f"that step (the checkpoint's schedule ended it at step {old})"]
    return None, [f"the learning-rate decay still ends at step {old}, the checkpoint's (train.train_iters="
                  f"{train['train_iters']} continues past it at train.min_lr; train.lr_decay_iters=<step> moves it)"]


def restep(scheduler) -> None:
    """Recompute the learning rate and weight decay of ``scheduler.num_steps`` (after its fields changed)."""
    steps = scheduler.num_steps
    scheduler.num_steps = 0
    scheduler.step(increment=steps)
