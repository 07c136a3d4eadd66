"""The Hydra schema: slim dataclasses registered in Hydra's ConfigStore.

Field names are megatron-core's own (``TransformerConfig``, ``MLATransformerConfig``,
``ModelParallelConfig``) wherever a field is passed through, so ``recipes.build.model`` can splat them and
``tests/test_config.py`` checks that every such field still exists after a megatron-core upgrade.
Types are primitives only (OmegaConf rejects ``Callable``/``Literal``), so typos and wrong types fail
at compose time. Cross-field rules live in ``recipes.validate``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from recipes.errors import from_hydra
from recipes.files import CONF_DIR

#: ``model.compile``'s scopes: what ``recipes.build.model.compile_layers`` hands to ``torch.compile``.
COMPILE_SCOPES = ("none", "attention", "layer")


class Section:
    """A schema dataclass, frozen once built (``@dataclass(frozen=True)`` would make Hydra's composition
    read-only too), and read by key as well (``section["hidden_size"]``, ``section.get(...)``), as the
    helpers that take either a typed section or a stored result's plain one do. A changed copy is
    ``dataclasses.replace``'d."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, key: str, value: Any) -> None:
        if getattr(self, "_frozen", False):  # Hydra composes into unfrozen structured configs: frozen here instead
            raise dataclasses.FrozenInstanceError(f"cannot assign {key}: the run config is frozen (a changed copy "
                                                  "is dataclasses.replace'd)")
        object.__setattr__(self, key, value)

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.__dataclass_fields__

    def keys(self):
        return self.__dataclass_fields__.keys()

    def items(self):
        return ((k, getattr(self, k)) for k in self.__dataclass_fields__)


@dataclass
class ModelConfig(Section):
    """A GPT model in megatron-core's vocabulary; ``family`` picks the attention kind x MLP kind
    (``recipes.recompute.ATTENTION_KIND``/``MLP_KIND``), the ``*_freq`` fields the layer pattern."""

    family: str = MISSING  # standard_attn | mla | moe | gdn | mla_moe | gdn_moe
    num_layers: int = MISSING
    hidden_size: int = MISSING
    ffn_hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    num_query_groups: Optional[int] = None  # GQA: key/value head groups (None = MHA)
    kv_channels: Optional[int] = None  # per-head dim (None = hidden/heads)
    vocab_size: int = MISSING  # GPTModel argument, not a TransformerConfig field
    normalization: str = "RMSNorm"
    gated_linear_unit: bool = True  # SwiGLU with activation=silu
    activation: str = "silu"  # silu | gelu (megatron's activation_func)
    add_bias_linear: bool = False
    position_embedding_type: str = "rope"  # GPTModel argument: rope | learned_absolute | none
    rotary_base: int = 10000
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    attention_softmax_in_fp32: bool = False  # Megatron-LM's CLI default; True doubles unfused scores
    init_method_std: float = 0.02
    untie_embeddings_and_output_weights: bool = True
    qk_layernorm: bool = False
    # megatron's fused SwiGLU (bias_swiglu); null = auto: on for a SwiGLU model on a GPU, off on a CPU
    bias_activation_fusion: Optional[bool] = None
    # the weight gradient accumulated into the fp32 main_grad inside its GEMM (recipes.build.wgrad, what
    # Apex's kernel does); null = auto: on a GPU under megatron's DistributedOptimizer, off on a CPU
    gradient_accumulation_fusion: Optional[bool] = None
    # fused RoPE without Transformer Engine (recipes.build.rope: one Triton kernel each way, bit-identical
    # to megatron's unfused RoPE); null = auto: on a GPU for a RoPE model, off on a CPU
    apply_rope_fusion: Optional[bool] = None
    # torch.compile of the layers (recipes.build.model.compile_layers): none | attention (each layer's
    # self_attention) | layer (each whole TransformerLayer; not MoE layers)
    compile: str = "none"  # one of COMPILE_SCOPES
    # Multi-Latent Attention (family=mla): MLATransformerConfig fields
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # Mixture of experts (family=moe, mla_moe, gdn_moe)
    moe_layer_freq: Any = 1  # MoE every N-th layer (from layer 0), a 0/1 list per layer, or "([0]*3+[1]*58)"
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None  # None = no shared experts
    moe_aux_loss_coeff: float = 0.0
    moe_router_load_balancing_type: str = "aux_loss"
    # allgather (megatron's; any device, any layout) | alltoall (GPU) | local (EP 1: no host syncs,
    # recipes/build/dispatch.py; conf/model/*moe.yaml pick it)
    moe_token_dispatcher_type: str = "allgather"
    moe_expert_capacity_factor: Optional[float] = None  # token dropping (None = dropless); not with local
    moe_grouped_gemm: bool = True  # megatron's flag; the experts module is chosen by ``experts``
    experts: str = "grouped"  # grouped (recipes.build.experts, one grouped GEMM) | sequential (megatron)
    moe_shared_expert_overlap: bool = False
    # GatedDeltaNet hybrid (family=gdn, gdn_moe): TransformerConfig's linear-attention fields
    linear_attention_freq: Optional[int] = None  # every N-th layer is standard attention, the rest GDN
    linear_conv_kernel_dim: int = 4  # causal depthwise conv over q/k/v
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16  # query/key heads
    linear_num_value_heads: int = 32  # value/gate heads (a multiple of the key heads)


