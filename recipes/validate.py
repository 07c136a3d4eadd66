"""Cross-field rules, run by the controller before any worker starts (and by every tool that takes a config).

Every refusal is a ``ConfigError`` that names the option and the fix, in this project's vocabulary
(``recompute=selective/moe_act``, ``model=moe``, ``parallel.tensor_model_parallel_size=2``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import os
from typing import Any

from recipes.config import COMPILE_SCOPES, RecipeConfig
from recipes.errors import ConfigError
from recipes.files import GIB
from recipes.offload import layer_offload_problem, option_of, rule_problem
from recipes.recompute import (
    ATTENTION_KIND,
    BACKENDS,
    FAMILIES,
    LABELS,
    MLP_KIND,
    chunk_layers,
    labels_of,
    layer_kinds,
    replays_without_output,
)


def transformer_engine_importable() -> bool:
    """Whether Transformer Engine imports, checked without importing megatron (fast, quiet)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # installed but broken (e.g. no CUDA): treat as absent
        return False
    return True


def _check(cond: bool, option: str, problem: str, fix: str) -> None:
    if not cond:
        raise ConfigError(option, problem, fix)


def gpu_count() -> int:
    """The GPUs this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def validate(cfg: Any, num_gpus: int | None = None, te_available: bool | None = None,
             planned_host_bytes: int | None = None) -> None:
    """Refuse configurations that would crash, silently do nothing, or measure the wrong thing.

    ``planned_host_bytes``: the host memory one rank's activation offload is predicted to hold (the
    estimator's), checked against the node's host memory (``host_memory_problem``)."""
    if num_gpus is None:
        num_gpus = gpu_count()
    if te_available is None:
        te_available = transformer_engine_importable()
    _validate_keys(cfg)
    _validate_values(cfg)
    _validate_model(cfg)
    _validate_attention(cfg, te_available)
    _validate_recompute(cfg)
    _validate_without_output_build(cfg, num_gpus)
    _validate_offload(cfg, num_gpus, te_available, planned_host_bytes)
    _check(num_gpus or not cfg["measure"]["trace_step"], "measure.trace_step", "it traces GPU kernels, copies and "
           "idle time; this machine has no GPU", "run it on a GPU, or leave measure.trace_step=false")
    _check(num_gpus or cfg["measure"]["gpu_time"] is not True, "measure.gpu_time", "it times the GPU's busy time "
           "in a profiled step; this machine has no GPU", "run it on a GPU, or set measure.gpu_time=null (on where "
           "there is a GPU) or false")
    _check(not cfg["measure"]["module_times"] or cfg["model"]["compile"] == "none", "measure.module_times",
           f"forward hooks inside a layer compiled with model.compile={cfg['model']['compile']} would break "
           "its graph and time other code than the compiled run's", "leave measure.module_times=null (off when "
           "compiled) or set model.compile=none")
    _check(not cfg["model"]["gradient_accumulation_fusion"] or (num_gpus and cfg["train"]["optimizer"] == "auto"),
           "model.gradient_accumulation_fusion", "it accumulates weight gradients into the fp32 main_grad buffers "
           "of megatron's DistributedOptimizer, which a CPU run or train.optimizer=adamw does not have",
           "leave model.gradient_accumulation_fusion=null (auto: on where it applies) or set it false")
    _check(not cfg["model"]["apply_rope_fusion"] or num_gpus, "model.apply_rope_fusion",
           "the fused RoPE is a Triton kernel on the GPU; this machine has no GPU, so megatron's unfused RoPE "
           "would run anyway", "leave model.apply_rope_fusion=null (auto: fused on a GPU) or set it false")
    _check(not cfg["model"]["apply_rope_fusion"] or cfg["model"]["position_embedding_type"] == "rope",
           "model.apply_rope_fusion", f"position_embedding_type={cfg['model']['position_embedding_type']} has "
           "no rotary embedding to fuse", "leave model.apply_rope_fusion=null or set it false")
    _check(not cfg["model"]["apply_rope_fusion"] or cfg["model"]["compile"] == "none", "model.apply_rope_fusion",
           f"model.compile={cfg['model']['compile']} fuses RoPE itself; the Triton kernels inside its graphs were not "
           "checked", "leave model.apply_rope_fusion=null (auto: off when compiled) or set model.compile=none")
    for cap in ("memory_fraction", "memory_budget_gib"):
        _check(num_gpus or cfg["measure"].get(cap) is None, f"measure.{cap}", "it caps a GPU's allocator; "
               "this machine has no GPU, so the cap would do nothing", f"run it on a GPU, or set measure.{cap}=null")
    _validate_parallel(cfg, num_gpus)
    _validate_run(cfg)


def _validate_keys(cfg) -> None:
    """Every key is a field of the schema. Hydra refuses unknown keys at compose time, except those
    added with ``+`` (``+model.foo=1``): megatron would fail on them in the worker, or ignore them."""
    for section, value in cfg.items():
        fields = {f.name: f for f in dataclasses.fields(RecipeConfig)}
        if section not in fields:
            _unknown(section, list(fields))
        schema = fields[section].default_factory if fields[section].default_factory is not dataclasses.MISSING else None
        if isinstance(value, dict) and dataclasses.is_dataclass(schema):
            known = [f.name for f in dataclasses.fields(schema)]
            for key in value:
                if key not in known:
                    _unknown(f"{section}.{key}", known)


def _unknown(key: str, known: list[str]) -> None:
    near = difflib.get_close_matches(key.split(".")[-1], known, n=1)
    hint = f" (did you mean {key.rsplit('.', 1)[0] + '.' if '.' in key else ''}{near[0]}?)" if near else ""
    raise ConfigError(key, "is not a setting of this schema (added with +, so Hydra did not check it; megatron "
                      "would fail on it in the worker or ignore it)", f"drop +{key}{hint}")


#: Sizes and counts that must be at least 1 (None, where the schema allows it, means "not set").
POSITIVE = {
    "model": ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "vocab_size", "rotary_base", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
              "qk_pos_emb_head_dim", "v_head_dim", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
              "moe_shared_expert_intermediate_size", "linear_attention_freq", "linear_conv_kernel_dim",
              "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads"),
    "train": ("train_iters", "micro_batch_size", "global_batch_size", "seq_length"),
    "measure": ("start_step", "steps"),
    "parallel": ("expert_tensor_parallel_size",),
    "data": ("eval_iters",),
    "launcher": ("cpu_cores_per_rank",),
}
#: (section, key, lowest, highest, whether the lowest is allowed, whether the highest is, the fix's example)
RANGES = (
    ("model", "hidden_dropout", 0.0, 1.0, True, False, "0.1"),
    ("model", "attention_dropout", 0.0, 1.0, True, False, "0.1"),
    ("model", "init_method_std", 0.0, float("inf"), False, False, "0.02"),
    ("model", "moe_aux_loss_coeff", 0.0, float("inf"), True, False, "0.01"),
    ("train", "lr", 0.0, float("inf"), False, False, "1e-4"),
    ("train", "weight_decay", 0.0, float("inf"), True, False, "0.01"),
    ("train", "clip_grad", 0.0, float("inf"), True, False, "1.0"),
    ("train", "seed", 0, 2**32 - 1, True, True, "1234"),
    ("data", "eval_interval", 0, float("inf"), True, False, "0 (off) or 10"),
    ("train", "manual_gc_interval", 0, float("inf"), True, False, "100 (0: never during training)"),
    ("data", "num_workers", 0, float("inf"), True, False, "0"),
    ("measure", "peak_tflops", 0.0, float("inf"), False, False, "989"),
    ("launcher", "master_port", 0, 65535, True, True, "0 (a free port)"),
)


def _validate_values(cfg) -> None:
    """Each value on its own: positive sizes and counts, numbers inside their range (before any rule
    divides by them: ``num_attention_heads=0`` must be refused, not raise ZeroDivisionError)."""
    for section, keys in POSITIVE.items():
        for key in keys:
            value = cfg[section].get(key)
            _check(value is None or value >= 1, f"{section}.{key}", f"{value} is not a size or count (it must be "
                   "at least 1)", f"set {section}.{key} to a positive number"
                   + (", or null" if value is not None and _optional(section, key) else ""))
    for section, key, low, high, low_ok, high_ok, example in RANGES:
        value = cfg[section].get(key)
        inside = (low <= value if low_ok else low < value) and (value <= high if high_ok else value < high)
        if high == float("inf"):
            bounds = f"{'>=' if low_ok else '>'} {low}"
        else:
            bounds = f"in {'[' if low_ok else '('}{low}, {high}{']' if high_ok else ')'}"
        _check(value is not None and inside, f"{section}.{key}", f"{value} is not {bounds}",
               f"set {section}.{key} {bounds}, e.g. {section}.{key}={example}")
    pos = cfg["model"]["position_embedding_type"]
    _check(pos in ("rope", "learned_absolute", "none"), "model.position_embedding_type",
           f"unknown position embedding {pos!r}", "use rope, learned_absolute or none")


def _optional(section: str, key: str) -> bool:
    factory = next(f.default_factory for f in dataclasses.fields(RecipeConfig) if f.name == section)
    field = next(f for f in dataclasses.fields(factory) if f.name == key)
    return "Optional" in str(field.type)


def _validate_model(cfg) -> None:
    m = cfg["model"]
    _check(m["family"] in FAMILIES, "model", f"unknown family {m['family']!r}",
           f"use model=<one of {', '.join(FAMILIES)}>")
    _check(not m["add_bias_linear"], "model.add_bias_linear",
           "biases break megatron-core 0.19.2's selective mlp recompute (infinite recursion in "
           "backward) and MoE (in-place error, mlp.py:354)", "keep model.add_bias_linear=false")
    _check(m["normalization"] in ("RMSNorm", "LayerNorm"), "model.normalization",
           f"unknown normalization {m['normalization']!r}", "use model.normalization=RMSNorm or LayerNorm")
    _check(m["activation"] in ("silu", "gelu"), "model.activation",
           f"unknown activation {m['activation']!r}", "use model.activation=silu or gelu")
    _check(not m["bias_activation_fusion"] or m["gated_linear_unit"], "model.bias_activation_fusion",
           f"megatron's fused {m['activation']} without a gated linear unit needs biases, which "
           "model.add_bias_linear=false leaves out (its MLP asserts)",
           "set model.bias_activation_fusion=null (auto: fused SwiGLU only) or false")
    _check(not m["bias_activation_fusion"] or MLP_KIND[m["family"]] != "moe" or m["experts"] != "grouped"
           or m["activation"] == "silu", "model.bias_activation_fusion",
           f"the grouped experts fuse SwiGLU only, not gated {m['activation']}",
           "set model.bias_activation_fusion=null (auto: fused SwiGLU only) or false")
    _check(m["compile"] in COMPILE_SCOPES, "model.compile", f"unknown scope {m['compile']!r}",
           f"use model.compile=<one of {', '.join(COMPILE_SCOPES)}>")
    _check(m["compile"] != "layer" or MLP_KIND[m["family"]] != "moe", "model.compile",
           "a compiled MoE layer stops at a device-side assert in torch._grouped_mm on a GPU (torch 2.11, "
           "the H200 run in docs/speed.md)", "use model.compile=attention (the experts stay eager) or none")
    _check(m["compile"] == "none" or ATTENTION_KIND[m["family"]] != "gdn", "model.compile",
           "the GatedDeltaNet layers' fla Triton kernels are not compiled or checked under torch.compile",
           "use model.compile=none with this family")
    heads, groups = m["num_attention_heads"], m["num_query_groups"] or m["num_attention_heads"]
    _check(heads % groups == 0, "model.num_query_groups",
           f"{heads} attention heads are not divisible into {groups} query groups",
           "pick num_query_groups dividing num_attention_heads")
    if m["kv_channels"] is None and ATTENTION_KIND[m["family"]] != "mla":
        _check(m["hidden_size"] % heads == 0, "model.hidden_size",
               f"hidden_size {m['hidden_size']} is not divisible by {heads} heads",
               "set model.kv_channels or a hidden size divisible by the head count")
    layer_kinds(m)  # the layer pattern reads (moe_layer_freq, linear_attention_freq), or ConfigError
    if MLP_KIND[m["family"]] == "moe":
        _check(bool(m["num_moe_experts"]), "model.num_moe_experts", f"model={m['family']} needs experts",
               "set model.num_moe_experts (e.g. 8)")
        _check(m["moe_router_topk"] <= m["num_moe_experts"], "model.moe_router_topk",
               f"top-{m['moe_router_topk']} of {m['num_moe_experts']} experts",
               "use moe_router_topk <= num_moe_experts")
        _check(m["experts"] in ("grouped", "sequential"), "model.experts",
               f"unknown experts module {m['experts']!r}", "use model.experts=grouped or sequential")
        _check(m["moe_token_dispatcher_type"] in ("local", "allgather", "alltoall"),
               "model.moe_token_dispatcher_type", f"{m['moe_token_dispatcher_type']!r} is not "
               "supported here", "use local (expert parallel 1, no host syncs), allgather (any device "
               "and layout) or alltoall (GPU)")
        factor = m["moe_expert_capacity_factor"]
        _check(factor is None or factor > 0, "model.moe_expert_capacity_factor",
               f"{factor} is not a capacity (tokens per expert over the balanced share)",
               "use null (no token dropping) or a factor > 0, e.g. 1.25")
        _check(factor is None or m["moe_token_dispatcher_type"] != "local", "model.moe_token_dispatcher_type",
               f"the local dispatcher needs every token routed to exactly top-k experts, but "
               f"model.moe_expert_capacity_factor={factor} drops tokens (their count is then known "
               "only on the device)", "use model.moe_token_dispatcher_type=allgather to drop tokens, "
               "or model.moe_expert_capacity_factor=null")
    if ATTENTION_KIND[m["family"]] == "gdn":
        freq = m["linear_attention_freq"]
        _check(freq is not None and (not isinstance(freq, int) or freq >= 2), "model.linear_attention_freq",
               f"{freq} leaves no GatedDeltaNet layers (every N-th layer is standard attention)",
               "use model.linear_attention_freq=4 (3 GDN : 1 attention), or model=standard_attn")
        kh, vh = m["linear_num_key_heads"], m["linear_num_value_heads"]
        _check(vh % kh == 0, "model.linear_num_value_heads",
               f"{vh} GDN value heads are not a multiple of {kh} key heads",
               "pick linear_num_value_heads as a multiple of linear_num_key_heads")
        _check(m["activation"] in ("silu", "swish"), "model.activation",
               f"megatron's GatedDeltaNet runs its causal conv with the model's activation, and fla's "
               f"kernel asserts SiLU on a GPU: {m['activation']!r} would fail in the first forward",
               f"use model.activation=silu for model={m['family']}")


def _validate_attention(cfg, te_available: bool) -> None:
    backend = cfg["attention"]["backend"]
    _check(backend in BACKENDS, "attention", f"unknown backend {backend!r}",
           f"use attention=<one of {', '.join(BACKENDS)}>")
    if backend == "te":
        _check(te_available, "attention=te", "Transformer Engine is not installed (it does not "
               "import here)", "use attention=sdpa (flash/cuDNN through PyTorch) or attention=unfused")


def layers_per_chunk(cfg) -> int:
    """Layers in each model chunk (a pipeline stage, or a virtual stage under interleaving): the range
    of full recompute's ``recompute_num_layers``, which megatron applies per chunk."""
    return min(len(r) for r in chunk_layers(cfg["model"], cfg["parallel"]))


