"""Checkpoints through megatron-core's ``dist_checkpointing``: save, find the latest, resume.

One checkpoint is one directory ``<checkpoint.dir>/step_<00000010>/`` in megatron's ``torch_dist``
format (``dist_checkpointing.save``), holding:

- ``model`` (``model0``, ``model1``... under virtual pipeline stages): every chunk's
  ``GPTModel.sharded_state_dict()``, global tensors that any parallel layout can load
  (``recipes.build.experts.GroupedExperts`` and megatron's GatedDeltaNet define their mapping);
- ``optimizer``: megatron's DistributedOptimizer ``sharded_state_dict`` on a GPU; on a CPU, torch
  AdamW's moments mapped onto the model's sharded parameters the way megatron's ``FP32Optimizer``
  does (``optim_state_to_sharding_state``), so they reshard like the weights;
- ``scheduler`` (``OptimizerParamScheduler.state_dict``), ``step``, ``consumed_samples`` (train
  and validation: the data-iterator position);
- ``rank_state``: per rank (a ``ShardedObject`` over the world), the torch, CUDA and megatron
  tracker RNG states and the measurements of the window, when it is already behind;
- megatron ``content_metadata``, and ``meta.json`` (plain JSON, for tools and for the controller's
  check before launch): the step, the world size and layout, the model config and the schedule;
- ``manifest.json``, written last: every file's size and sha256 (``recipes.run.manifest``).

Atomicity: all ranks write into ``tmp.step_<n>``; rank 0 writes ``meta.json``, the ranks hash their
share of the files, rank 0 writes the manifest, renames the directory to ``step_<n>`` and, once it
verifies, rewrites ``latest`` and deletes the checkpoints past ``checkpoint.keep_last``. Nothing is
loaded that does not verify against its manifest (files, sizes, hashes), before any file is
unpickled; ``resume=auto`` falls back to the newest one that does, naming each one it skipped.
Load it with megatron's own API: ``docs/training.md``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from recipes.build import upstream
from recipes.config import as_dict, typed
from recipes.errors import ConfigError
from recipes.files import write_json_atomic
from recipes.run import manifest

LATEST = "latest"
META = "meta.json"
FORMAT = "recompute-recipes/1"
#: Config sections a checkpoint's model must match to load (the run's shape and family).
MODEL_KEYS = ("model",)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; training stops with this message."""


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_root(cfg: dict, run_dir: Path | None) -> Path:
    """Where this run's checkpoints live: ``checkpoint.dir``, else ``RUN_DIR/checkpoints``."""
    cfg = typed(cfg)
    ck = cfg.checkpoint
    if ck.dir:
        return Path(os.path.expanduser(ck.dir))
    if run_dir is None:
        raise ConfigError("checkpoint.dir", "checkpoints are on but the run has no directory",
                          "set checkpoint.dir=<path> or output_dir=<path>")
    return Path(run_dir) / "checkpoints"


# --- finding one -----------------------------------------------------------------------------------