@dataclass
class AttentionConfig(Section):
    """Core attention backend: unfused (materialized scores), sdpa (torch SDPA), te (TE fused)."""

    backend: str = "sdpa"


@dataclass
class RecomputeConfig(Section):
    """Activation recompute: megatron-core's recompute_* fields. ``granularity: null`` = off."""

    recompute_granularity: Optional[str] = None  # null | selective | full
    recompute_modules: List[str] = field(default_factory=list)
    recompute_method: Optional[str] = None  # full only: uniform | block
    recompute_num_layers: Optional[int] = None  # full only
    distribute_saved_activations: bool = False
    # the dense MLP's mlp label: false replays FC1 and the activation (recipes.build.mlp; the same
    # bytes kept), true megatron's whole-MLP checkpoint, which replays FC2's GEMM too
    mlp_replays_fc2: bool = False


@dataclass
class OffloadConfig(Section):
    """Activation offload to host memory: megatron-core's fine-grained offload (``offload_modules``)
    and its layer-level ``cpu_offloading`` (Transformer Engine only). ``offload=none`` = off."""

    fine_grained_activation_offloading: bool = False
    offload_modules: List[str] = field(default_factory=list)  # recipes.offload.MODULES
    min_offloaded_tensor_size: int = 1048576  # elements: a smaller saved tensor stays on the device
    activation_offload_fraction: float = 1.0  # the share of offload groups actually moved (megatron's)
    cpu_offloading: bool = False  # layer-level offload: Transformer Engine's context (refused without it)
    cpu_offloading_num_layers: int = 0
    host_memory_gib: Optional[float] = None  # host memory per node for the copies (None: this machine's available)
    emulate_on_cpu: bool = False  # a CPU run only (tests): copy to a second host buffer through emulated streams


@dataclass
class ParallelConfig(Section):
    """Parallel layout; data parallel = world size / (tp * pp * cp)."""

    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    num_layers_in_first_pipeline_stage: Optional[int] = None  # uneven stages (DeepSeek-V3's 61 layers)
    num_layers_in_last_pipeline_stage: Optional[int] = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    overlap_moe_expert_parallel_comm: bool = False


@dataclass
class LauncherConfig(Section):
    """How the controller starts the worker process group."""

    name: str = "local"  # local: torchrun on this machine
    nproc_per_node: int = 1
    nnodes: int = 1
    master_port: int = 0  # 0 = pick a free port
    # pin each local rank to this many cores of its own, its GPU's NUMA node first (null: unpinned;
    # launch/affinity.py): keeps a rank's launching thread next to its GPU on a multi-socket node
    cpu_cores_per_rank: Optional[int] = None


@dataclass
class DataConfig(Section):
    """Training data: mock tokens, or megatron indexed datasets (``data/indexed``)."""

    name: str = "mock"  # mock | indexed
    paths: List[str] = field(default_factory=list)  # indexed: [weight, prefix, weight, prefix...]
    split: str = "98,2,0"
    eval_interval: int = 0  # validation loss every N steps (0 = off)
    eval_iters: int = 2
    num_workers: int = 0
    tokenizer: Optional[str] = None  # indexed: null = PREFIX.meta.json | a tokenizer spec (recipes/data/tokenizer.py)
    cache_dir: Optional[str] = None  # indexed: megatron's index cache (null = ~/.cache/recompute-recipes)


