"""This project's ``train.py`` against Megatron-LM's ``pretrain_gpt.py``: same model, same settings, one GPU.

From the composed run config (Hydra overrides, as ``train.py`` takes them) this builds the equivalent
``pretrain_gpt.py`` command line (local spec, no Transformer Engine or apex), then runs ``--repeats``
alternating pairs, each side a fresh process: ``torchrun --standalone --nproc_per_node 1
<megatron-lm>/pretrain_gpt.py ...`` (its per-iteration time read from stdout) and ``python train.py``
with the same overrides (its result.json). Both are timed over the same iterations,
``--start-step`` .. ``--iters`` (1-based; the ones before warm up), as the median. Prints a markdown
table (step ms, tokens/s, max allocated GiB), the tokens/s ratio train.py / pretrain_gpt.py of each
pair and their median (target >= 1), and the two commands it ran.

    python benchmarks/bench_peer.py --megatron-lm /path/to/Megatron-LM model=standard_attn size=h200 recompute=none attention=unfused
    python benchmarks/bench_peer.py --megatron-lm /tmp/megatron-lm --repeats 4 --iters 20 size=h200 attention=unfused recompute=full
    python benchmarks/bench_peer.py --megatron-lm /tmp/megatron-lm --check-args size=h200 attention=unfused   # CPU, runs nothing

``--megatron-lm`` is a Megatron-LM directory with ``pretrain_gpt.py``: best the minimal extract of
``bash benchmarks/extract_megatron_lm.sh <Megatron-LM git dir> core_r0.19.0 /tmp/megatron-lm``, which
leaves out ``megatron/core`` so that the installed megatron-core serves ``megatron.core`` to both
sides (a full checkout puts its own first on the peer's ``sys.path``; the table prints the version
each side ran). ``--check-args`` parses the peer's command line with that Megatron-LM's own parser
and ``validate_args`` here (no GPU) and lists every ``TransformerConfig`` field in which its model
differs from train.py's GPU model.

Mapped: the dense model (``model=standard_attn``: layers, hidden, ffn, heads, GQA groups, vocabulary,
RMSNorm, SwiGLU, RoPE, no biases, untied embeddings, dropout, init std), the batch, the precision
(bf16), megatron's DistributedOptimizer, the learning-rate schedule, recompute (none,
selective/<modules>, full/<method>) and the fusions as train.py resolves them on a GPU (fused SwiGLU on
when ``model.bias_activation_fusion`` is null; masked-softmax, RoPE, gradient-accumulation fusions and
the persistent layer norm off). Refused, naming the option: other model families, ``attention=sdpa``
and ``attention=te`` (the local spec's core attention is megatron's unfused ``DotProductAttention``:
use ``attention=unfused``), parallel layouts beyond one GPU, activation offload, indexed data,
checkpoint saving, ``recompute=control``. Off on the peer because train.py never does them: the
data loader's [b, 1, s, s] attention mask and the NaN checks of the loss and gradients. Left as they
differ (``NOT_MATCHED``, printed under the table): train.py's fused Adam kernel (``train.fused_adam=false``
compares the same foreach AdamW), the data-loader workers, Megatron-LM's per-iteration logging
(``--log-interval 1``, which its per-iteration time needs).

pretrain_gpt.py runs ``make`` in megatron-core's datasets directory at start, which the wheel ships
without a Makefile (its C++ helpers prebuilt): ``peer_environment`` gives that make a no-op makefile.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from recipes.build.model import resolve_precision, resolve_swiglu_fusion  # noqa: E402  (after the repo is on sys.path)
from recipes.config import compose_config  # noqa: E402
from recipes.errors import ConfigError  # noqa: E402

#: ``training_log``'s line (megatron/training/training.py, core_r0.19.0), e.g.
#: `` [2026-01-01 12:00:00.000000] iteration        5/      10 | consumed samples: ... | elapsed time per iteration (ms): 95.3 |``
ITERATION_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")
#: ``report_memory`` (megatron/training/utils/common_utils.py): ``[Rank 0] (after 10 iterations) memory (MB) |
#: allocated: ... | max allocated: ... | reserved: ... | max reserved: ...``
MEMORY_RE = re.compile(r"\[Rank 0\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([0-9.]+) \| "
                       r"max allocated: ([0-9.]+)")
#: pretrain_gpt.py's banner: ``> Megatron-Core version .......... 0.19.2``
MCORE_RE = re.compile(r"> Megatron-Core version \.+ (\S+)")
#: Overrides the benchmark sets itself (both sides run the same iterations and window).
OWN_OVERRIDES = ("train.train_iters", "measure.start_step", "measure.steps", "profile", "measure.profile",
                 "output_dir")
#: What differs between the two sides and stays so (printed under the table).
NOT_MATCHED = [
    "optimizer kernel: train.py switches megatron's torch AdamW to torch's fused kernel (train.fused_adam=true); "
    "pretrain_gpt.py without TE/apex runs torch AdamW in its foreach mode (no flag changes it). "
    "train.fused_adam=false runs the same kernel on both sides",
    "data loading: pretrain_gpt.py keeps its 2 background data-loader workers (--num-workers); train.py draws "
    "MockGPTDataset samples in the training process",
    "logging: pretrain_gpt.py logs every iteration (--log-interval 1: a loss read and a line per iteration, "
    "inside its timed interval); train.py times each step alone, synchronized before and after",
    "implementation (what is compared): train.py runs its own unfused core attention (recipes/build/attention.py) "
    "and megatron-core with its workarounds (recipes/build/upstream.py: cross-entropy and grad norm without host "
    "syncs); pretrain_gpt.py runs megatron's DotProductAttention and megatron-core as installed",
    "max allocated: pretrain_gpt.py's is since the process started (report_memory at the last iteration); "
    "train.py's since its measured window started (the same steady-state peak unless an earlier step was higher)",
]
GIB = 1024**3
#: TransformerConfig fields ``--check-args`` does not compare, and why.
NOT_COMPARED = {
    "use_cpu_initialization": "train.py's config is built here on a CPU; on the GPU it is false, as Megatron-LM's",
    "tensor_parallel_num_weight_shards": "None (train.py) and Megatron-LM's 1 both mean no GTP sharding at TP 1",
    "expert_tensor_parallel_num_weight_shards": "as tensor_parallel_num_weight_shards",
    "cp_comm_type": "read only with context parallelism",
    "inference_sampling_seed": "read only by inference",
}


def _refuse(option: str, problem: str, fix: str) -> None:
    raise ConfigError(option, problem, fix)


def _recompute_args(rc: dict) -> list[str]:
    gran, modules = rc["recompute_granularity"], list(rc["recompute_modules"])
    if rc["distribute_saved_activations"]:
        _refuse("recompute.distribute_saved_activations", "needs tensor parallelism; bench_peer runs one GPU",
                "set recompute.distribute_saved_activations=false")
    if gran is None:
        return []
    if gran == "selective":
        if not modules:
            _refuse("recompute=control", "selective recompute of no module has no pretrain_gpt.py equivalent "
                    "(--recompute-modules takes one or more)", "use recompute=none (it recomputes nothing too)")
        if modules == ["core_attn"]:
            return ["--recompute-activations"]  # Megatron-LM's selective, recompute_modules [core_attn]
        return ["--recompute-granularity", "selective", "--recompute-modules", *modules]
    if gran == "full":
        return ["--recompute-granularity", "full", "--recompute-method", str(rc["recompute_method"]),
                "--recompute-num-layers", str(rc["recompute_num_layers"])]
    _refuse("recompute.recompute_granularity", f"{gran!r} is not selective or full", "use recompute=none|selective/<m>|full")
    return []


def _check_mappable(cfg: dict) -> None:
    """Refuse (ConfigError naming the option) what this benchmark cannot run as pretrain_gpt.py on one GPU."""
    model, par, launcher = cfg["model"], cfg["parallel"], cfg["launcher"]
    if model["family"] != "standard_attn":
        _refuse(f"model={model['family']}", "bench_peer maps the dense GPT only (MoE, MLA, GDN are not mapped yet)",
                "use model=standard_attn")
    backend = cfg["attention"]["backend"]
    if backend == "sdpa":
        _refuse("attention=sdpa", "pretrain_gpt.py's local spec has no SDPA core attention: its DotProductAttention "
                "materializes the [b, heads, s, s] scores", "use attention=unfused (the same computation as megatron's)")
    if backend != "unfused":
        _refuse(f"attention={backend}", "bench_peer runs Megatron-LM's local spec (no Transformer Engine)",
                "use attention=unfused")
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                "expert_model_parallel_size"):
        if par[key] != 1:
            _refuse(f"parallel.{key}", f"is {par[key]}; bench_peer runs one GPU", "use parallel=single")
    if par["virtual_pipeline_model_parallel_size"] or par["sequence_parallel"]:
        _refuse("parallel", "virtual pipeline stages and sequence parallelism need several GPUs", "use parallel=single")
    if launcher["nproc_per_node"] * launcher["nnodes"] != 1:
        _refuse("launcher.nproc_per_node", "bench_peer runs one process on one GPU", "use launcher=local with one process")
    off = cfg["offload"]
    if off["fine_grained_activation_offloading"] or off["offload_modules"] or off["cpu_offloading"]:
        _refuse("offload", "activation offload is not mapped", "use offload=none")
    if cfg["data"]["name"] != "mock":
        _refuse(f"data={cfg['data']['name']}", "bench_peer runs both sides on mock data", "use data=mock")
    if cfg["checkpoint"]["save"] or cfg["checkpoint"]["resume"]:
        _refuse("checkpoint", "checkpoints are not part of the measured step", "use checkpoint=none")
    if cfg["train"]["optimizer"] != "auto":
        _refuse(f"train.optimizer={cfg['train']['optimizer']}", "pretrain_gpt.py runs megatron's optimizer",
                "use train.optimizer=auto (megatron's DistributedOptimizer on a GPU)")
    if cfg["recipe"]:
        _refuse("recipe", "named recipes are not mapped", "compose the model with model=standard_attn and size=...")


def peer_args(cfg: dict, iters: int) -> list[str]:
    """pretrain_gpt.py's arguments for the run ``cfg`` (composed as train.py does), on one GPU."""
    _check_mappable(cfg)
    model, train, data = cfg["model"], cfg["train"], cfg["data"]
    gated_silu = model["gated_linear_unit"] and model["activation"] == "silu"
    if not gated_silu and (model["gated_linear_unit"] or model["activation"] != "gelu"):
        _refuse("model.activation", f"gated_linear_unit={model['gated_linear_unit']} with {model['activation']} is not "
                "mapped (pretrain_gpt.py: --swiglu, or gelu)", "use model.activation=silu with gated_linear_unit=true")
    args = ["--transformer-impl", "local",
            "--num-layers", str(model["num_layers"]), "--hidden-size", str(model["hidden_size"]),
            "--ffn-hidden-size", str(model["ffn_hidden_size"]),
            "--num-attention-heads", str(model["num_attention_heads"])]
    if model["num_query_groups"] is not None:
        args += ["--group-query-attention", "--num-query-groups", str(model["num_query_groups"])]
    if model["kv_channels"] is not None:
        args += ["--kv-channels", str(model["kv_channels"])]
    gbs = train["global_batch_size"] or train["micro_batch_size"]  # one data-parallel rank
    args += ["--seq-length", str(train["seq_length"]), "--max-position-embeddings", str(train["seq_length"]),
             "--micro-batch-size", str(train["micro_batch_size"]), "--global-batch-size", str(gbs)]
    if gated_silu:
        args += ["--swiglu"]
    args += ["--normalization", model["normalization"],
             "--position-embedding-type", model["position_embedding_type"],
             "--rotary-base", str(model["rotary_base"])]
    if not model["add_bias_linear"]:
        args += ["--disable-bias-linear"]
    if model["untie_embeddings_and_output_weights"]:
        args += ["--untie-embeddings-and-output-weights"]
    if model["qk_layernorm"]:
        args += ["--qk-layernorm"]
    args += ["--hidden-dropout", str(model["hidden_dropout"]), "--attention-dropout", str(model["attention_dropout"]),
             "--init-method-std", str(model["init_method_std"])]
    # train.py's fusions on a GPU (recipes.build.model.transformer_config_kwargs): Megatron-LM's defaults
    # are on for all of these; bias-dropout fusion is on in both.
    if not resolve_swiglu_fusion(model, on_gpu=True):
        args += ["--no-bias-swiglu-fusion" if gated_silu else "--no-bias-gelu-fusion"]
    args += ["--no-masked-softmax-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
             "--no-persist-layer-norm"]
    if model["attention_softmax_in_fp32"]:
        args += ["--attention-softmax-in-fp32"]
    args += _recompute_args(cfg["recompute"])
    if resolve_precision(train["precision"], on_gpu=True) == "bf16":
        args += ["--bf16"]  # and with it, fp32 gradient accumulation and reduction (as train.py's grad_reduce_in_fp32)
    args += ["--use-distributed-optimizer", "--optimizer", "adam",
             "--lr", str(train["lr"]), "--min-lr", str(train["min_lr"]),
             "--lr-decay-style", train["lr_decay_style"],
             "--lr-warmup-iters", str(train["lr_warmup_iters"]), "--lr-warmup-init", str(train["lr_warmup_init"])]
    if train["lr_decay_iters"] is not None:
        args += ["--lr-decay-iters", str(train["lr_decay_iters"])]
    if train["lr_decay_style"] == "WSD":
        args += ["--lr-wsd-decay-style", train["lr_wsd_decay_style"]]
        if train["lr_wsd_decay_iters"] is not None:
            args += ["--lr-wsd-decay-iters", str(train["lr_wsd_decay_iters"])]
    args += ["--weight-decay", str(train["weight_decay"])]
    if train["start_weight_decay"] is not None or train["end_weight_decay"] is not None:
        args += ["--start-weight-decay", str(train["start_weight_decay"]),
                 "--end-weight-decay", str(train["end_weight_decay"]),
                 "--weight-decay-incr-style", train["weight_decay_incr_style"]]
    args += ["--clip-grad", str(train["clip_grad"]), "--seed", str(train["seed"])]
    if train["manual_gc"]:  # the same flags, the same collector policy
        args += ["--manual-gc", "--manual-gc-interval", str(train["manual_gc_interval"])]
    vocab = model["vocab_size"]
    args += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab)]
    if vocab % 128:  # Megatron-LM pads the vocabulary to a multiple of 128 by default; train.py does not
        args += ["--make-vocab-size-divisible-by", "1"]
    # train.py's batches carry no attention mask (the core attention applies the causal mask) and it
    # checks no loss or gradient for NaN: Megatron-LM's defaults would build a [b, 1, s, s] mask per
    # sample and read the loss on the host every micro-batch.
    args += ["--no-create-attention-mask-in-dataloader", "--no-check-for-nan-in-loss-and-grad"]
    args += ["--train-iters", str(iters), "--log-interval", "1", "--log-memory-interval", str(iters)]
    if data["eval_interval"]:
        args += ["--eval-interval", str(data["eval_interval"]), "--eval-iters", str(data["eval_iters"])]
    else:
        # no evaluation; Megatron-LM still divides by --eval-interval (training.py), so it gets one
        args += ["--eval-iters", "0", "--eval-interval", str(iters + 1)]
    return args  # no --save: no checkpoint


