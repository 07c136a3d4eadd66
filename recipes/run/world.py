"""The process's distributed world and its random state: megatron's parallel groups from torchrun's
environment (``init_distributed``), or a one-rank world for benchmarks and tests (``init_one_rank``),
the RNGs a rank's model draws its weights from, torch's deterministic algorithms
(``train.deterministic``: ``use_deterministic``), and a fresh ``Trainer`` for a process that builds
several (``fresh_trainer``)."""

from __future__ import annotations

import os
import sys
import time

import torch

from launch.torchrun import set_one_rank_env
from recipes.build import compat, upstream
from recipes.config import typed
from recipes.errors import ConfigError
from recipes.run.trainer import Trainer
from recipes.validate.run import DETERMINISTIC_ENV, deterministic_env_problem


def init_distributed(cfg: dict, marks: dict | None = None) -> None:
    """torch.distributed from torchrun's environment, then megatron's parallel state.

    ``marks`` (the rank's timeline) gets when each part ended: on the H200 this "init" phase took
    8-14 s of a sweep point's 18-25 s, the largest fixed cost, so it is split to show which part.
    """
    cfg = typed(cfg)
    marks = {} if marks is None else marks
    use_deterministic(cfg)  # before CUDA, cuBLAS and NCCL start: they read its environment once
    # lazy: megatron's import is timed as its own phase (megatron_imported); the console shows it
    from megatron.core import parallel_state

    upstream.apply_all()  # imports megatron's transformer, MoE and optimizer modules
    marks["megatron_imported"] = time.time()
    if compat.cuda_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.init()  # the CUDA context now, so the next mark is the process group alone
    compat.install_cpu_compat()
    marks["device_ready"] = time.time()
    if not torch.distributed.is_initialized():
        backend = "nccl" if compat.cuda_available() else "gloo"
        torch.distributed.init_process_group(backend=backend)
    marks["process_group_ready"] = time.time()
    par = cfg.parallel
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size,
        context_parallel_size=par.context_parallel_size,
        expert_model_parallel_size=par.expert_model_parallel_size,
        expert_tensor_parallel_size=par.expert_tensor_parallel_size,
    )
    _seed(cfg)


def _seed(cfg: dict) -> None:
    """torch's and megatron's RNGs for this rank's model. As Megatron-LM does, each pipeline stage draws
    its own weights (seed + 100 * pp rank); megatron's local CUDA graphs need graph-safe generators."""
    from megatron.core import parallel_state

    compat.seed_model_parallel_rng(cfg.train.seed + 100 * parallel_state.get_pipeline_model_parallel_rank(),
                                   cudagraphable=False)  # no CUDA graphs in the schema (model.cuda_graph_impl)


def init_one_rank(cfg: dict) -> None:
    """A one-rank world in this process, for benchmarks and tests that build a Trainer without a launcher."""
    cfg = typed(cfg)
    set_one_rank_env()
    init_distributed(cfg)


def reseed(cfg: dict) -> None:
    """Before each of several models one process builds (benchmarks, tests): the RNGs seeded as a run
    seeds them, so equal seeds give equal weights, and a fresh MoE metrics tracker: megatron's is a
    process global sized by the first MoE model's layer count, which a later, deeper one would index
    past (moe_logging.py). A run builds one model and needs neither again."""
    cfg = typed(cfg)
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()
    use_deterministic(cfg)
    _seed(cfg)


def use_deterministic(cfg: dict) -> bool:
    """``train.deterministic``: torch's deterministic algorithms for this process (or, off, torch's default);
    returns whether on. megatron's half is ``TransformerConfig.deterministic_mode`` (``recipes.build.model``).

    On: ``torch.use_deterministic_algorithms(True)`` without warn_only, so an op with no deterministic
    kernel raises instead of drifting: index_add/scatter_add (MoE's combine, the gradient of index_select in
    the dispatcher) and the embedding's backward take their sorted kernels, SDPA runs flash's deterministic
    backward or the memory-efficient one with one key split and never cuDNN's (torch's dispatcher skips it),
    and ``torch.empty`` fills its memory (a cost).
    Inductor (``model.compile``, megatron's fused SwiGLU) skips the on-device benchmarking that picks kernels
    by time. The workers' environment (``recipes.run.workers``) carries cuBLAS's fixed workspace and one NCCL
    algorithm; a process started otherwise (benchmarks, tests) gets them here, before CUDA starts, unless
    they are already set to values that would break it (refused, as the controller refuses them)."""
    cfg = typed(cfg)
    on = bool(cfg.train.deterministic)
    if on:
        problem = deterministic_env_problem(os.environ)
        if problem:
            raise ConfigError("train.deterministic", *problem)
        for key, value in DETERMINISTIC_ENV.items():
            os.environ.setdefault(key, value)
    torch.use_deterministic_algorithms(on)
    if on or "torch._inductor.config" in sys.modules:  # megatron imports it; a CPU-only tool may not
        import torch._inductor.config as inductor

        inductor.deterministic = on or os.environ.get("TORCHINDUCTOR_DETERMINISTIC") == "1"
    return on


def fresh_trainer(cfg: dict) -> Trainer:
    """The worker's ``Trainer`` for ``cfg``, reseeded (``reseed``), in a process ``init_one_rank`` set up."""
    cfg = typed(cfg)
    reseed(cfg)
    return Trainer(cfg)


def rank_coordinates() -> dict:
    """This rank's place in every parallel dimension."""
    from megatron.core import parallel_state as ps

    return {
        "rank": torch.distributed.get_rank(),
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
    }