@dataclass
class LoggerConfig(Section):
    """Experiment logger: wandb (offline unless ``mode=online``) or none."""

    name: str = "none"
    project: str = "recompute-recipes"
    entity: Optional[str] = None
    mode: str = "offline"  # offline | online | disabled
    group: Optional[str] = None  # null: the sweep (its path below multirun/), else the run directory's parent
    job_type: Optional[str] = None  # null: point (a sweep point), train (a single run)
    tags: List[str] = field(default_factory=list)


@dataclass
class TrainConfig(Section):
    """Run knobs."""

    seed: int = 1234
    train_iters: int = 8  # optimizer steps of the run (the measured window is inside them: measure.*)
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None  # None = micro_batch_size * data-parallel size
    seq_length: int = MISSING
    # The schedule: megatron-core's OptimizerParamScheduler, stepped once per step, with
    # Megatron-LM's argument names (--lr-warmup-iters, --lr-decay-style, --min-lr, ...).
    lr: float = 1.0e-4  # peak learning rate (after the warm-up)
    min_lr: float = 0.0  # where the decay ends
    lr_decay_style: str = "constant"  # constant | linear | cosine | inverse-square-root | WSD
    lr_warmup_iters: int = 0  # linear warm-up from lr_warmup_init to lr over these steps
    lr_warmup_init: float = 0.0
    lr_decay_iters: Optional[int] = None  # the decay ends at this step (null = train_iters)
    lr_wsd_decay_style: str = "exponential"  # WSD's final anneal: linear | cosine | exponential | minus_sqrt
    lr_wsd_decay_iters: Optional[int] = None  # WSD: steps of that anneal, at the end of the decay
    weight_decay: float = 0.01
    start_weight_decay: Optional[float] = None  # weight-decay schedule (null = weight_decay throughout)
    end_weight_decay: Optional[float] = None
    weight_decay_incr_style: str = "constant"  # constant | linear | cosine (over lr_decay_iters)
    clip_grad: float = 1.0
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    optimizer: str = "auto"  # auto (megatron DistributedOptimizer on GPU, AdamW on CPU) | adamw
    fused_adam: bool = True  # torch's fused Adam kernel (what TE/apex FusedAdam would be); false: foreach
    log_interval: int = 100  # one progress line (rank 0) every N steps (0 = none); also RUN_DIR/progress.jsonl
    exit_interval: Optional[int] = None  # stop (after saving, when checkpoint.save) once step % N == 0
    # Megatron-LM's --manual-gc: Python's collector off while training (a full collection pauses whichever
    # step it lands in), collecting between steps every manual_gc_interval steps (0: never). Off, as in
    # Megatron-LM: on one H200 it changed no step time (docs/training.md)
    manual_gc: bool = False
    manual_gc_interval: int = 100
    deterministic: bool = False  # bit-identical reruns and resumes, slower (recipes.run.world.use_deterministic)


@dataclass
class MeasureConfig(Section):
    """What each run measures, and when: a window of ``steps`` steps from ``start_step`` (1-based)
    inside the run. Steps before it warm up (the first records the ledger); steps after it train
    without per-step device synchronization."""

    start_step: int = 4  # first step of the measured window (timing, memory peak, checkpoint counts)
    steps: int = 5  # window length, cut at train.train_iters (the default 4..8 = all of an 8-step point)
    ledger: bool = True  # saved-for-backward bytes by module kind, one microbatch
    peak_tflops: float = 989.0  # for MFU: H200/H100 dense bf16
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    memory_fraction: Optional[float] = None  # cap this process's share of GPU memory (forces OOMs)
    # cap PyTorch's allocator at N GiB, as on a GPU of that size (advise's --budget-gib): a point that
    # needs more stops as oom, so fragmentation counts as it would there
    memory_budget_gib: Optional[float] = None
    profile: str = "peak"  # peak (one profiled step: timeline, peak attribution) | none (`profile=none`)
    repeat: int = 0  # which repetition of a point; sweep measure.repeat=0,1,2 to time each point in 3 processes
    # GPU: one more step under torch's profiler after the timed ones: where the step's time went (kernels,
    # idle GPU, copies, blocking CUDA calls) in result.json ranks[*].trace, the trace in RUN_DIR/step_trace*.json.gz
    trace_step: bool = False
    # GPU: one more step after the timed ones (an optimizer update not counted in train.train_iters, as the
    # profiled step) under a CUDA-only profile: the time the GPU was busy in it (kernels, copies, memsets),
    # which the host's speed does not move (an MoE step's wall time moves 5-16% between processes with it:
    # docs/speed.md). result.json ranks[*].trace; the report's `GPU busy` columns. null: on when there is a GPU
    # (sweep=moe sets it); true: refused without one
    gpu_time: Optional[bool] = False
    # one more forward and backward after the timed steps, each layer's modules timed: what each recompute
    # label's replay costs here (result.json ranks[*].module_times; advise prices the labels from it). On a
    # GPU a point that replays and offloads nothing also records its step's timeline (module_times.marks:
    # three more passes; about 1 s more a point at the h200 size on one H200), on which advise prices every
    # recompute option, host time included.
    # null: on a GPU, eager layers (model.compile=none); true also on a CPU
    module_times: Optional[bool] = None