def torchrun() -> str:
    """The torchrun next to this Python (the venv's), else the one on PATH."""
    here = Path(sys.executable).with_name("torchrun")
    return str(here) if here.exists() else "torchrun"


def peer_command(cfg: dict, megatron_lm: Path | str, iters: int) -> list[str]:
    """The full command line of the peer run."""
    return [torchrun(), "--standalone", "--nproc_per_node", "1", str(Path(megatron_lm) / "pretrain_gpt.py"),
            *peer_args(cfg, iters)]


def window_overrides(iters: int, start_step: int) -> list[str]:
    """train.py's overrides for the benchmark's run: ``iters`` steps, measured from ``start_step`` to the end."""
    return ["profile=none", f"train.train_iters={iters}", f"measure.start_step={start_step}",
            f"measure.steps={iters - start_step + 1}"]


def project_overrides(overrides: list[str], iters: int, start_step: int) -> list[str]:
    """train.py's overrides for the benchmark: the user's, then what pretrain_gpt.py cannot match here,
    then the window. Without Apex and Transformer Engine it neither accumulates weight gradients in fp32
    inside the GEMM (--no-gradient-accumulation-fusion) nor fuses RoPE (--no-rope-fusion): train.py runs
    both unfused too, unless told."""
    match = [f"{key}=false" for key in PEER_UNFUSED if not any(o.startswith(f"{key}=") for o in overrides)]
    return [*overrides, *match, *window_overrides(iters, start_step)]