def _validate_recompute(cfg) -> None:
    rc, m, par = cfg["recompute"], cfg["model"], cfg["parallel"]
    gran = rc["recompute_granularity"]
    _check(gran in (None, "selective", "full"), "recompute.recompute_granularity",
           f"unknown granularity {gran!r}", "use recompute=none, control, selective/<label> or full")
    if gran is None:
        _check(not rc["recompute_modules"], "recompute.recompute_modules",
               "modules are listed but recompute is off (granularity null): they would be ignored",
               "use recompute=selective/<label>, or recompute=control for an empty selective list")
    if gran != "full":
        _check(rc["recompute_method"] is None and rc["recompute_num_layers"] is None,
               "recompute.recompute_method", "method/num_layers only apply to full recompute",
               "use recompute=full or recompute=full/block, or drop recompute_method/num_layers")
        _check(not rc["distribute_saved_activations"], "recompute.distribute_saved_activations",
               "distributing saved activations only applies to full recompute (a silent no-op here)",
               "use recompute=full, or set recompute.distribute_saved_activations=false")
    if gran == "full":
        _check(not rc["recompute_modules"], "recompute.recompute_modules",
               "full recompute ignores recompute_modules", "drop recompute_modules, or use selective")
        _check(rc["recompute_method"] in ("uniform", "block"), "recompute.recompute_method",
               f"full recompute needs method uniform or block, got {rc['recompute_method']!r}",
               "use recompute=full (uniform) or recompute=full/block")
        per_stage = layers_per_chunk(cfg)
        n = rc["recompute_num_layers"]
        _check(n is not None and 1 <= n <= per_stage, "recompute.recompute_num_layers",
               f"{n} is outside 1..{per_stage} (layers per pipeline stage)",
               f"set recompute.recompute_num_layers between 1 and {per_stage}")
        if rc["distribute_saved_activations"]:
            _check(not par["sequence_parallel"], "recompute.distribute_saved_activations",
                   "cannot distribute saved activations with sequence parallel",
                   "set parallel.sequence_parallel=false or distribute_saved_activations=false")
    for label in labels_of(cfg):
        _check(label in LABELS, "recompute.recompute_modules", f"unknown label {label!r}",
               f"use labels from: {', '.join(LABELS)}")
        info = LABELS[label]
        _check(info.applies(m), f"recompute=selective/{label}",
               f"{label} recomputes {info.what}, but model={m['family']} has none "
               "(megatron-core would accept it and recompute nothing)", info.instead)
        if label == "shared_experts":
            _check(bool(m["moe_shared_expert_intermediate_size"]), "recompute=selective/shared_experts",
                   "the model has no shared experts (a silent no-op)", info.instead)
            _check(not m["moe_shared_expert_overlap"], "recompute=selective/shared_experts",
                   "shared_experts recompute cannot work with shared-expert overlap",
                   "set model.moe_shared_expert_overlap=false")
        if label == "moe_act":
            _check(m["experts"] == "grouped", "recompute=selective/moe_act",
                   "model.experts=sequential (megatron's SequentialMLP) silently ignores moe_act",
                   "use model.experts=grouped (the default for model=moe)")
        if label == "layernorm":
            _check(cfg["attention"]["backend"] != "te", "recompute=selective/layernorm",
                   "with Transformer Engine the norms are fused into the following linear, so "
                   "layernorm recompute does nothing", "use attention=sdpa/unfused, or another label")
    if (gran == "full" or "moe" in labels_of(cfg)) and par["overlap_moe_expert_parallel_comm"]:
        raise ConfigError("parallel.overlap_moe_expert_parallel_comm",
                          "whole-moe and full recompute are incompatible with expert-parallel "
                          "communication overlap", "set parallel.overlap_moe_expert_parallel_comm=false")