@dataclass
class EstimateConfig(Section):
    """What the estimator (``python -m recipes estimate``, ``advise --predict``) assumes where only a
    run can tell. Changes no measurement (``recipes.results.NOT_MEASURED``)."""

    # Routed rows on the worst expert-parallel rank over the balanced share, a bound: measured on two
    # H200s (docs/evidence/h200x2.md) after 6 steps at moe_aux_loss_coeff 0.01, the worst rank took
    # 1.50x at its peak step. Used for EP > 1 before a run; `estimate --compare` uses each rank's
    # recorded rows instead. Dropless routing caps it at every token (ep x balanced for top-k <= local experts).
    moe_imbalance: float = 1.5
    # The planner's time unit (recipes.analyze.plan): recompute's replayed FLOPs and a layer's forward
    # run at this share of measure.peak_tflops. Not the step's MFU (49.7% dense at the h200 size on one
    # H200): it prices what replays cost. At 0.38 `--predict` put the h200_long picks' margins over
    # their runners-up at +222 ms (dense: full/block x 8 against selective/mlp, measured +229) and +446
    # ms (MoE: moe_act against moe, measured +453 before the fused RoPE; docs/offload.md); at 0.49
    # they would be +172 and +320. Activation offload copies at this pinned host-link bandwidth, GB/s
    # each way (PCIe 5.0 x16's order; a GPU offload run records the real one: offload.link).
    mfu: float = 0.38
    host_link_gb_s: float = 50.0
    # What activation offload's copies cost a step beyond the link (recipes.predict.copies): per group
    # moved (one layer's module: the manager's Python, events and stream waits at each group commit
    # and reload) and per GiB moved (out and back). Fitted to the five dense offload options one H200
    # paired against themselves paused in three processes each on two machines at the h200 size (the
    # research scripts that fitted them live in the project's history; docs/offload.md says what they found).
    offload_ms_per_group: float = 0.072
    offload_ms_per_gib: float = 2.98
    # Elementwise replays (moe_act, layernorm, gdn_norm_out) are memory traffic: GB/s of device
    # memory they run at (the H200's HBM3e peaks at 4800).
    hbm_gb_s: float = 3000.0
    # What an elementwise label's replay costs beyond its bytes (recipes.predict.cost.recompute_s; on a
    # measured timeline, timeline_recompute_costs, both are host time, which a GPU-bound step hides; a
    # timeline that measured its regions and functions prices those instead,
    # recipes.measure.regions: 0.4-0.6 ms a region on one H200):
    # per checkpoint region replayed (megatron's CheckpointWithoutOutput: RNG states saved and
    # restored, a nested autograd backward), fitted to the one robust row, dense selective/layernorm
    # at the h200 size on one H200 (+10.5 ms in two processes, 64 regions a step; docs/offload.md);
    # and, where the step is host-bound (MoE, MLA), per kernel replayed: an eager op's host cost
    # (dispatch and launch), an order of magnitude, not fitted.
    replay_region_ms: float = 0.142
    launch_us: float = 10.0


@dataclass
class ClusterConfig(Section):
    """The cluster a plan is for (``advise --predict``, ``estimate``), not the machine running the planner
    (``recipes.hardware``). Changes no run; null: the launcher's layout and the GPU's profile."""

    gpu: Optional[str] = None  # a hardware profile: conf/hardware/<name> or a calibrated profile's path
    host_memory_gib: Optional[float] = None  # host memory per node for offload's copies
    gpus_per_node: Optional[int] = None  # null: launcher.nproc_per_node
    nodes: Optional[int] = None  # null: launcher.nnodes