#: train.py's fusions that pretrain_gpt.py has only with Apex or Transformer Engine.
PEER_UNFUSED = ("model.gradient_accumulation_fusion", "model.apply_rope_fusion")


def parse_peer_log(text: str, start_step: int) -> dict:
    """pretrain_gpt.py's stdout -> median ms over iterations >= ``start_step``, the per-iteration times, the
    last reported max allocated GiB (None when not printed) and the megatron-core version it ran."""
    times = {int(i): float(ms) for i, ms in ITERATION_RE.findall(text)}
    window = [ms for i, ms in sorted(times.items()) if i >= start_step]
    if not window:
        raise ValueError(f"no 'elapsed time per iteration (ms)' line for iterations >= {start_step} in "
                         f"pretrain_gpt.py's output ({len(times)} iteration lines)")
    memory = MEMORY_RE.findall(text)
    mcore = MCORE_RE.search(text)
    return {"step_ms": statistics.median(window), "times_ms": window,
            "max_allocated_gib": float(memory[-1][2]) * 2**20 / GIB if memory else None,
            "mcore": mcore.group(1) if mcore else None}


def _tail(proc: subprocess.CompletedProcess, lines: int = 40) -> str:
    return "\n".join(((proc.stdout or "") + (proc.stderr or "")).splitlines()[-lines:])