@functools.cache
def torch_swaps_storages() -> bool:
    """Whether this torch can swap two storages' memory (``UntypedStorage._swap_data_ptr_``; torch 2.11
    cannot), which ``recipes.build.upstream`` needs to hand recomputed CPU outputs over without
    megatron's C++ extension."""
    import torch

    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def share_storage_built() -> bool | None:
    """Whether megatron's ``share_storage`` extension is built in this machine's extensions directory
    (torch's own choice: ``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions/<py>_<cuda>``), or
    None where this torch does not say."""
    from torch.utils import cpp_extension

    try:
        return os.path.exists(os.path.join(cpp_extension._get_build_directory("share_storage_ext", False),
                                           "share_storage_ext.so"))
    except Exception:
        return None


def share_storage_labels(cfg, num_gpus: int) -> list[str]:
    """The labels of ``cfg`` that replay through megatron's ``CheckpointWithoutOutput`` and so need its
    ``share_storage`` extension on this machine ([] on a CPU, where ``recipes.build.upstream`` hands
    the memory over in Python wherever torch can swap storages)."""
    rc = cfg["recompute"]
    if rc["recompute_granularity"] != "selective" or (not num_gpus and torch_swaps_storages()):
        return []
    return [label for label in labels_of(cfg) if replays_without_output(label, rc)]