@dataclass
class CheckpointConfig(Section):
    """Checkpoints through megatron-core dist_checkpointing (recipes/run/checkpoint.py,
    docs/training.md). Off by default (``checkpoint=none``); ``checkpoint=default`` for long runs."""

    save: bool = False  # save every `interval` steps, at the end, and on SIGTERM/SIGUSR1
    interval: int = 0  # steps between saves (0 = only at the end and on a signal)
    keep_last: int = 3  # complete checkpoints kept (0 = all)
    dir: Optional[str] = None  # null = RUN_DIR/checkpoints
    resume: Optional[str] = None  # null (fresh) | auto (newest complete under dir) | a checkpoint path
    override_scheduler: bool = False  # on resume, apply this run's train.lr* schedule instead of refusing a change


@dataclass
class NamedRecipeConfig(Section):
    """A public architecture at its published layout (``recipe=<name>``, conf/recipe/). The file sets
    ``model.*``, ``train.*``, ``parallel.*``, ``launcher.*`` and the published recompute at full depth;
    ``recipes.recipe.apply_recipe`` shrinks it to this machine unless ``recipe.full_depth=true``."""

    name: str = MISSING
    title: str = ""
    sources: List[str] = field(default_factory=list)  # model card / config.json / paper / Megatron-Bridge recipe
    gpu: str = "h100"  # the GPU its source trains on: h100 (80 GB) | h200 (141 GB)
    published_recompute: str = "none"  # the recompute option its source publishes, in this repo's names
    full_depth: bool = False  # true: every layer at the published layout (a cluster); false: reduced, here
    reduced: Dict[str, Any] = field(default_factory=dict)  # model.* at reduced depth (num_layers, ...)
    te_only: List[str] = field(default_factory=list)  # published features that need Transformer Engine
    notes: List[str] = field(default_factory=list)  # what differs from the source, and why


@dataclass
class RecipeConfig(Section):
    """The root config: one training run (or, with -m, one sweep point)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    estimate: EstimateConfig = field(default_factory=EstimateConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    recipe: Optional[NamedRecipeConfig] = None  # recipe=<name>: a public architecture (conf/recipe/)
    size: Any = None  # unused: size files (@package _global_) set model.* and train.* directly
    name: Optional[str] = None  # run name; defaults to the Hydra choices
    output_dir: Optional[str] = None  # defaults to Hydra's run/sweep directory
    rerun: bool = False  # in a sweep, re-run points that already have a complete result
    dry_run: bool = False  # validate and write the config, start no worker
    allow_over_memory: bool = False  # launch a single run the estimator predicts above this machine's memory
    lock_wait_s: float = 1800.0  # another run holds this point's directory: wait this long, then skip it
    fork_server: bool = True  # sweep points fork from a server that imported megatron once


#: The run config every module takes: the schema's dataclasses, built once after composition
#: (``typed``). Read as attributes (``cfg.model.hidden_size``); a derived copy (an estimator or
#: planner trial) is ``dataclasses.replace``'d, never edited; ``as_dict`` is its serialisation.
RunConfig = RecipeConfig


@cache
def _nested(cls: type) -> dict[str, type]:
    """The fields of a schema dataclass that are schema dataclasses themselves (``Optional`` ones too)."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) else [hint]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            out[name] = args[0]
    return out


def _build[T](cls: type[T], values: Any) -> T:
    if isinstance(values, cls) or values is None:
        return values
    nested, names = _nested(cls), {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise KeyError(f"{cls.__name__} has no field {', '.join(sorted(unknown))}")
    return cls(**{k: _build(nested[k], v) if k in nested else v for k, v in values.items()})


def typed(cfg: Any) -> RunConfig:
    """The typed run config of a composed one: a ``RunConfig`` as it is, a ``DictConfig`` through
    ``OmegaConf.to_object`` (type-checked against the schema), a plain dict (a composed config's, a stored
    result's) through ``upgrade``, field by field: the fields it lacks take the values it ran with."""
    if isinstance(cfg, RecipeConfig):
        return cfg
    if OmegaConf.is_config(cfg):
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RecipeConfig), cfg))
    return _build(RecipeConfig, upgrade(cfg))


def as_dict(cfg: Any) -> dict:
    """The run config as plain data, in the schema's field order: what config.yaml, result.json's
    ``config`` and the W&B config hold."""
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else copy.deepcopy(dict(cfg))