#: A makefile whose default goal does nothing: see ``peer_environment``.
NOOP_MAKEFILE = ".DEFAULT_GOAL := prebuilt\n.PHONY: prebuilt\nprebuilt:\n\t@:\n"


def peer_environment(megatron_lm: Path, scratch: Path) -> dict[str, str]:
    """The peer's environment. pretrain_gpt.py runs ``make -C <megatron.core>/datasets`` at start
    (megatron/training/initialize.py ``_compile_dependencies``) to build the C++ dataset helpers, and
    exits when make fails; the pip wheel of megatron-core ships them built (``helpers_cpp*.so``) but no
    Makefile, so make finds nothing to do and fails. Then GNU make's ``MAKEFILES`` names a makefile
    whose default goal does nothing (the prebuilt helpers are used). A checkout with its own
    megatron/core (and Makefile) is left to build them."""
    env = dict(os.environ)
    if (megatron_lm / "megatron" / "core").is_dir():
        return env
    spec = importlib.util.find_spec("megatron.core")
    datasets = Path(spec.origin).parent / "datasets" if spec and spec.origin else None
    if datasets and not (datasets / "Makefile").exists() and any(datasets.glob("helpers_cpp*")):
        if shutil.which("make") is None:
            sys.exit("bench_peer: pretrain_gpt.py runs `make` at start (its C++ dataset helpers) and this machine has "
                     "no make; install it (apt-get install make)")
        path = scratch / "prebuilt_dataset_helpers.mk"
        path.write_text(NOOP_MAKEFILE)
        env["MAKEFILES"] = str(path)
    return env


