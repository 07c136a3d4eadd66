"""benchmarks/bench_peer.py: the pretrain_gpt.py command line it builds from a run config, what it
refuses, and how it reads pretrain_gpt.py's output. No GPU, no Megatron-LM checkout."""

from __future__ import annotations

import importlib.util
from datetime import datetime
from pathlib import Path

import pytest
from conftest import REPO

from recipes.errors import ConfigError


def _bench():
    spec = importlib.util.spec_from_file_location("bench_peer", REPO / "benchmarks" / "bench_peer.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


bench = _bench()


def peer(*overrides: str, iters: int = 10) -> list[str]:
    cfg = bench.compose_config([*overrides, *bench.window_overrides(iters, 3)])
    return bench.peer_args(cfg, iters)


def value(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, f"{flag} {'missing' if flag not in args else 'twice'} in {args}"
    return args[args.index(flag) + 1]


def test_dense_h200_full_recompute_maps_shape_batch_and_settings():
    args = peer("model=standard_attn", "size=h200", "attention=unfused", "recompute=full")
    shape = {"--num-layers": "8", "--hidden-size": "2048", "--ffn-hidden-size": "8192", "--num-attention-heads": "16",
             "--seq-length": "4096", "--max-position-embeddings": "4096", "--micro-batch-size": "2",
             "--global-batch-size": "8", "--vocab-size": "32768", "--tokenizer-type": "NullTokenizer",
             "--transformer-impl": "local", "--normalization": "RMSNorm", "--position-embedding-type": "rope",
             "--recompute-granularity": "full", "--recompute-method": "uniform", "--recompute-num-layers": "1",
             "--train-iters": "10", "--log-interval": "1", "--eval-iters": "0", "--hidden-dropout": "0.0",
             "--attention-dropout": "0.0"}
    assert {flag: value(args, flag) for flag in shape} == shape
    for flag in ("--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--bf16",
                 "--use-distributed-optimizer", "--mock-data", "--no-masked-softmax-fusion", "--no-rope-fusion",
                 "--no-gradient-accumulation-fusion"):
        assert flag in args
    # bf16 softmax (model.attention_softmax_in_fp32=false), fused SwiGLU (null resolves to on for a GPU),
    # MHA, no checkpoint, no recompute flags of the other kinds
    for flag in ("--attention-softmax-in-fp32", "--no-bias-swiglu-fusion", "--group-query-attention", "--save",
                 "--recompute-activations", "--recompute-modules", "--make-vocab-size-divisible-by"):
        assert flag not in args


@pytest.mark.parametrize("recompute, expected", [
    ("none", []),
    ("selective/core_attn", ["--recompute-activations"]),
    ("selective/mlp", ["--recompute-granularity", "selective", "--recompute-modules", "mlp"]),
    ("selective/moe_act-layernorm", ["--recompute-granularity", "selective", "--recompute-modules", "moe_act",
                                     "layernorm"]),
    ("full/block", ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]),
])
def test_recompute_mapping(recompute, expected):
    cfg = bench.compose_config(["size=h200", "attention=unfused", f"recompute={recompute}"])
    assert bench._recompute_args(cfg["recompute"]) == expected


def test_gqa_unfused_swiglu_fp32_softmax_and_odd_vocab():
    args = peer("size=h200", "attention=unfused", "model.num_query_groups=4", "model.bias_activation_fusion=false",
                "model.attention_softmax_in_fp32=true", "model.vocab_size=50257")
    assert value(args, "--num-query-groups") == "4" and "--group-query-attention" in args
    assert "--no-bias-swiglu-fusion" in args and "--attention-softmax-in-fp32" in args
    assert value(args, "--make-vocab-size-divisible-by") == "1"  # Megatron-LM would pad 50257 to 50304


def test_peer_command_is_one_process_torchrun_of_pretrain_gpt(tmp_path):
    cfg = bench.compose_config(["size=h200", "attention=unfused", *bench.window_overrides(10, 3)])
    cmd = bench.peer_command(cfg, tmp_path, 10)
    assert cmd[0].endswith("torchrun") and cmd[1:5] == ["--standalone", "--nproc_per_node", "1",
                                                         str(tmp_path / "pretrain_gpt.py")]
    assert cmd[5:] == bench.peer_args(cfg, 10)


def test_train_py_runs_unfused_gradient_accumulation_as_the_peer_does_without_apex():
    """pretrain_gpt.py without Apex cannot fuse the weight-gradient accumulation; train.py's side turns
    its own off to match, unless the user chose (then check_args lists the difference)."""
    ours = bench.project_overrides(["size=h200"], 10, 3)
    assert ours[:3] == ["size=h200", "model.gradient_accumulation_fusion=false", "model.apply_rope_fusion=false"]
    assert ours[3:] == bench.window_overrides(10, 3)
    composed = bench.compose_config(ours)["model"]
    assert composed["gradient_accumulation_fusion"] is False and composed["apply_rope_fusion"] is False
    told = bench.project_overrides(["model.gradient_accumulation_fusion=true"], 10, 3)
    assert told.count("model.gradient_accumulation_fusion=true") == 1 and "model.gradient_accumulation_fusion=false" not in told
    assert "model.apply_rope_fusion=false" in told
    args = peer("size=h200", "attention=unfused")
    assert "--no-gradient-accumulation-fusion" in args and "--no-rope-fusion" in args


def test_the_peer_collects_garbage_as_train_py_does():
    """train.manual_gc is Megatron-LM's --manual-gc: the peer gets the same policy, or none."""
    args = peer("size=h200", "attention=unfused", "train.manual_gc=true")
    assert args[args.index("--manual-gc") + 1:][:2] == ["--manual-gc-interval", "100"]
    assert "--manual-gc" not in peer("size=h200", "attention=unfused")


def test_train_py_runs_the_same_window():
    assert bench.window_overrides(10, 3) == ["profile=none", "train.train_iters=10", "measure.start_step=3",
                                             "measure.steps=8"]


@pytest.mark.parametrize("overrides, option, fix", [
    (["attention=sdpa"], "attention=sdpa", "attention=unfused"),
    (["attention=te"], "attention=te", "attention=unfused"),
    (["model=moe", "attention=unfused"], "model=moe", "model=standard_attn"),
    (["attention=unfused", "parallel=tp2"], "parallel.tensor_model_parallel_size", "parallel=single"),
    (["attention=unfused", "recompute=control"], "recompute=control", "recompute=none"),
    (["attention=unfused", "offload=core_attn"], "offload", "offload=none"),
])
def test_refused_configs_name_the_option(overrides, option, fix):
    with pytest.raises(ConfigError) as err:
        peer("size=h200", *overrides)
    assert err.value.option == option and fix in str(err.value)


def test_benchmark_owned_overrides_and_empty_windows_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        bench._parse(["--megatron-lm", str(tmp_path), "train.train_iters=20"])
    with pytest.raises(SystemExit):
        bench._parse(["--megatron-lm", str(tmp_path), "--iters", "2"])  # --start-step 3: nothing timed
    opts, overrides = bench._parse(["--megatron-lm", str(tmp_path), "--repeats", "3", "size=h200"])
    assert (opts.repeats, opts.iters, opts.start_step, overrides) == (3, 10, 3, ["size=h200"])


def _training_log_line(iteration: int, train_iters: int, ms: float) -> str:
    """A stdout line of Megatron-LM's training_log (megatron/training/training.py, core_r0.19.0), built
    with its own format strings."""
    log_string = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    log_string += ' iteration {:8d}/{:8d} |'.format(iteration, train_iters)  # noqa: UP032  (Megatron-LM's own format string)
    log_string += ' consumed samples: {:12d} |'.format(iteration * 8)  # noqa: UP032  (Megatron-LM's own format string)
    log_string += ' elapsed time per iteration (ms): {:.1f} |'.format(ms)  # noqa: UP032  (Megatron-LM's own format string)
    log_string += f' learning rate: {1e-4:.6E} |'
    log_string += f' global batch size: {8:5d} |'
    log_string += ' {}: {:.6E} |'.format('lm loss', 10.4)  # noqa: UP032  (Megatron-LM's own format string)
    log_string += f' loss scale: {1.0:.1f} |'
    log_string += f' grad norm: {3.2:.3f} |'
    log_string += ' number of skipped iterations: {:3d} |'.format(0)  # noqa: UP032  (Megatron-LM's own format string)
    log_string += ' number of nan iterations: {:3d} |'.format(0)  # noqa: UP032  (Megatron-LM's own format string)
    return log_string


def _report_memory_line(iteration: int, allocated_mb: float, max_allocated_mb: float) -> str:
    """report_memory's line (megatron/training/utils/common_utils.py), with its format strings."""
    string = f'(after {iteration} iterations)' + ' memory (MB)'
    string += f" | allocated: {allocated_mb:.2f}"
    string += f" | max allocated: {max_allocated_mb:.2f}"
    string += f" | reserved: {max_allocated_mb + 100:.2f}"
    string += f" | max reserved: {max_allocated_mb + 200:.2f}"
    return "[Rank {}] {}".format(0, string)  # noqa: UP032  (Megatron-LM's own format string)


def test_peer_log_median_over_the_window_memory_and_version():
    times = [2500.0, 140.0, 96.0, 95.0, 97.5, 94.0, 95.5, 96.5, 95.0, 98.0]
    lines = ["> Megatron-Core version .......... 0.19.2+61370c2", "building GPT model ..."]
    for i, ms in enumerate(times, 1):
        lines.append(_training_log_line(i, len(times), ms))
        if i in (1, 2, 10):
            lines.append(_report_memory_line(i, 20000.0, 40000.0 + i))
    parsed = bench.parse_peer_log("\n".join(lines), start_step=3)
    assert parsed["times_ms"] == times[2:]
    assert parsed["step_ms"] == pytest.approx(95.75)  # median of iterations 3..10
    assert parsed["max_allocated_gib"] == pytest.approx(40010.0 / 1024)  # the last report, MB -> GiB
    assert parsed["mcore"] == "0.19.2+61370c2"
    with pytest.raises(ValueError, match="elapsed time per iteration"):
        bench.parse_peer_log("\n".join(lines[:4]), start_step=3)


def test_peer_environment_makes_make_a_noop_only_for_the_installed_megatron_core(tmp_path, monkeypatch):
    monkeypatch.delenv("MAKEFILES", raising=False)
    monkeypatch.setattr(bench.shutil, "which", lambda name: f"/usr/bin/{name}")
    checkout = tmp_path / "Megatron-LM"
    (checkout / "megatron" / "core").mkdir(parents=True)
    assert "MAKEFILES" not in bench.peer_environment(checkout, tmp_path)  # its own Makefile builds the helpers
    spec = importlib.util.find_spec("megatron.core")
    datasets = Path(spec.origin).parent / "datasets"
    if (datasets / "Makefile").exists() or not any(datasets.glob("helpers_cpp*")):
        pytest.skip("this megatron-core is not a wheel with prebuilt dataset helpers and no Makefile")
    extract = tmp_path / "extract"
    extract.mkdir()
    env = bench.peer_environment(extract, tmp_path)
    assert Path(env["MAKEFILES"]).read_text() == bench.NOOP_MAKEFILE