#: Longest directory name ``slug`` makes: far below the file-name limit of 255 bytes, short enough to read.
MAX_DIRNAME = 64
#: Longest sweep directory name (it holds the swept value lists; its path below multirun/ is the W&B
#: group, at most 128 characters).
MAX_SWEEP_DIRNAME = 100
#: Hydra's sweep functions: an override whose value starts with one is swept.
_SWEEP_FUNCTIONS = ("range(", "choice(", "glob(", "interval(", "shuffle(", "sort(")


def _depth(text: str) -> int:
    return sum(text.count(c) for c in "[({") - sum(text.count(c) for c in "])}")


def _overrides_of(dirname: str) -> list[str]:
    """Hydra's ``override_dirname`` (overrides joined by ',') back into its overrides: a piece without
    '=' or inside brackets continues the value before it (a sweep list, a list value)."""
    items: list[str] = []
    for piece in str(dirname).split(",") if dirname else []:
        if items and ("=" not in piece or _depth(items[-1]) > 0):
            items[-1] += "," + piece
        else:
            items.append(piece)
    return items


def _is_swept(value: Any) -> bool:
    """A value Hydra's sweeper expands: a list at the top level (``a,b``) or a sweep function."""
    text = str(value)
    if text.startswith(_SWEEP_FUNCTIONS):
        return True
    depth = 0
    for c in text:
        depth += (c in "[({") - (c in "])}")
        if c == "," and depth == 0:
            return True
    return False


@cache
def _swept_keys_of(multirun_yaml: str, mtime_ns: int) -> frozenset[str]:
    """The keys a sweep sweeps, from its ``multirun.yaml`` (the command line's and the sweep file's)."""
    master = OmegaConf.load(multirun_yaml)
    task = list(OmegaConf.select(master, "hydra.overrides.task") or [])
    params = OmegaConf.select(master, "hydra.sweeper.params") or {}
    values = {str(k): str(v) for k, v in params.items()}  # the sweep file's; the command line's win
    values.update(str(o).partition("=")[::2] for o in task)
    return frozenset(k for k, v in values.items() if _is_swept(v))


def slug(text: str, sweep_dir: str | None = None) -> str:
    """A short, stable directory name for Hydra overrides (``recompute=selective/core_attn,size=h200``
    becomes ``recompute=selective.core_attn__size=h200``).

    The swept overrides lead: a sweep's directory (``text`` holds its value lists) names what it sweeps,
    then what it fixes (``recompute=none,full__model=moe``); a point's (``sweep_dir`` given: the keys its
    ``multirun.yaml`` sweeps) its swept values, then the rest. A name longer than ``MAX_DIRNAME``
    (``MAX_SWEEP_DIRNAME`` for a sweep's) keeps a readable prefix of whole overrides plus 8 hex digits of
    the full text's SHA-1, so any number of overrides fits the file-name limit and two command lines
    never share a directory. The full overrides are in each point's ``result.json`` and the sweep's
    ``manifest.json``. A point of a sweep started before the swept keys led keeps its directory."""
    items = _overrides_of(text)
    swept = {i.partition("=")[0] for i in items if _is_swept(i.partition("=")[2])}
    master = Path(str(sweep_dir)) / "multirun.yaml" if sweep_dir else None
    if master is not None and master.is_file():
        swept |= _swept_keys_of(str(master), master.stat().st_mtime_ns)
    ordered = [i for i in items if i.partition("=")[0] in swept] + [i for i in items if i.partition("=")[0] not in swept]
    name = _short("__".join(_render(i, i.partition("=")[0] in swept) for i in ordered) or "defaults",
                  MAX_SWEEP_DIRNAME if any(_is_swept(i.partition("=")[2]) for i in items) else MAX_DIRNAME)
    if master is not None and not (master.parent / name).exists():
        legacy = _short(str(text).replace("/", ".").replace(",", "__") or "defaults", MAX_DIRNAME)
        if (master.parent / legacy).is_dir():  # the name before the swept keys led: resume there
            return legacy
    return name


def _render(item: str, swept: bool) -> str:
    """One override in a directory name: '/' as '.', a swept value's list kept as ``a,b``, other commas '__'."""
    key, _, value = item.replace("/", ".").partition("=")
    return f"{key}={value}" if swept and _is_swept(value) else item.replace("/", ".").replace(",", "__")