def share_storage_build_problem() -> str | None:
    """Why megatron-core 0.19.2's ``share_storage`` extension can neither be loaded nor built on this
    machine, or None. ``CheckpointWithoutOutput._recompute`` (tensor_parallel/random.py,
    ``_get_share_storage``) compiles it with ``torch.utils.cpp_extension.load_inline`` at the first
    recompute: ninja always (it checks the build), a C++ compiler when the library is not yet built
    in ``TORCH_EXTENSIONS_DIR`` (a fresh H200 machine spent 13-24 s on it, docs/speed.md). When megatron
    stops building it, tests/test_upstream.py's ``test_checkpoint_without_output_still_builds_a_cpp_extension``
    fails: delete this check with the workaround."""
    import shutil

    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not on PATH (torch runs it to build and to load the extension)"
    built = share_storage_built()
    if built is None:  # a torch without the helper: leave it to the run
        return None
    compiler = os.environ.get("CXX", "c++")
    if not built and shutil.which(compiler) is None:
        return f"there is no C++ compiler ({compiler}) and the extension is not built yet"
    return None


def _validate_without_output_build(cfg, num_gpus: int) -> None:
    """The labels that need megatron's ``share_storage`` extension, checked before any GPU time. A run
    without a GPU hands the memory over in Python where torch can
    (``recipes.build.upstream.share_recomputed_cpu_outputs_without_a_cpp_build``)."""
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


