"""Recompute: the granularity and its settings, each label against the model, and what a label needs built."""

from __future__ import annotations

from recipes.config import typed
from recipes.errors import ConfigError, check
from recipes.recompute import LABELS, chunk_layers, labels_of
from recipes.validate.share_storage import share_storage_build_problem, share_storage_labels


def layers_per_chunk(cfg) -> int:
    """Layers in each model chunk (a pipeline stage, or a virtual stage under interleaving): the range
    of full recompute's ``recompute_num_layers``, which megatron applies per chunk."""
    cfg = typed(cfg)
    return min(len(r) for r in chunk_layers(cfg.model, cfg.parallel))


def check_recompute(cfg) -> None:
    cfg = typed(cfg)
    rc, m, par = cfg.recompute, cfg.model, cfg.parallel
    gran = rc.recompute_granularity
    check(gran in (None, "selective", "full"), "recompute.recompute_granularity",
           f"unknown granularity {gran!r}", "use recompute=none, control, selective/<label> or full")
    if gran is None:
        check(not rc.recompute_modules, "recompute.recompute_modules",
               "modules are listed but recompute is off (granularity null): they would be ignored",
               "use recompute=selective/<label>, or recompute=control for an empty selective list")
    if gran != "full":
        check(rc.recompute_method is None and rc.recompute_num_layers is None,
               "recompute.recompute_method", "method/num_layers only apply to full recompute",
               "use recompute=full or recompute=full/block, or drop recompute_method/num_layers")
        check(not rc.distribute_saved_activations, "recompute.distribute_saved_activations",
               "distributing saved activations only applies to full recompute (a silent no-op here)",
               "use recompute=full, or set recompute.distribute_saved_activations=false")
    if gran == "full":
        check(not rc.recompute_modules, "recompute.recompute_modules",
               "full recompute ignores recompute_modules", "drop recompute_modules, or use selective")
        check(rc.recompute_method in ("uniform", "block"), "recompute.recompute_method",
               f"full recompute needs method uniform or block, got {rc.recompute_method!r}",
               "use recompute=full (uniform) or recompute=full/block")
        per_stage = layers_per_chunk(cfg)
        n = rc.recompute_num_layers
        check(n is not None and 1 <= n <= per_stage, "recompute.recompute_num_layers",
               f"{n} is outside 1..{per_stage} (layers per pipeline stage)",
               f"set recompute.recompute_num_layers between 1 and {per_stage}")
        if rc.distribute_saved_activations:
            check(not par.sequence_parallel, "recompute.distribute_saved_activations",
                   "cannot distribute saved activations with sequence parallel",
                   "set parallel.sequence_parallel=false or distribute_saved_activations=false")
    modules = list(rc.recompute_modules or [])
    twice = sorted({m for m in modules if modules.count(m) > 1})
    check(not twice, "recompute.recompute_modules", f"{', '.join(twice)} listed twice (megatron would wrap it "
          "once; the run's name and the report would count it twice)", "list each label once, e.g. "
          f"recompute.recompute_modules=[{','.join(dict.fromkeys(modules))}]")
    for label in labels_of(cfg):
        check(label in LABELS, "recompute.recompute_modules", f"unknown label {label!r}",
               f"use labels from: {', '.join(LABELS)}")
        info = LABELS[label]
        check(info.applies(m), f"recompute=selective/{label}",
               f"{label} recomputes {info.what}, but model={m.family} has none "
               "(megatron-core would accept it and recompute nothing)", info.instead)
        if label == "shared_experts":
            check(bool(m.moe_shared_expert_intermediate_size), "recompute=selective/shared_experts",
                   "the model has no shared experts (a silent no-op)", info.instead)
            check(not m.moe_shared_expert_overlap, "recompute=selective/shared_experts",
                   "shared_experts recompute cannot work with shared-expert overlap",
                   "set model.moe_shared_expert_overlap=false")
        if label == "moe_act":
            check(m.experts == "grouped", "recompute=selective/moe_act",
                   "model.experts=sequential (megatron's SequentialMLP) silently ignores moe_act",
                   "use model.experts=grouped (the default for model=moe)")
        if label == "layernorm":
            check(cfg.attention.backend != "te", "recompute=selective/layernorm",
                   "with Transformer Engine the norms are fused into the following linear, so "
                   "layernorm recompute does nothing", "use attention=sdpa/unfused, or another label")
    if (gran == "full" or "moe" in labels_of(cfg)) and par.overlap_moe_expert_parallel_comm:
        raise ConfigError("parallel.overlap_moe_expert_parallel_comm",
                          "whole-moe and full recompute are incompatible with expert-parallel "
                          "communication overlap", "set parallel.overlap_moe_expert_parallel_comm=false")

def check_without_output_build(cfg, num_gpus: int) -> None:
    """The labels that need megatron's ``share_storage`` extension, checked before any GPU time. A run
    without a GPU hands the memory over in Python where torch can
    (``recipes.build.upstream.share_recomputed_cpu_outputs_without_a_cpp_build``)."""
    cfg = typed(cfg)
    needs = share_storage_labels(cfg, num_gpus)
    problem = share_storage_build_problem() if needs else None
    if problem is None:
        return
    raise ConfigError(f"recompute=selective/{needs[0]}",
                      f"megatron-core replays {', '.join(needs)} through CheckpointWithoutOutput, which compiles "
                      "a C++ extension (share_storage, with torch.utils.cpp_extension and ninja) at a machine's "
                      f"first recompute: {problem}",
                      "install a C++ compiler (e.g. apt install g++) and ninja (pip install ninja), or build it "
                      "once where they are into a TORCH_EXTENSIONS_DIR this machine reads, or use a label without "
                      "it (core_attn, mlp with recompute.mlp_replays_fc2=true, moe, full)")