def _short(name: str, limit: int) -> str:
    if len(name) <= limit:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    room = limit - len(digest) - 1
    cut = name.rfind("__", 0, room + 2)  # an item boundary at most `room` characters in
    return f"{name[:cut] if cut > 0 else name[:room]}-{digest}"


@cache
def _defaults() -> dict:
    return OmegaConf.to_container(OmegaConf.structured(RecipeConfig))


#: Fields whose schema default changed: a stored config without them ran with the value here, not
#: today's default (``bias_activation_fusion`` was false before null meant "auto: fused on a GPU";
#: ``mlp_replays_fc2``: megatron's whole-MLP replay, before recipes.build.mlp; ``gradient_accumulation_fusion``:
#: unfused, before recipes.build.wgrad; ``apply_rope_fusion``: megatron's unfused RoPE, before recipes.build.rope).
PREVIOUS_DEFAULTS = {("model", "bias_activation_fusion"): False, ("recompute", "mlp_replays_fc2"): True,
                     ("model", "gradient_accumulation_fusion"): False, ("model", "apply_rope_fusion"): False}
#: Top-level fields a stored config may lack that changed nothing measured: filled as they ran.
PREVIOUS_TOP_LEVEL = {"fork_server": False}


def upgrade(config: dict) -> dict:
    """A stored run config (a result an earlier version wrote) in today's schema: renamed knobs moved
    (``train.warmup_iters=N`` is ``measure.start_step=N+1``, the same steps), fields added since
    filled with their defaults (or, where the default changed since, ``PREVIOUS_DEFAULTS``, and for a
    top-level field that measured nothing, ``PREVIOUS_TOP_LEVEL``), fields removed since dropped. A current
    config comes back equal."""
    old = copy.deepcopy(config)
    for (section, key), value in PREVIOUS_DEFAULTS.items():
        if isinstance(old.get(section), dict):
            old[section].setdefault(key, value)
    for key, value in PREVIOUS_TOP_LEVEL.items():
        old.setdefault(key, value)
    train = old.get("train") or {}
    if "warmup_iters" in train:
        n = train.pop("warmup_iters")
        measure = old.setdefault("measure", {})
        measure.setdefault("start_step", n + 1)
        measure.setdefault("steps", max(1, train.get("train_iters", n + 1) - n))

    def merge(default: Any, stored: Any) -> Any:
        if not isinstance(default, dict) or not isinstance(stored, dict):
            return stored
        return {k: merge(v, stored[k]) if k in stored else v for k, v in default.items()}

    return merge(copy.deepcopy(_defaults()), old)


def upgrade_overrides(overrides: list[str]) -> list[str]:
    """Command-line overrides recorded by an earlier version (a manifest's), in today's names."""
    out = []
    for o in overrides:
        key, _, value = str(o).partition("=")
        out.append(f"measure.start_step={int(value) + 1}" if key == "train.warmup_iters" else str(o))
    return out


def register_configs() -> None:
    """Register the schema so conf/config.yaml and every group are type-checked at compose time."""
    if not OmegaConf.has_resolver("slug"):
        OmegaConf.register_new_resolver("slug", slug)
    if not OmegaConf.has_resolver("once"):
        # Cached by its literal argument: Hydra copies the sweep's resolver cache into every job (as
        # for ${now:}), so `${once:...}` keeps the sweep's value in each point (conf/config.yaml sweep.dir).
        OmegaConf.register_new_resolver("once", lambda value: value, use_cache=True)
    # The root schema types every section, so each group option (conf/<group>/*.yaml) is checked against its
    # section's dataclass when composed; no per-group schema entry (it would be listed as an option in --help).
    # Stored once a process: OmegaConf.structured of the whole schema costs 0.1 s, and tools compose many configs
    store = ConfigStore.instance()
    if "recipe_schema.yaml" not in store.repo:
        store.store(name="recipe_schema", node=RecipeConfig)


def compose_config(overrides: list[str] = ()) -> dict:
    """The resolved run config for these Hydra overrides, composed exactly as ``train.py`` does
    (the plain dict a worker reads). For tools and tests that run outside ``@hydra.main``."""
    from hydra import compose, initialize_config_dir  # Hydra's composition API, only for tools and tests
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:  # a typo, a wrong type, an unknown option
        raise from_hydra(err, str(CONF_DIR)) from err
    return OmegaConf.to_container(cfg, resolve=True)