def host_memory_available() -> int | None:
    """Bytes of host memory available on this machine now (``MemAvailable``), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _validate_offload(cfg, num_gpus: int, te_available: bool, planned_host_bytes: int | None) -> None:
    """Activation offload: megatron-core's rules, the silent no-ops, the machine, the host's memory."""
    off, rc, m = cfg.get("offload") or {}, cfg["recompute"], cfg["model"]
    if not off:  # a result written before offload existed
        return
    modules = list(off["offload_modules"] or [])
    fine = off["fine_grained_activation_offloading"]
    _check(fine or not modules, "offload.offload_modules",
           "modules are listed but fine-grained offload is off: they would be ignored",
           "use offload=<option> (conf/offload/), or set offload.fine_grained_activation_offloading=true")
    _check(not fine or modules, "offload.offload_modules", "fine-grained offload is on with no modules (megatron-core "
           "asserts)", "use offload=none, or offload=<option> such as core_attn-attn_proj")
    _check(off["min_offloaded_tensor_size"] >= 0, "offload.min_offloaded_tensor_size",
           f"{off['min_offloaded_tensor_size']} is negative", "use 0 (offload every saved tensor) or more elements")
    _check(0.0 <= off["activation_offload_fraction"] <= 1.0, "offload.activation_offload_fraction",
           f"{off['activation_offload_fraction']} is not in [0, 1]", "use a fraction in [0, 1], e.g. 1.0")
    recompute_on = rc["recompute_granularity"] is not None
    problem = layer_offload_problem(off["cpu_offloading"], te_available, recompute_on,
                                    cfg["parallel"]["pipeline_model_parallel_size"], fine)
    if problem:
        raise ConfigError(*problem)
    if not modules:  # offload.emulate_on_cpu without offload changes nothing (a sweep over offload=none,...)
        return
    labels = None if rc["recompute_granularity"] == "full" else frozenset(labels_of(cfg))
    problem = rule_problem(modules, labels, m, cfg["parallel"]["pipeline_model_parallel_size"])
    if problem:
        raise ConfigError(*problem)
    option = f"offload={option_of(cfg)}"
    _check(m["compile"] == "none", "model.compile", f"{option} inside a compiled layer is not "
           "checked: megatron's offload manager commits and reloads its groups from Python inside the layer's "
           "forward, which torch.compile would trace", f"set model.compile=none with {option}, or offload=none")
    if num_gpus:
        _check(not off["emulate_on_cpu"], "offload.emulate_on_cpu", "emulated copy streams are for a CPU "
               "run's tests; this machine has a GPU, where the offload is real", "set offload.emulate_on_cpu=false")
    else:
        _check(off["emulate_on_cpu"], option, "a CPU-only run has no device memory to relieve: offloading "
               "would copy CPU memory to CPU memory", "run it on a GPU, or set offload.emulate_on_cpu=true to "
               "test the offload path on a CPU (copies to a second buffer through emulated streams)")
    if cfg["measure"]["ledger"]:
        _check(cfg["train"]["train_iters"] >= 3, "train.train_iters", "with offload the first step plans it "
               "(megatron's warm-up) and the second records the ledger: 2 steps measure nothing",
               "set train.train_iters>=3, or measure.ledger=false")
    problem = host_memory_problem(cfg, planned_host_bytes)
    if problem:
        raise ConfigError(*problem)


def host_memory_problem(cfg: dict, planned_host_bytes: int | None,
                        job_memory_gib: float | None = None) -> tuple[str, str, str] | None:
    """(option, problem, fix) where the host memory one rank's offload is predicted to hold
    (``recipes.predict.estimate.planned_host_bytes``), times the ranks of a node, is above
    ``offload.host_memory_gib``, else ``job_memory_gib`` (a Slurm job's memory per node, checked
    before submitting), else this machine's available memory; else None. The validator refuses such a
    run before launch, and the planner such a plan."""
    if not planned_host_bytes:
        return None
    launch, off = cfg["launcher"], cfg["offload"]
    per_node = planned_host_bytes * launch["nproc_per_node"]
    given = off["host_memory_gib"]
    if given is not None:
        host, where = int(given * GIB), "offload.host_memory_gib"
    elif job_memory_gib is not None:
        host, where = int(job_memory_gib * GIB), f"the job's memory per node, hydra.launcher.mem_gb={job_memory_gib:g}"
    else:
        host, where = host_memory_available(), "this machine's available memory"
    if host is None or per_node <= host:
        return None
    more = ("or ask Slurm for more memory per node (hydra.launcher.mem_gb)" if job_memory_gib is not None and given is None
            else "free host memory, or set offload.host_memory_gib to the nodes' memory if they are not this machine")
    return (f"offload={option_of(cfg)}",
            f"the copies are predicted at {_size(per_node)} of host memory per node "
            f"({_size(planned_host_bytes)} per rank x {launch['nproc_per_node']} "
            f"rank{'s' if launch['nproc_per_node'] > 1 else ''}), above {where} ({_size(host)})",
            f"offload fewer modules (a smaller conf/offload option), use recompute instead, {more}")


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.1f} MiB"


def validate_cores(cfg, usable: int) -> None:
    """``launcher.cpu_cores_per_rank`` against the ``usable`` cores of this process (its affinity mask),
    before a local launch (not in ``validate``: a prediction or a report for another machine must not
    depend on this one)."""
    launch = cfg["launcher"]
    per_rank, nproc = launch.get("cpu_cores_per_rank"), launch["nproc_per_node"]
    if per_rank and launch["name"] == "local":
        _check(per_rank * nproc <= usable, "launcher.cpu_cores_per_rank",
               f"{nproc} process(es) x {per_rank} cores need {per_rank * nproc} cores, and this process may "
               f"use {usable}", f"set launcher.cpu_cores_per_rank<={max(1, usable // nproc)}, or null (unpinned)")


def _validate_parallel(cfg, num_gpus: int) -> None:
    """The layout against the launcher's world size, the batch and the model (before any launch)."""
    par, m, launch, train = cfg["parallel"], cfg["model"], cfg["launcher"], cfg["train"]
    tp, pp, cp, ep = (par[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                       "context_parallel_size", "expert_model_parallel_size"))
    vpp = par["virtual_pipeline_model_parallel_size"]
    nproc, nnodes = launch["nproc_per_node"], launch["nnodes"]
    world = nproc * nnodes
    _check(launch["name"] in ("local", "slurm"), "launcher", f"unknown launcher {launch['name']!r}",
           "use launcher=local (torchrun on this machine) or launcher=slurm (Slurm via submitit)")
    _check(nproc >= 1 and nnodes >= 1, "launcher.nproc_per_node",
           f"{nproc} process(es) on {nnodes} node(s)", "use at least one process on one node")
    _check(launch["name"] == "slurm" or nnodes == 1, "launcher.nnodes",
           f"launcher=local starts torchrun on this machine only, not on {nnodes} nodes",
           f"use launcher=slurm launcher.nnodes={nnodes} (torchrun on every node of a Slurm job)")
    for key, size in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                      ("context_parallel_size", cp), ("expert_model_parallel_size", ep)):
        _check(size >= 1, f"parallel.{key}", f"{size} is not a size", f"set parallel.{key}>=1")
    if num_gpus:
        _check(nproc <= num_gpus, "launcher.nproc_per_node",
               f"{nproc} processes but this machine has {num_gpus} GPU(s)",
               f"set launcher.nproc_per_node<={num_gpus} or add nodes (launcher=slurm launcher.nnodes=N)")
    else:
        _check(m["moe_token_dispatcher_type"] != "alltoall" or MLP_KIND[m["family"]] != "moe",
               "model.moe_token_dispatcher_type", "the alltoall dispatcher needs CUDA streams",
               "use model.moe_token_dispatcher_type=allgather on a CPU")
    model_parallel = tp * pp * cp
    _check(world % model_parallel == 0, "launcher.nproc_per_node",
           f"tp*pp*cp = {tp}*{pp}*{cp} = {model_parallel} processes per model replica, but the "
           f"world is {nproc} x {nnodes} node(s) = {world}",
           f"set launcher.nproc_per_node to a multiple of {model_parallel} (the parallel=<layout> "
           "files set the smallest), or shrink the layout")
    dp = world // model_parallel
    heads = m["num_attention_heads"]
    _check(heads % tp == 0, "parallel.tensor_model_parallel_size",
           f"{heads} heads are not divisible by TP={tp}", "pick a TP size dividing the head count")
    groups = m["num_query_groups"] or heads
    _check(ATTENTION_KIND[m["family"]] == "mla" or groups % tp == 0, "parallel.tensor_model_parallel_size",
           f"{groups} query groups are not divisible by TP={tp}", "pick TP dividing num_query_groups")
    if ATTENTION_KIND[m["family"]] == "gdn":
        kh, vh = m["linear_num_key_heads"], m["linear_num_value_heads"]
        _check(kh % tp == 0 and vh % tp == 0, "parallel.tensor_model_parallel_size",
               f"GDN heads ({kh} key, {vh} value) are not divisible by TP={tp}",
               "pick a TP size dividing model.linear_num_key_heads")
    _check(not par["sequence_parallel"] or tp > 1, "parallel.sequence_parallel",
           "sequence parallel needs tensor parallel > 1", "use parallel=tp2, or "
           "parallel.sequence_parallel=false")
    _check(vpp is None or vpp >= 2, "parallel.virtual_pipeline_model_parallel_size",
           f"{vpp} virtual stage(s) per rank is no interleaving", "use null, or 2 or more")
    _check(vpp is None or pp > 1, "parallel.virtual_pipeline_model_parallel_size",
           "virtual stages need pipeline parallel > 1", "use parallel=pp2_vpp2, or vpp=null")
    chunk_layers(m, par)  # the depth splits into the stages (evenly, or first/last given), or ConfigError
    mbs = train["micro_batch_size"]
    gbs = train["global_batch_size"] or mbs * dp
    _check(gbs % (mbs * dp) == 0, "train.global_batch_size",
           f"{gbs} samples do not split into micro-batches of {mbs} on {dp} data-parallel rank(s)",
           f"use a multiple of micro_batch_size x data-parallel size = {mbs * dp}")
    num_microbatches = gbs // (mbs * dp)
    if vpp:  # megatron's interleaved schedule raises otherwise
        _check(num_microbatches % pp == 0, "train.global_batch_size",
               f"interleaved pipelining needs the micro-batches per step ({num_microbatches}) to be "
               f"a multiple of PP={pp}",
               f"set train.global_batch_size={mbs * dp * pp * max(1, num_microbatches // pp)}")
    if pp > 1 and not num_gpus:
        _check(m["untie_embeddings_and_output_weights"], "model.untie_embeddings_and_output_weights",
               "tied embeddings under pipeline parallel need CUDA (megatron copies the last "
               "stage's output weight with .cuda())", "set model.untie_embeddings_and_output_weights=true")
    seq = train["seq_length"]
    if par["sequence_parallel"]:
        _check(seq % tp == 0, "train.seq_length", f"{seq} is not divisible by TP={tp} "
               "(sequence parallel splits the sequence)", f"use a multiple of {tp}")
    if cp > 1:
        _check(cfg["attention"]["backend"] == "te", "parallel.context_parallel_size",
               "context parallel needs Transformer Engine attention (attention=te); the local "
               "spec's core attention has no ring exchange",
               "use attention=te where Transformer Engine is installed, or context_parallel_size=1")
        _check(seq % (2 * cp) == 0, "train.seq_length", f"{seq} is not divisible by 2*CP={2 * cp}",
               f"use a multiple of {2 * cp}")
        raise ConfigError("parallel.context_parallel_size", "the worker does not yet split each "
                          "sequence over the context-parallel ranks (Megatron-LM's "
                          "get_batch_on_this_cp_rank), so every rank would attend over all of it",
                          "use context_parallel_size=1 (docs/parallel.md says what is missing)")
    if MLP_KIND[m["family"]] == "moe":
        _check(m["num_moe_experts"] % ep == 0, "parallel.expert_model_parallel_size",
               f"{m['num_moe_experts']} experts do not split over EP={ep}", "pick EP dividing the experts")
        etp = par["expert_tensor_parallel_size"] or tp
        _check(world % (etp * ep * pp) == 0, "parallel.expert_model_parallel_size",
               f"expert layout etp*ep*pp = {etp * ep * pp} does not divide the world size {world}",
               "shrink EP/ETP or add processes")
        _check(tp == 1 or par["sequence_parallel"], "parallel.sequence_parallel",
               "megatron's MoE layer refuses tensor parallel without sequence parallel in training",
               "use parallel=tp2 (sequence parallel on), or parallel.sequence_parallel=true")
        _check(etp == 1 or m["experts"] != "grouped", "parallel.expert_tensor_parallel_size",
               f"model.experts=grouped keeps each expert whole on a rank, but expert TP is {etp} "
               "(it defaults to the TP size)",
               "set parallel.expert_tensor_parallel_size=1 (parallel=tp2 does), or model.experts=sequential")
        if m["moe_token_dispatcher_type"] == "local":
            _check(ep == 1, "model.moe_token_dispatcher_type",
                   f"the local dispatcher keeps every token on its rank, but expert parallel {ep} puts "
                   "experts on other ranks", "use model.moe_token_dispatcher_type=allgather "
                   "(parallel=ep2 sets it)")
            _check(etp == 1, "model.moe_token_dispatcher_type",
                   f"the local dispatcher keeps every token on its rank, but expert-tensor parallel {etp} "
                   "splits each expert over ranks (it defaults to the TP size)",
                   "set parallel.expert_tensor_parallel_size=1, or model.moe_token_dispatcher_type=allgather")
    else:
        _check(ep == 1, "parallel.expert_model_parallel_size", "expert parallel needs an MoE family",
               "use model=moe (or mla_moe, gdn_moe), or parallel.expert_model_parallel_size=1")