def run_peer(cmd: list[str], cfg: dict, start_step: int, megatron_lm: Path) -> dict:
    with tempfile.TemporaryDirectory() as scratch:  # its working directory: whatever it writes goes
        proc = subprocess.run(cmd, cwd=scratch, env=peer_environment(megatron_lm, Path(scratch)),
                              capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench_peer: pretrain_gpt.py exited {proc.returncode}:\n{_tail(proc)}")
    result = parse_peer_log(proc.stdout + proc.stderr, start_step)
    train = cfg["train"]
    tokens = (train["global_batch_size"] or train["micro_batch_size"]) * train["seq_length"]
    result["tokens_per_s"] = tokens / (result["step_ms"] / 1e3)
    return result


def train_command(overrides: list[str], out: str) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), *overrides, f"output_dir={out}"]


def run_project(overrides: list[str]) -> tuple[dict, list[str]]:
    """train.py in a fresh process: (median ms, tokens/s, peak allocated GiB, megatron-core version), command."""
    with tempfile.TemporaryDirectory() as out:
        cmd = train_command(overrides, out)
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        path = Path(out) / "result.json"
        if proc.returncode != 0 or not path.exists():
            sys.exit(f"bench_peer: train.py exited {proc.returncode}:\n{_tail(proc)}")
        result = json.loads(path.read_text())
    rank = result["ranks"][0]
    if rank.get("status") != "ok" or "timing" not in rank:
        sys.exit(f"bench_peer: train.py's rank 0 status {rank.get('status')!r}: {rank.get('error', '')}")
    timing = rank["timing"]
    return {"step_ms": timing["step_time_s"] * 1e3, "tokens_per_s": timing["tokens_per_s"],
            "max_allocated_gib": (rank.get("memory") or {}).get("peak_allocated_gib"),
            "mcore": _installed_mcore(), "device": rank.get("device")}, cmd


