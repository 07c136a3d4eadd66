"""The run: steps and the measured window, the LR and weight-decay schedule, precision, logger, data, estimate rates."""

from __future__ import annotations

import os
from collections.abc import Mapping

from recipes.config import typed
from recipes.errors import check
from recipes.recompute import ATTENTION_KIND


def check_run(cfg) -> None:
    cfg = typed(cfg)
    t, meas, log, data = cfg.train, cfg.measure, cfg.logger, cfg.data
    check(t.train_iters >= 2, "train.train_iters", "need at least 2 steps (warm-up + measured)",
           "set train.train_iters>=2")
    start = meas.start_step
    check(2 <= start <= t.train_iters, "measure.start_step",
           f"the measured window starts at step {start}, outside 2..{t.train_iters} (step 1 warms up "
           "and records the ledger)", f"set measure.start_step between 2 and train.train_iters={t.train_iters}")
    check(meas.steps >= 1, "measure.steps", f"{meas.steps} steps measure nothing",
           "set measure.steps>=1")
    check_schedule(t)
    check(t.precision in ("auto", "bf16", "fp32"), "train.precision",
           f"unknown precision {t.precision!r}", "use auto, bf16 or fp32")
    check(t.optimizer in ("auto", "adamw"), "train.optimizer",
           f"unknown optimizer {t.optimizer!r}", "use auto or adamw")
    check(log.name in ("none", "wandb"), "logger", f"unknown logger {log.name!r}",
           "use logger=none or logger=wandb")
    check(log.mode in ("offline", "online", "disabled"), "logger.mode",
           f"unknown W&B mode {log.mode!r}", "use offline, online or disabled")
    check(meas.profile in ("none", "peak"), "measure.profile",
           f"unknown profile {meas.profile!r}", "use measure.profile=none or peak")
    # the ranges of measure.* and estimate.* are recipes.validate.values.RANGES'
    check(meas.memory_budget_gib is None or meas.memory_fraction is None, "measure.memory_budget_gib",
           "both it and measure.memory_fraction cap the allocator", "set one of them, the other null")
    check(data.name in ("mock", "indexed"), "data", f"unknown data {data.name!r}",
           "use data=mock or data=indexed")
    check_deterministic(cfg)


#: What ``train.deterministic`` needs in the workers' environment (``recipes.run.workers`` sets each one
#: that is unset): cuBLAS's fixed workspace (torch's deterministic mode refuses cuBLAS without it), one
#: NCCL algorithm (Megatron-LM's --deterministic-mode refuses to start without one of those below: NVLS
#: reduces inside the switch, in no fixed order) and Transformer Engine's deterministic attention.
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
#: The values of those variables under which it still holds (torch's two workspace sizes; Megatron-LM's list).
DETERMINISTIC_VALUES = {"CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8"),
                        "NCCL_ALGO": ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS"),
                        "NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",)}