def _validate_run(cfg) -> None:
    t, meas, log, data = cfg["train"], cfg["measure"], cfg["logger"], cfg["data"]
    _check(t["train_iters"] >= 2, "train.train_iters", "need at least 2 steps (warm-up + measured)",
           "set train.train_iters>=2")
    start = meas["start_step"]
    _check(2 <= start <= t["train_iters"], "measure.start_step",
           f"the measured window starts at step {start}, outside 2..{t['train_iters']} (step 1 warms up "
           "and records the ledger)", f"set measure.start_step between 2 and train.train_iters={t['train_iters']}")
    _check(meas["steps"] >= 1, "measure.steps", f"{meas['steps']} steps measure nothing",
           "set measure.steps>=1")
    _validate_schedule(t)
    _check(t["precision"] in ("auto", "bf16", "fp32"), "train.precision",
           f"unknown precision {t['precision']!r}", "use auto, bf16 or fp32")
    _check(t["optimizer"] in ("auto", "adamw"), "train.optimizer",
           f"unknown optimizer {t['optimizer']!r}", "use auto or adamw")
    _check(log["name"] in ("none", "wandb"), "logger", f"unknown logger {log['name']!r}",
           "use logger=none or logger=wandb")
    _check(log["mode"] in ("offline", "online", "disabled"), "logger.mode",
           f"unknown W&B mode {log['mode']!r}", "use offline, online or disabled")
    _check(meas.get("repeat", 0) >= 0, "measure.repeat", f"{meas.get('repeat')} is negative",
           "use measure.repeat=0,1,2 (one process per value) to repeat each point")
    _check(meas["profile"] in ("none", "peak"), "measure.profile",
           f"unknown profile {meas['profile']!r}", "use measure.profile=none or peak")
    frac = meas["memory_fraction"]
    _check(frac is None or 0 < frac <= 1, "measure.memory_fraction", f"{frac} is not in (0, 1]",
           "use a fraction such as 0.5, or null")
    budget = meas.get("memory_budget_gib")
    _check(budget is None or budget > 0, "measure.memory_budget_gib", f"{budget} is not > 0",
           "give the allocator's budget in GiB, e.g. measure.memory_budget_gib=19, or null")
    _check(budget is None or frac is None, "measure.memory_budget_gib",
           "both it and measure.memory_fraction cap the allocator", "set one of them, the other null")
    imbalance = (cfg.get("estimate") or {}).get("moe_imbalance", 1.0)  # results written before it existed
    est = cfg.get("estimate") or {}
    for key, example in (("mfu", "0.38"), ("host_link_gb_s", "50"), ("hbm_gb_s", "3000")):
        value = est.get(key, 1.0)
        _check(value > 0 and (key != "mfu" or value <= 1), f"estimate.{key}", f"{value} is not "
               + ("in (0, 1]" if key == "mfu" else "> 0"), f"set estimate.{key}={example}")
    for key, example in (("replay_region_ms", "0.142"), ("launch_us", "10")):
        value = est.get(key, 0.0)
        _check(value >= 0, f"estimate.{key}", f"{value} is negative", f"set estimate.{key}={example} (0: not counted)")
    _check(imbalance >= 1.0, "estimate.moe_imbalance", f"{imbalance} is below balanced routing (1.0): it "
           "bounds the worst expert-parallel rank", "use 1.0 (balanced) or more; the default 1.5 was measured")
    _check(data["name"] in ("mock", "indexed"), "data", f"unknown data {data['name']!r}",
           "use data=mock or data=indexed")