def _installed_mcore() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return None


def _row(side: str, repeat: int, r: dict) -> str:
    mem = f"{r['max_allocated_gib']:.2f}" if r["max_allocated_gib"] is not None else "n/a"
    return f"| {side} | {repeat} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {mem} |"


def check_args(cfg: dict, argv: list[str], megatron_lm: Path) -> list[str]:
    """Parse ``argv`` with ``megatron_lm``'s own parser and validate_args (CPU) and list what its model,
    shape and batch differ in from train.py's GPU model (``TransformerConfig`` field by field)."""
    from recipes.build.model import build_transformer_config, resolve_rope_fusion

    sys.path.insert(0, str(megatron_lm))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *argv]
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
            args = parse_args()
            validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})  # pretrain_gpt.py's defaults
            build_tokenizer(args)  # sets args.padded_vocab_size
    finally:
        sys.argv = saved
    theirs = core_transformer_config_from_args(args)
    ours = build_transformer_config(cfg, on_gpu=True)
    diffs = []
    for f in dataclasses.fields(ours):
        a, b = getattr(ours, f.name, None), getattr(theirs, f.name, None)
        if callable(a) or callable(b):  # init methods are made per config; compare functions by name
            a, b = getattr(a, "__name__", type(a).__name__), getattr(b, "__name__", type(b).__name__)
        if f.name == "recompute_modules" and ours.recompute_granularity != "selective":
            continue  # read only by selective recompute
        if a != b and f.name not in NOT_COMPARED:
            diffs.append(f"TransformerConfig.{f.name}: train.py {a!r}, pretrain_gpt.py {b!r}")
    train, model = cfg["train"], cfg["model"]
    expected = {"padded_vocab_size": model["vocab_size"], "seq_length": train["seq_length"],
                "micro_batch_size": train["micro_batch_size"],
                "global_batch_size": train["global_batch_size"] or train["micro_batch_size"],
                "untie_embeddings_and_output_weights": model["untie_embeddings_and_output_weights"],
                "position_embedding_type": model["position_embedding_type"], "rotary_base": model["rotary_base"],
                "use_distributed_optimizer": True, "accumulate_allreduce_grads_in_fp32": ours.bf16,
                "lr": train["lr"], "weight_decay": train["weight_decay"], "clip_grad": train["clip_grad"],
                "train_iters": int(argv[argv.index("--train-iters") + 1]), "eval_iters": 0,
                "create_attention_mask_in_dataloader": False, "save": None}
    diffs += [f"args.{k}: train.py {v!r}, pretrain_gpt.py {getattr(args, k, None)!r}"
              for k, v in expected.items() if getattr(args, k, None) != v]
    if resolve_rope_fusion(model, on_gpu=True) and args.apply_rope_fusion is False:  # not a TransformerConfig field here
        diffs.append("model.apply_rope_fusion: train.py's fused RoPE (recipes.build.rope), pretrain_gpt.py unfused")
    return diffs


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Everything else is a Hydra override, as train.py takes them.")
    parser.add_argument("--megatron-lm", type=Path, required=True,
                        help="a Megatron-LM directory with pretrain_gpt.py (benchmarks/extract_megatron_lm.sh makes one)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating pairs of fresh processes (default 2)")
    parser.add_argument("--iters", type=int, default=10, help="training iterations of each run (default 10)")
    parser.add_argument("--start-step", type=int, default=3,
                        help="first timed iteration (1-based) on both sides; the earlier ones warm up (default 3)")
    parser.add_argument("--check-args", action="store_true",
                        help="parse the peer's command line with Megatron-LM's parser here (no GPU), list the "
                             "model differences, run nothing")
    opts, overrides = parser.parse_known_args(argv)
    opts.megatron_lm = opts.megatron_lm.resolve()  # the peer runs in a scratch directory
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        parser.error(f"unknown option(s) {' '.join(unknown)}")
    if opts.repeats < 1:
        parser.error(f"--repeats needs a whole number of process pairs >= 1, got {opts.repeats}")
    if opts.start_step < 1 or opts.iters < opts.start_step:
        parser.error(f"--iters ({opts.iters}) must reach --start-step ({opts.start_step} >= 1): nothing would be timed")
    own = [o for o in overrides if o.lstrip("+~").partition("=")[0] in OWN_OVERRIDES]
    if own:
        parser.error(f"{' '.join(own)}: bench_peer sets these itself (use --iters and --start-step)")
    return opts, overrides