def read_meta(path: Path) -> dict | None:
    try:
        meta = json.loads((Path(path) / META).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _step_dirs(root: Path) -> tuple[list[Path], list[Path]]:
    """(``step_<n>`` directories, newest first; ``tmp.*`` ones: saves that did not finish)."""
    if not root.is_dir():
        return [], []
    dirs = [d for d in root.iterdir() if d.is_dir() and not d.is_symlink()]
    steps = sorted((d for d in dirs if d.name.startswith("step_")), key=lambda d: d.name, reverse=True)
    return steps, sorted(d for d in dirs if d.name.startswith("tmp."))


def complete_checkpoints(root: Path) -> tuple[list[Path], list[Path]]:
    """(checkpoints whose manifest lists their files at their sizes, oldest first; the rest found).
    Sizes only: the hashes are checked (``verify``) before the one to load is read."""
    steps, partial = _step_dirs(root)
    complete = [d for d in steps if not manifest.problems(d, deep=False)]
    return complete[::-1], sorted(partial + [d for d in steps if d not in complete])


def verify(path: Path, deep: bool = True) -> list[str]:
    """Why the checkpoint ``path`` must not be loaded (empty: it may). With several ranks, ``deep``
    hashes are shared out among them and the answer agreed, so every rank decides alike."""
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if dist else (0, 1)
    found = manifest.problems(path, deep=deep, share=(rank, world))
    if meta_problem := (None if found else _meta_problem(path)):
        found.append(meta_problem)
    if world == 1 or not deep:
        return found
    every: list = [None] * world
    torch.distributed.all_gather_object(every, found)
    return sorted({p for rank_found in every for p in rank_found})


def _meta_problem(path: Path) -> str | None:
    meta = read_meta(path)
    if meta is None or meta.get("format") != FORMAT or not isinstance(meta.get("step"), int):
        return f"{META} is not this project's (format {FORMAT}, with a step)"
    return None


#: How to make a checkpoint of your own that predates manifests loadable (recipes.run.manifest).
TRUST_FIX = "python -m recipes.run.manifest trust <dir> writes one for a checkpoint you saved yourself"


def find_resume(cfg: dict, run_dir: Path | None, deep: bool = True) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from (or None) and what to tell the user about the choice.

    ``checkpoint.resume``: null (start fresh), ``auto`` (the newest checkpoint under ``checkpoint_root``
    that verifies: its manifest's files, sizes and, with ``deep``, hashes; each one skipped is named;
    none at all: start fresh and say so), or a path (a checkpoint directory, or a directory of them).
    Nothing is loaded that does not verify: ``recipes.run.manifest``."""
    cfg = typed(cfg)
    resume = cfg.checkpoint.resume
    if not resume:
        return None, []
    root = checkpoint_root(cfg, run_dir) if resume == "auto" else Path(os.path.expanduser(resume))
    single = resume != "auto" and any((root / name).exists() for name in (manifest.MANIFEST, META, ".metadata"))
    steps, partial = ([root], []) if single else _step_dirs(root)
    notes = [f"partial checkpoint {p} ignored (a save did not finish)" for p in partial]
    for candidate in steps:
        found = verify(candidate, deep=deep)
        if not found:
            step = read_meta(candidate)["step"]
            latest = _latest_named(root)
            if not single and latest is not None and latest != candidate and latest.name > candidate.name:
                notes.append(f"{root / LATEST} names {latest.name}, which does not verify")
            return candidate, notes + [f"resuming from {candidate} (step {step})"]
        notes.append(f"skipped checkpoint {candidate}: " + "; ".join(found[:3]) + (" ..." if len(found) > 3 else ""))
    if single or steps:
        what = f"{root} does not verify" if single else f"no checkpoint under {root} verifies"
        raise ConfigError("checkpoint.resume", f"{what} ({'; '.join(notes[-len(steps):])}), so none is loaded: "
                          "a checkpoint is read with pickle, and one that changed after its save could run code",
                          f"if they are your own from before manifests, {TRUST_FIX}; otherwise start fresh with "
                          "checkpoint.resume=null and another checkpoint.dir (or rerun=true, which replaces them)")
    if resume != "auto":
        raise ConfigError("checkpoint.resume", f"no complete checkpoint in {root}",
                          "give a step_<n> directory written by this project, or checkpoint.resume=auto")
    return None, notes + [f"checkpoint.resume=auto: no checkpoint in {root}, starting from step 0"]


def discard(root: Path) -> list[Path]:
    """Delete every checkpoint of ``root`` (``step_*``, ``tmp.*``, ``latest``): ``rerun=true`` replaces a
    run. Returns the checkpoints deleted; nothing else in ``root`` is touched."""
    steps, partial = _step_dirs(root)
    for d in steps + partial:
        shutil.rmtree(d, ignore_errors=True)
    (root / LATEST).unlink(missing_ok=True)
    return steps


def _latest_named(root: Path) -> Path | None:
    try:
        return root / (root / LATEST).read_text().strip()
    except OSError:
        return None


def model_differences(meta: dict, cfg: dict) -> list[str]:
    """What differs between the checkpoint's model and this run's (``model.*`` fields)."""
    saved, now = meta.get("config", {}), as_dict(cfg)
    out = []
    for section in MODEL_KEYS:
        a, b = saved.get(section, {}), now.get(section, {})
        out += [f"{section}.{k}: checkpoint {a.get(k)!r}, this run {b.get(k)!r}"
                for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return out


def check_compatible(path: Path, cfg: dict) -> dict:
    """The checkpoint's ``meta.json``; refuses one saved from another model (family or shape)."""
    cfg = typed(cfg)
    meta = read_meta(path)
    if meta is None or meta.get("format") != FORMAT:
        raise ConfigError("checkpoint.resume", f"{path} is not a complete checkpoint of this project "
                          f"(no {META} with format {FORMAT})", "point checkpoint.resume at a step_<n> directory")
    diff = model_differences(meta, cfg)
    if diff:
        raise ConfigError("checkpoint.resume", f"{path} holds another model: " + "; ".join(diff),
                          "resume with the checkpoint's model settings, or start fresh (checkpoint.resume=null)")
    return meta


# --- the state ---------------------------------------------------------------------------------------


def _gpt(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        module = module.module
    return module


def model_state(trainer) -> dict:
    """``{"model": ...}`` or ``{"model0": ..., "model1": ...}`` (virtual stages), as Megatron-LM."""
    chunks = trainer.chunks
    if len(chunks) == 1:
        return {"model": _gpt(chunks[0]).sharded_state_dict()}
    return {f"model{i}": _gpt(c).sharded_state_dict() for i, c in enumerate(chunks)}


def _init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Empty AdamW moments (what the first step would create), so a load has tensors to fill."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            if st:
                continue
            fused = group.get("fused") or group.get("capturable")
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


#: The DistributedOptimizer's checkpoint format. megatron-core 0.19.2 defaults to
#: 'fully_sharded_model_space', whose flattened ShardedTensors its own torch_dist save refuses
#: ("ShardedTensor.flattened_range is not supported", seen on two H200s); 'fully_reshardable' (what
#: Megatron-LM's --dist-ckpt-optim-fully-reshardable picks) stores canonical per-parameter state, so a
#: checkpoint loads under another TP/PP/DP layout.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def optimizer_state(trainer, model_sd: dict, is_loading: bool) -> dict:
    """The optimizer's sharded state: megatron's own, or torch AdamW's mapped like FP32Optimizer."""
    opt = trainer.optimizer
    if hasattr(opt, "sharded_state_dict"):  # megatron's (DistributedOptimizer, chained)
        if is_loading:
            upstream.prime_distributed_optimizer_for_loading(opt)
        return opt.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIMIZER_METADATA)
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    _init_adam_state(opt)
    state = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
    if len(steps) > 1:
        raise CheckpointError(f"AdamW step counts differ per parameter ({sorted(steps)})")
    common_step = next((s["step"] for s in state["state"].values() if "step" in s), None)
    optim_state_to_sharding_state(state, get_param_id_to_sharded_param_map(model_sd, params),
                                  exclude_keys=("step",))
    if common_step is not None:
        state["state"]["common_step"] = common_step.clone()
    return state


def load_optimizer_state(trainer, state: dict) -> None:
    opt = trainer.optimizer
    if hasattr(opt, "sharded_state_dict"):
        opt.load_state_dict(state)
        return
    step = state["state"].pop("common_step", None)
    for param_state in state["state"].values():
        if step is not None:
            param_state["step"] = step.clone()
    opt.load_state_dict(state)


def rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    out = {"torch": torch.get_rng_state(),
           "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(dict(state["tracker"]))


def full_state(trainer, extra: dict, is_loading: bool) -> dict:
    """The sharded state dict of the whole run (model, optimizer, scheduler, data, RNG, step)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = model_state(trainer)
    merged: dict[str, Any] = {}
    for sd in model.values():
        merged.update(sd)
    per_rank = {"rng": rng_state(), "measured": json.dumps(extra.get("measured") or {})}
    return {
        **model,
        "optimizer": optimizer_state(trainer, merged, is_loading),
        "scheduler": trainer.scheduler.state_dict(),
        "step": trainer.step_count,
        "consumed_samples": trainer.data.consumed_samples,
        "consumed_valid_samples": trainer.valid_data.consumed_samples if trainer.valid_data else 0,
        "rank_state": ShardedObject("rank_state", per_rank, (world,), (rank,), replica_id=0),
    }


# --- save / load -------------------------------------------------------------------------------------


def _meta(cfg: dict, trainer) -> dict:
    return {"format": FORMAT, "step": trainer.step_count,
            "world_size": torch.distributed.get_world_size(), "global_batch_size": trainer.global_batch_size,
            "config": {k: v for k, v in as_dict(cfg).items() if k in ("model", "parallel", "train", "data")},
            "schedule": trainer.scheduler.state_dict()}


def save_checkpoint(trainer, cfg: dict, root: Path, measured: dict | None = None) -> Path:
    """Save step ``trainer.step_count`` under ``root``; returns the complete checkpoint's path.

    Raises ``CheckpointError`` naming the step, the directory and the error when any rank fails, for
    any exception class (torch's ``CheckpointException`` is a ``BaseException``). The manifest is
    written last; ``latest`` is rewritten and older checkpoints deleted (``checkpoint.keep_last``) only
    once the renamed directory verifies."""
    cfg = typed(cfg)
    from megatron.core import dist_checkpointing

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    step = trainer.step_count
    final = root / step_name(step)
    tmp = root / f"tmp.{final.name}"
    error = None
    try:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
    except OSError as err:
        error = f"{type(err).__name__}: {err}"
    _agree(error, f"cannot create {tmp} for the checkpoint of step {step}")
    cause = None
    try:
        state = full_state(trainer, {"measured": measured}, is_loading=False)
        dist_checkpointing.save(state, str(tmp), content_metadata=_meta(cfg, trainer)["config"]["model"])
        if rank == 0:
            write_json_atomic(tmp / META, _meta(cfg, trainer))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001  disk full, read-only, a rank's error, CheckpointException
        error, cause = describe(err), err
    _agree(error, f"saving the checkpoint of step {step} to {tmp} failed", cause)
    files: dict = {}
    try:  # every rank hashes its share of the files (the slow part of a manifest)
        names = [n for n in manifest.listed(tmp)[0] if n != META]
        files = manifest.entries(tmp, names[rank::world])
    except OSError as err:
        error, cause = f"{type(err).__name__}: {err}", err
    _agree(error, f"hashing the checkpoint of step {step} in {tmp} failed", cause)
    shares: list = [None] * world
    torch.distributed.all_gather_object(shares, files)
    try:
        if rank == 0:
            for share in shares:
                files.update(share)
            files.update(manifest.entries(tmp, [META]))
            manifest.write_manifest(tmp, files, step)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            found = manifest.problems(final, deep=False)
            if found:
                raise OSError(f"{final} does not verify after its save: {'; '.join(found[:3])}")
            _write_text_atomic(root / LATEST, final.name)
            _prune(root, cfg.checkpoint.keep_last, final)
    except OSError as err:
        error, cause = f"{type(err).__name__}: {err}", err
    _agree(error, f"finishing the checkpoint of step {step} in {final} failed", cause)
    return final


def describe(err: BaseException) -> str:
    """``Type: message``; torch's ``CheckpointException`` prints only its ranks, so its message comes first."""
    text = str(err).strip()
    if err.args and str(err.args[0]) not in text:
        text = f"{err.args[0]} ({text})"
    return f"{type(err).__name__}: {text}"


def _agree(error: str | None, what: str, cause: BaseException | None = None) -> None:
    """Every rank learns whether any rank failed; all raise the same CheckpointError."""
    errors = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(errors, error)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        rank, err = bad[0]
        raise CheckpointError(f"{what} (rank {rank}: {err}); training stopped. The last complete "
                              "checkpoint (if any) is still the one named in 'latest'") from cause


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def _prune(root: Path, keep_last: int | None, newest: Path) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints up to ``newest`` (the one just saved
    and verified, never deleted); 0, null or less keeps all. Checkpoints of later steps (from a run this
    one resumed before their step) are left alone. Returns what was deleted."""
    if not keep_last or keep_last < 1:
        return []
    complete, _ = complete_checkpoints(root)
    older = [d for d in complete if d.name < newest.name]
    doomed = older[:max(0, len(older) - (keep_last - 1))]
    for old in doomed:
        shutil.rmtree(old, ignore_errors=True)
    return doomed


def load_checkpoint(trainer, cfg: dict, path: Path, verified: bool = False) -> dict:
    """Load ``path`` into the trainer (model, optimizer, scheduler, data position, step, and the
    RNG states when the world size matches); returns ``{"step", "measured", "notes"}``. Nothing is read
    but JSON until it verifies against its manifest (``verified``: ``find_resume`` just checked it)."""
    cfg = typed(cfg)
    from megatron.core import dist_checkpointing

    from recipes.run.schedule import restep, resumed_horizon

    if not verified and (found := verify(path)):
        raise ConfigError("checkpoint.resume", f"{path} does not verify ({'; '.join(found[:3])}), so it is not "
                          "loaded: a checkpoint is read with pickle", f"resume another one; {TRUST_FIX}")
    meta = check_compatible(path, cfg)
    notes = []
    horizon = None
    if not cfg.checkpoint.override_scheduler:
        saved = _saved_scheduler(meta)
        if saved:
            horizon, said = resumed_horizon(saved, trainer.scheduler.state_dict(), cfg.train, str(path))
            notes += said
    notes += batch_differences(meta, cfg, trainer.global_batch_size)
    same_world = meta["world_size"] == torch.distributed.get_world_size()
    state = full_state(trainer, {}, is_loading=True)
    if not same_world:
        state.pop("rank_state")
        notes.append(f"saved with {meta['world_size']} ranks, loaded with "
                     f"{torch.distributed.get_world_size()}: RNG states start from the seed")
    try:
        loaded = dist_checkpointing.load(state, str(path))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001  torch's CheckpointException is a BaseException
        raise CheckpointError(f"loading the checkpoint {path} (step {meta['step']}) failed: {describe(err)}; "
                              "it matches its manifest, so it was saved this way") from err
    for i, chunk in enumerate(trainer.chunks):
        key = "model" if len(trainer.chunks) == 1 else f"model{i}"
        _gpt(chunk).load_state_dict(loaded[key], strict=True)
    load_optimizer_state(trainer, loaded["optimizer"])
    scheduler = trainer.scheduler
    if cfg.checkpoint.override_scheduler:
        scheduler.num_steps = int(loaded["step"])
        notes.append(f"checkpoint.override_scheduler=true: this run's train.* schedule applies from step {loaded['step']}")
    else:  # megatron keeps the checkpoint's values (use_checkpoint_opt_param_scheduler)
        scheduler.load_state_dict(loaded["scheduler"])
        if horizon is not None:
            scheduler.lr_decay_steps = scheduler.wd_incr_steps = horizon
    restep(scheduler)  # megatron's load steps before it sets the weight-decay horizon
    trainer.step_count = int(loaded["step"])
    trainer.data.seek(int(loaded["consumed_samples"]))
    if trainer.valid_data is not None:
        trainer.valid_data.seek(int(loaded["consumed_valid_samples"]))
    measured = {}
    if same_world:
        per_rank = loaded["rank_state"]
        set_rng_state(per_rank["rng"])
        measured = json.loads(per_rank["measured"])
    return {"step": trainer.step_count, "measured": measured, "notes": notes}


def batch_differences(meta: dict, cfg: dict, global_batch_size: int) -> list[str]:
    """Notes for a batch shape other than the checkpoint's: allowed (the data continues at the saved
    sample, as under Megatron-LM's batch-size ramp-up), but the next steps are not the saved run's."""
    cfg = typed(cfg)
    saved_train = (meta.get("config") or {}).get("train") or {}
    saved = {"global_batch_size": meta.get("global_batch_size"),
             **{key: saved_train.get(key) for key in ("micro_batch_size", "seq_length")}}
    now = {"global_batch_size": global_batch_size, "micro_batch_size": cfg.train.micro_batch_size,
           "seq_length": cfg.train.seq_length}
    return [f"saved with train.{key}={saved[key]}, resumed with {now[key]}: the data continues at the saved "
            f"sample, but the steps are not the saved run's (train.{key}={saved[key]} continues it exactly)"
            for key in now if saved[key] is not None and saved[key] != now[key]]


def _saved_scheduler(meta: dict) -> dict | None:
    """The checkpoint's schedule: as saved (``meta.json`` ``schedule``), else rebuilt from its ``train``."""
    if isinstance(meta.get("schedule"), dict):
        return meta["schedule"]
    train = (meta.get("config") or {}).get("train")
    if not train:
        return None
    from recipes.run.schedule import build_scheduler

    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    return build_scheduler(probe, train).state_dict()