#: megatron-core's OptimizerParamScheduler decay styles (optimizer_param_scheduler.py get_lr).
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")


def _validate_schedule(t) -> None:
    """The LR and weight-decay schedule: what OptimizerParamScheduler would assert, said as a fix."""
    style, warmup = t["lr_decay_style"], t["lr_warmup_iters"]
    decay = t["lr_decay_iters"] or t["train_iters"]
    _check(style in LR_DECAY_STYLES, "train.lr_decay_style", f"unknown decay style {style!r}",
           f"use one of {', '.join(LR_DECAY_STYLES)}")
    _check(0 <= warmup < decay, "train.lr_warmup_iters",
           f"{warmup} warm-up steps do not end before the decay ends (step {decay})",
           "set train.lr_warmup_iters below train.lr_decay_iters (default: train.train_iters)")
    _check(0 <= t["min_lr"] <= t["lr"], "train.min_lr", f"min_lr {t['min_lr']} is not in 0..lr={t['lr']}",
           "set train.min_lr between 0 and train.lr")
    _check(0 <= t["lr_warmup_init"] <= t["lr"], "train.lr_warmup_init",
           f"{t['lr_warmup_init']} is not in 0..lr={t['lr']}", "set train.lr_warmup_init between 0 and train.lr")
    if style == "WSD":
        wsd = t["lr_wsd_decay_iters"]
        _check(wsd is not None and 0 < wsd <= decay - warmup, "train.lr_wsd_decay_iters",
               f"WSD needs its anneal length within the decay ({decay - warmup} steps), got {wsd}",
               "set train.lr_wsd_decay_iters, e.g. a tenth of train.lr_decay_iters")
        _check(t["lr_wsd_decay_style"] in ("linear", "cosine", "exponential", "minus_sqrt"),
               "train.lr_wsd_decay_style", f"unknown style {t['lr_wsd_decay_style']!r}",
               "use linear, cosine, exponential or minus_sqrt")
    start = t["weight_decay"] if t["start_weight_decay"] is None else t["start_weight_decay"]
    end = t["weight_decay"] if t["end_weight_decay"] is None else t["end_weight_decay"]
    incr = t["weight_decay_incr_style"]
    _check(incr in ("constant", "linear", "cosine"), "train.weight_decay_incr_style",
           f"unknown style {incr!r}", "use constant, linear or cosine")
    _check(0 <= start <= end, "train.end_weight_decay", f"weight decay goes from {start} to {end}",
           "megatron's schedule only increases weight decay: set 0 <= start_weight_decay <= end_weight_decay")
    _check(incr != "constant" or start == end, "train.weight_decay_incr_style",
           f"constant weight decay but start {start} != end {end}",
           "set train.weight_decay_incr_style=linear or cosine, or equal start/end weight decay")