def deterministic_env_problem(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(problem, fix) when ``environ`` sets a variable ``train.deterministic`` needs to another value."""
    for key, allowed in DETERMINISTIC_VALUES.items():
        value = environ.get(key)
        if value is not None and value not in allowed:
            return (f"{key}={value} in the environment breaks it",
                    f"unset {key} (train.deterministic sets {key}={DETERMINISTIC_ENV[key]}) or set one of: "
                    + ", ".join(allowed))
    return None


def check_deterministic(cfg, environ: Mapping[str, str] | None = None) -> None:
    """``train.deterministic``: refused where bit-identical runs cannot be promised (see
    ``recipes.run.world.use_deterministic`` for what it switches on)."""
    cfg = typed(cfg)
    if not cfg.train.deterministic:
        return
    family = cfg.model.family
    check(ATTENTION_KIND[family] != "gdn", "train.deterministic",
          f"model={family}'s GatedDeltaNet layers run fla's Triton kernels, which pick their tile sizes by timing "
          "them in each process (autotune), so two runs may sum in different orders; megatron's deterministic "
          "mode swaps in a PyTorch chunked delta rule but keeps fla's l2norm, and no run has shown it bit-identical",
          "use a family without GatedDeltaNet layers (model=standard_attn, mla, moe, mla_moe), or "
          "train.deterministic=false")
    problem = deterministic_env_problem(os.environ if environ is None else environ)
    check(problem is None, "train.deterministic", *(problem or ("", "")))


#: megatron-core's OptimizerParamScheduler decay styles (optimizer_param_scheduler.py get_lr).
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")


def check_schedule(t) -> None:
    """The LR and weight-decay schedule: what OptimizerParamScheduler would assert, said as a fix."""
    style, warmup = t.lr_decay_style, t.lr_warmup_iters
    decay = t.lr_decay_iters or t.train_iters
    check(style in LR_DECAY_STYLES, "train.lr_decay_style", f"unknown decay style {style!r}",
           f"use one of {', '.join(LR_DECAY_STYLES)}")
    check(0 <= warmup < decay, "train.lr_warmup_iters",
           f"{warmup} warm-up steps do not end before the decay ends (step {decay})",
           "set train.lr_warmup_iters below train.lr_decay_iters (default: train.train_iters)")
    check(0 <= t.min_lr <= t.lr, "train.min_lr", f"min_lr {t.min_lr} is not in 0..lr={t.lr}",
           "set train.min_lr between 0 and train.lr")
    check(0 <= t.lr_warmup_init <= t.lr, "train.lr_warmup_init",
           f"{t.lr_warmup_init} is not in 0..lr={t.lr}", "set train.lr_warmup_init between 0 and train.lr")
    if style == "WSD":
        wsd = t.lr_wsd_decay_iters
        check(wsd is not None and 0 < wsd <= decay - warmup, "train.lr_wsd_decay_iters",
               f"WSD needs its anneal length within the decay ({decay - warmup} steps), got {wsd}",
               "set train.lr_wsd_decay_iters, e.g. a tenth of train.lr_decay_iters")
        check(t.lr_wsd_decay_style in ("linear", "cosine", "exponential", "minus_sqrt"),
               "train.lr_wsd_decay_style", f"unknown style {t.lr_wsd_decay_style!r}",
               "use linear, cosine, exponential or minus_sqrt")
    start = t.weight_decay if t.start_weight_decay is None else t.start_weight_decay
    end = t.weight_decay if t.end_weight_decay is None else t.end_weight_decay
    incr = t.weight_decay_incr_style
    check(incr in ("constant", "linear", "cosine"), "train.weight_decay_incr_style",
           f"unknown style {incr!r}", "use constant, linear or cosine")
    check(0 <= start <= end, "train.end_weight_decay", f"weight decay goes from {start} to {end}",
           "megatron's schedule only increases weight decay: set 0 <= start_weight_decay <= end_weight_decay")
    check(incr != "constant" or start == end, "train.weight_decay_incr_style",
           f"constant weight decay but start {start} != end {end}",
           "set train.weight_decay_incr_style=linear or cosine, or equal start/end weight decay")


def peak_memory_problem(cfg, predicted_peak_bytes: int | None, capacity_bytes: int | None, where: str,
                        ranks: int = 1) -> tuple[str, str, str] | None:
    """(option, problem, fix) where ``ranks`` ranks of the estimator's predicted peak
    (``recipes.predict.estimate.predict``) do not fit ``capacity_bytes`` (``where``: this GPU, or this
    host for a CPU run's ranks), unless ``allow_over_memory``; else None. A cap the user set on purpose
    (``measure.memory_fraction``, ``measure.memory_budget_gib``) is a measurement of running out: not refused."""
    cfg = typed(cfg)
    meas = cfg.measure
    if (not predicted_peak_bytes or not capacity_bytes or cfg.get("allow_over_memory")
            or meas.memory_fraction is not None or meas.memory_budget_gib is not None):
        return None
    need = predicted_peak_bytes * ranks
    if need <= capacity_bytes:
        return None
    gib = 2**30
    each = f" ({predicted_peak_bytes / gib:,.1f} GiB per rank x {ranks} ranks)" if ranks > 1 else ""
    return ("allow_over_memory", f"the estimator predicts a peak of {need / gib:,.1f} GiB{each}, above {where} "
            f"({capacity_bytes / gib:,.1f} GiB): the run would run out of memory",
            "shrink train.seq_length, train.micro_batch_size or the model, recompute more (python -m recipes estimate "
            "... --all lists every option's peak), or add allow_over_memory=true to launch it anyway")


def output_problem(path) -> tuple[str, str, str] | None:
    """(option, problem, fix) where a run could not write ``path`` (its directory): a regular file is in
    the way, or its nearest existing directory takes no new file (read-only, no permission); else None.
    Probed by creating a file, which is what the run will do (permission bits alone mislead root)."""
    import os
    import tempfile
    from pathlib import Path

    path = Path(path).absolute()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    fix = "set output_dir (or hydra.run.dir / hydra.sweep.dir) to a writable directory"
    if not probe.is_dir():
        under = f" ({path} would be under it)" if probe != path else ""
        return "output_dir", f"{probe} is a file, not a directory{under}", fix
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".write-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        return "output_dir", f"{path} cannot be written ({probe}: {err.strerror or err})", fix
    return None