def main(argv: list[str] | None = None) -> None:
    opts, overrides = _parse(sys.argv[1:] if argv is None else argv)
    ours_overrides = project_overrides(overrides, opts.iters, opts.start_step)
    try:
        cfg = compose_config(ours_overrides)
        cmd = peer_command(cfg, opts.megatron_lm, opts.iters)
    except ConfigError as err:
        sys.exit(f"bench_peer: {err}")
    if not (opts.megatron_lm / "pretrain_gpt.py").is_file():
        sys.exit(f"bench_peer: {opts.megatron_lm} has no pretrain_gpt.py (--megatron-lm is a Megatron-LM checkout "
                 "or the extract of benchmarks/extract_megatron_lm.sh)")
    if (opts.megatron_lm / "megatron" / "core").is_dir():
        print(f"note: {opts.megatron_lm}/megatron/core exists: pretrain_gpt.py imports that megatron-core, not the "
              "installed one train.py runs (benchmarks/extract_megatron_lm.sh leaves it out)", file=sys.stderr)
    if opts.check_args:
        print(shlex.join(cmd))
        diffs = check_args(cfg, peer_args(cfg, opts.iters), opts.megatron_lm)
        print("\n".join(diffs) if diffs else "\nno difference: pretrain_gpt.py's TransformerConfig, shape and "
              "batch are train.py's")
        print("not compared: " + "; ".join(f"{k} ({v})" for k, v in NOT_COMPARED.items()))
        sys.exit(1 if diffs else 0)

    # No torch here: a CUDA context in this process would hold GPU memory through both sides' runs.
    print(f"{time.strftime('%Y-%m-%d')}, overrides: {' '.join(overrides) or '(defaults)'}, "
          f"{opts.repeats} alternating pairs of fresh processes, {opts.iters} iterations each, "
          f"median of iterations {opts.start_step}-{opts.iters}", flush=True)
    rows, ratios, train_cmd, versions = [], [], None, {}
    for i in range(1, opts.repeats + 1):
        peer = run_peer(cmd, cfg, opts.start_step, opts.megatron_lm)
        ours, train_cmd = run_project(ours_overrides)
        versions = {"pretrain_gpt.py": peer["mcore"], "train.py": ours["mcore"]}
        rows += [_row("Megatron-LM pretrain_gpt.py", i, peer), _row("train.py", i, ours)]
        ratios.append(ours["tokens_per_s"] / peer["tokens_per_s"])
        print(f"pair {i}: pretrain_gpt.py {peer['step_ms']:.1f} ms, train.py {ours['step_ms']:.1f} ms, "
              f"ratio {ratios[-1]:.3f}", flush=True)
    print("\n| side | repeat | median step ms | tokens/s | max allocated GiB |\n|---|---|---|---|---|")
    print("\n".join(rows))
    print("\n| pair | tokens/s ratio train.py / pretrain_gpt.py |\n|---|---|")
    print("\n".join(f"| {i} | {r:.3f} |" for i, r in enumerate(ratios, 1)))
    print(f"\nmedian ratio {statistics.median(ratios):.3f} over {len(ratios)} pairs "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}); target >= 1.000")
    print(f"device: {ours['device']}; megatron-core: pretrain_gpt.py {versions['pretrain_gpt.py']}, "
          f"train.py {versions['train.py']}")
    print(f"\npretrain_gpt.py: {shlex.join(cmd)}")
    print(f"train.py: {shlex.join(train_cmd)}  (output_dir: a temporary directory per run)")
    print("\nnot matched:\n" + "\n".join(f"- {n}" for n in NOT_MATCHED))


if __name__ == "__main__":
    main()
