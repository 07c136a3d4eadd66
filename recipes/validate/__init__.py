"""Cross-field rules, run by the controller before any worker starts (and by every tool that takes a config).

Every refusal is a ``ConfigError`` that names the option and the fix, in this project's vocabulary
(``recompute=selective/moe_act``, ``model=moe``, ``parallel.tensor_model_parallel_size=2``).

One module a concern: ``values`` (keys and ranges), ``model``, ``recompute`` (and ``share_storage``, the
extension some labels need built), ``offload``, ``parallel`` and ``run``; ``validate`` runs them in order.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from recipes.config import typed
from recipes.errors import check
from recipes.validate.model import check_attention, check_model
from recipes.validate.offload import check_offload
from recipes.validate.parallel import check_parallel
from recipes.validate.recompute import check_recompute, check_without_output_build
from recipes.validate.run import check_run
from recipes.validate.values import check_keys, check_values


def transformer_engine_importable() -> bool:
    """Whether Transformer Engine imports, checked without importing megatron (fast, quiet)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # installed but broken (e.g. no CUDA): treat as absent
        return False
    return True


#: Present where a GPU driver is loaded (NVIDIA's, or ROCm's for torch's HIP build).
GPU_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/kfd")


def gpu_count() -> int:
    """The GPUs this process sees (0 without CUDA). Without a GPU driver the answer is 0 without importing
    torch (seconds), so a refusal on a CPU machine answers before torch loads."""
    if not any(os.path.exists(path) for path in GPU_DRIVER_FILES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def validate(cfg: Any, num_gpus: int | None = None, te_available: bool | None = None,
             this_machine: bool = True) -> None:
    """Refuse configurations that would crash, silently do nothing, or measure the wrong thing. The
    host memory activation offload's copies need is checked after these, once the estimator can predict
    it (``recipes.validate.offload.host_memory_problem``, which the controller's ``check_point`` runs).
    ``this_machine=False``: another machine runs it (a Slurm node, whose controller checks it again before
    its GPUs start), so what this one has installed (a C++ compiler for megatron's build) is not asked."""
    if num_gpus is None:
        num_gpus = gpu_count()
    if te_available is None:
        te_available = transformer_engine_importable()
    check_keys(cfg)  # a plain dict's keys, before it becomes the typed config that has no others
    cfg = typed(cfg)
    check_values(cfg)
    check_model(cfg)
    check_attention(cfg, te_available)
    check_recompute(cfg)
    if this_machine:
        check_without_output_build(cfg, num_gpus)
    check_offload(cfg, num_gpus, te_available)
    check(num_gpus or not cfg.measure.trace_step, "measure.trace_step", "it traces GPU kernels, copies and "
           "idle time; this machine has no GPU", "run it on a GPU, or leave measure.trace_step=false")
    check(num_gpus or cfg.measure.gpu_time is not True, "measure.gpu_time", "it times the GPU's busy time "
           "in a profiled step; this machine has no GPU", "run it on a GPU, or set measure.gpu_time=null (on where "
           "there is a GPU) or false")
    check(not cfg.measure.module_times or cfg.model.compile == "none", "measure.module_times",
           f"forward hooks inside a layer compiled with model.compile={cfg.model.compile} would break "
           "its graph and time other code than the compiled run's", "leave measure.module_times=null (off when "
           "compiled) or set model.compile=none")
    check(not cfg.model.gradient_accumulation_fusion or (num_gpus and cfg.train.optimizer == "auto"),
           "model.gradient_accumulation_fusion", "it accumulates weight gradients into the fp32 main_grad buffers "
           "of megatron's DistributedOptimizer, which a CPU run or train.optimizer=adamw does not have",
           "leave model.gradient_accumulation_fusion=null (auto: on where it applies) or set it false")
    check(not cfg.model.apply_rope_fusion or num_gpus, "model.apply_rope_fusion",
           "the fused RoPE is a Triton kernel on the GPU; this machine has no GPU, so megatron's unfused RoPE "
           "would run anyway", "leave model.apply_rope_fusion=null (auto: fused on a GPU) or set it false")
    check(not cfg.model.apply_rope_fusion or cfg.model.position_embedding_type == "rope",
           "model.apply_rope_fusion", f"position_embedding_type={cfg.model.position_embedding_type} has "
           "no rotary embedding to fuse", "leave model.apply_rope_fusion=null or set it false")
    check(not cfg.model.apply_rope_fusion or cfg.model.compile == "none", "model.apply_rope_fusion",
           f"model.compile={cfg.model.compile} fuses RoPE itself; the Triton kernels inside its graphs were not "
           "checked", "leave model.apply_rope_fusion=null (auto: off when compiled) or set model.compile=none")
    for cap in ("memory_fraction", "memory_budget_gib"):
        check(num_gpus or getattr(cfg.measure, cap) is None, f"measure.{cap}", "it caps a GPU's allocator; "
               "this machine has no GPU, so the cap would do nothing", f"run it on a GPU, or set measure.{cap}=null")
    check_parallel(cfg, num_gpus)
    check_run(cfg)
