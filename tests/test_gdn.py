"""model=gdn: GatedDeltaNet layers mixed with attention layers, and the gdn_norm_out label, on a CPU.

The CPU runs fla's pure-PyTorch references (``recipes.build.gdn.select_gdn_ops``), so these tests check the
layer's structure, the label's checkpoint and its exactness, not fla's Triton kernels (GPU only).
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from conftest import REPO, build_trainer, compose, measured, train_in_process

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU reference ops")


def _gdn_cfg(*overrides: str) -> dict:
    """Four tiny layers, every 2nd standard attention: GDN, attention, GDN, attention."""
    return compose("model=gdn", "model.num_layers=4", "model.linear_attention_freq=2", *overrides)


def _norm_out_bytes(cfg: dict) -> int:
    """One GDN layer's gated-norm output [s, b, value heads x value dim], fp32 on a CPU."""
    m, t = cfg["model"], cfg["train"]
    return 4 * t["seq_length"] * t["micro_batch_size"] * m["linear_num_value_heads"] * m["linear_value_head_dim"]


def test_layers_follow_megatrons_linear_attention_pattern(megatron_world):
    """linear_attention_freq=3 over 4 layers: GDN, GDN, attention, GDN (megatron's own pattern)."""
    from recipes.build.gdn import linear_attention_pattern

    trainer = build_trainer(compose("model=gdn", "model.num_layers=4", "model.linear_attention_freq=3"))
    try:
        kinds = [type(layer.self_attention).__name__ for layer in trainer.chunks[0].decoder.layers]
        assert linear_attention_pattern(trainer.config) == [1, 1, 0, 1]
        assert kinds == ["GatedDeltaNet", "GatedDeltaNet", "SelfAttention", "GatedDeltaNet"]
        gdn = trainer.chunks[0].decoder.layers[0].self_attention
        assert (gdn.num_key_heads, gdn.num_value_heads, gdn.key_head_dim, gdn.conv_kernel_dim) == (2, 4, 16, 4)
    finally:
        trainer.close()


def test_gdn_model_trains_and_the_profile_points_at_gdn_norm_out(megatron_world):
    """A few steps with GDN and attention layers both present; loss finite and falling."""
    from recipes.measure.timeline import first_label_to_try

    cfg = compose("model=gdn", "attention=unfused", "recompute=selective/gdn_norm_out-core_attn",
                  "train.train_iters=6", "measure.start_step=3", "train.lr=3e-3")
    result = train_in_process(cfg)
    assert result["status"] == "ok", result.get("error")
    losses = result["loss"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    labels = result["labels"]
    assert labels["gdn_norm_out"]["wraps"] == 1 and labels["core_attn"]["wraps"] == 1  # one of each
    assert labels["gdn_norm_out"]["saved_bytes"] > 0 and labels["core_attn"]["saved_bytes"] > 0
    assert not result["warnings"]
    label, why = first_label_to_try(result)  # the GDN mixer holds most activations here
    assert label == "selective/gdn_norm_out", why


#: These two share their GDN points (conftest.measured) in one worker.
@pytest.mark.xdist_group("measured")
def test_gdn_norm_out_recomputes_per_gdn_layer_and_drops_the_norm_output(megatron_world):
    cfg = _gdn_cfg("recompute=control")
    _, _, control, counts = measured(cfg)
    assert counts == {}
    _, _, ledger, counts = measured(_gdn_cfg("recompute=selective/gdn_norm_out"))
    assert counts == {"gdn_norm_out": {"forward": 2, "recompute": 2}}  # one per GDN layer
    assert {k: v for k, v in ledger.items() if k != "gdn"} == {k: v for k, v in control.items() if k != "gdn"}
    per_layer = (control["gdn"] - ledger["gdn"]) / 2
    norm_out = _norm_out_bytes(cfg)
    # At least the norm output out_proj keeps; at most what the checkpointed function creates (norm
    # input copy, normalized, gate activation, gated output, out_proj input, fp32 rstd). Measured: 4x + rstd.
    assert norm_out <= per_layer <= 5 * norm_out + norm_out // 16, per_layer / norm_out
    _, _, both, counts = measured(_gdn_cfg("recompute=selective/gdn_norm_out-core_attn"))
    assert counts == {"gdn_norm_out": {"forward": 2, "recompute": 2}, "core_attn": {"forward": 2, "recompute": 2}}
    assert both["gdn"] == ledger["gdn"] and both["core_attn"] == 0 < control["core_attn"]


@pytest.mark.xdist_group("measured")
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gdn_norm_out_is_bit_exact(megatron_world, dropout):
    drop = [f"model.hidden_dropout={dropout}", f"model.attention_dropout={dropout}"]
    loss0, grads0, _, _ = measured(_gdn_cfg("recompute=none", *drop))
    assert any("self_attention.in_proj" in n for n in grads0) and any("linear_qkv" in n for n in grads0)
    for option in ("selective/gdn_norm_out", "selective/gdn_norm_out-core_attn"):
        loss, grads, _, counts = measured(_gdn_cfg(f"recompute={option}", *drop))
        assert counts["gdn_norm_out"]["recompute"] == 2
        assert loss == loss0, option
        assert grads.keys() == grads0.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, grads0[name]), f"{option}: {name}"


def test_gdn_norm_out_is_refused_on_a_dense_model(megatron_world):
    from recipes.errors import ConfigError
    from recipes.measure.labels import LabelError, check_resolved, resolve_labels
    from recipes.validate import validate

    with pytest.raises(ConfigError) as err:  # before launch
        validate(compose("model=standard_attn", "recompute=selective/gdn_norm_out"), num_gpus=0,
                 te_available=False)
    assert err.value.option == "recompute=selective/gdn_norm_out" and "model=gdn" in err.value.fix
    trainer = build_trainer(compose("model=standard_attn", "recompute=control"))
    try:  # and against the built model: no module carries megatron's recompute_norm_out
        resolved = resolve_labels(trainer.chunks, ["gdn_norm_out"])
        assert resolved["gdn_norm_out"]["wraps"] == 0
        with pytest.raises(LabelError, match="model=gdn"):
            check_resolved(resolved)
    finally:
        trainer.close()


def test_gdn_options_are_checked_before_launch():
    from recipes.errors import ConfigError
    from recipes.validate import validate

    for overrides, option in ((["model.linear_attention_freq=1"], "model.linear_attention_freq"),
                              (["model.linear_num_value_heads=3"], "model.linear_num_value_heads"),
                              (["model.activation=gelu", "model.gated_linear_unit=false"], "model.activation")):
        with pytest.raises(ConfigError) as err:
            validate(compose("model=gdn", *overrides), num_gpus=0, te_available=False)
        assert err.value.option == option


def test_estimator_predicts_gdn_and_refuses_by_name_what_it_does_not_model():
    """The estimator models GDN layers on both devices (tests/test_estimate.py matches the CPU ledger
    byte for byte, tests/test_h200_results.py the H200 rows); what was never matched against a
    ledger is refused by option: tensor parallel, a non-SiLU activation (recipes.validate: fla asserts SiLU),
    and on CUDA a LayerNorm output norm or a precision other than bf16."""
    from recipes.errors import ConfigError
    from recipes.predict.estimate import predict, predict_options
    from recipes.recompute import options_for

    cfg = compose("model=gdn")
    for device in ("cpu", "cuda"):
        p = predict(cfg, device=device)
        gdn, attention = p["per_layer"]  # tiny: one GDN layer, then one attention layer
        assert gdn["gdn"] > 0 and gdn["core_attn"] == 0 and attention["gdn"] == 0 and attention["core_attn"] > 0
    done, refused = predict_options(compose("model=gdn", "size=h200"), "cuda")
    assert sorted(option for option, _ in done) == sorted(options_for("gdn")) and not refused
    norm_out = dict(done)["selective/gdn_norm_out"]["layer_terms"]
    assert ("gdn", "out_proj input (gated norm output)", 0) in norm_out  # discarded by the checkpoint
    for overrides, option in ((["parallel=tp2"], "parallel.tensor_model_parallel_size"),
                              (["model.activation=gelu"], "model.activation"),
                              (["model.normalization=LayerNorm"], "model.normalization"),
                              (["attention=unfused", "train.precision=fp32"], "train.precision")):
        with pytest.raises(ConfigError) as err:
            predict(compose("model=gdn", *overrides), device="cuda")
        assert err.value.option == option, overrides
    predict(compose("model=gdn", "model.normalization=LayerNorm"), device="cpu")  # matched on the CPU


@CPU_ONLY
def test_cpu_switch_selects_fla_naive_reference(monkeypatch):
    from fla.ops.gated_delta_rule import naive

    from recipes.build import gdn

    assert gdn.select_gdn_ops() is True
    assert all(v.startswith("recipes.build.gdn.") for v in gdn.gdn_ops_in_use().values())
    calls = []
    reference = naive.naive_chunk_gated_delta_rule
    monkeypatch.setattr(naive, "naive_chunk_gated_delta_rule", lambda *a, **k: calls.append(1) or reference(*a, **k))
    torch.manual_seed(0)
    b, s, h, d = 2, 20, 3, 8
    q, k = (torch.nn.functional.normalize(torch.randn(b, s, h, d), dim=-1) for _ in range(2))
    v, beta, g = torch.randn(b, s, h, d), torch.rand(b, s, h), -torch.rand(b, s, h)
    out, _ = gdn.naive_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=False)
    assert calls == [1]
    # fla's chunked reference against its own token-by-token recurrence: the same delta rule
    expected, _ = naive.naive_recurrent_gated_delta_rule(q, k, v, beta, g)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    x, w = torch.randn(b, s, 6), torch.randn(6, 4)
    y, _ = gdn.causal_conv1d(x, w, activation="silu")
    manual = sum(w[:, j] * torch.nn.functional.pad(x, (0, 0, 3 - j, 0))[:, :s] for j in range(4))
    torch.testing.assert_close(y, torch.nn.functional.silu(manual))  # causal: token t sees t-3..t
    torch.testing.assert_close(gdn.l2norm(x), torch.nn.functional.normalize(x, dim=-1), atol=1e-5, rtol=1e-5)


@CPU_ONLY
def test_cpu_switch_keeps_the_triton_kernels_when_cuda_is_present():
    """A fresh process that reports CUDA: the switch does nothing and megatron keeps fla's kernels."""
    code = ("import torch; torch.cuda.is_available = lambda: True\n"
            "from recipes.build import gdn\n"
            "assert gdn.select_gdn_ops() is False\n"
            "ops = gdn.gdn_ops_in_use(); print(ops)\n"
            "assert all(v.startswith('fla.') for v in ops.values()), ops\n")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_megatron_gdn_spec_still_needs_transformer_engine():
    """recipes.build.gdn builds its own block spec because megatron's GDN spec fuses the input norm into
    in_proj, which the local backend lacks (in_proj=None). Fails once upstream has a local GDN spec."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_gated_delta_net_module_spec,
    )

    from recipes.build.model import build_transformer_config

    config = build_transformer_config(compose("model=gdn"), on_gpu=False)
    spec = get_gated_delta_net_module_spec(config, backend=LocalSpecProvider())
    assert spec.submodules.in_proj is None and spec.metainfo["fuse_input_layernorm"], (
        "upstream builds GDN on the local backend now: use get_gated_delta_net_module_spec in recipes.build.gdn")


def test_gdn_flops_count_gdn_layers_as_gdn():
    """MFU for model=gdn counts GDN mixers, not attention, in the GDN layers; selective labels
    replay work only in the layers they reach, full/block only in the layers it checkpoints; the
    average layer gives --predict the model's replay fraction."""
    from recipes.measure.flops import (
        attention_layer_forward_flops,
        gdn_layer_forward_flops,
        layer_forward_flops,
        replayed_layer_flops,
        step_flops,
    )

    cfg = compose("model=gdn", "size=h200")
    layer = attention_layer_forward_flops(cfg)
    layers, attn = cfg["model"]["num_layers"], cfg["model"]["num_layers"] // cfg["model"]["linear_attention_freq"]
    logits = 2 * cfg["train"]["micro_batch_size"] * cfg["train"]["seq_length"] * 2048 * cfg["model"]["vocab_size"]
    attn_layer = layer["attn_proj"] + layer["core_attn"] + layer["mlp"]
    gdn_layer = gdn_layer_forward_flops(cfg) + layer["mlp"]
    expected = attn * attn_layer + (layers - attn) * gdn_layer + logits
    assert step_flops(cfg, 1)["model"] == pytest.approx(3 * expected, rel=1e-12)
    core = step_flops(compose("model=gdn", "size=h200", "recompute=selective/core_attn"), 1)
    assert core["hardware"] - core["model"] == pytest.approx(attn * layer["core_attn"], rel=1e-9)
    block = step_flops(compose("model=gdn", "size=h200", "recompute=full/block", "recompute.recompute_num_layers=4"), 1)
    assert block["hardware"] - block["model"] == pytest.approx(3 * gdn_layer + attn_layer, rel=1e-9)  # layers 0-3
    average = layer_forward_flops(cfg)
    per_layer = sum(average[k] for k in ("attn_proj", "core_attn", "mlp"))
    mlp = replayed_layer_flops(compose("model=gdn", "size=h200", "recompute=selective/mlp"), average, per_layer)
    # mlp replays FC1 (2/3 of SwiGLU's MLP: recipes.build.mlp), in every layer
    assert mlp / per_layer == pytest.approx(layers * layer["mlp"] * 2 / 3 / (expected - logits))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's Triton kernels need a CUDA GPU")
def test_fla_kernels_match_the_reference_on_the_gpu():
    """The GPU's chunked delta-rule kernel (forward and every gradient) against fla's token-by-token
    reference, in fp32. This is what fla's Triton check (#640: Triton 3.4-3.7.0 on Hopper) guards:
    with a Triton it accepts, the kernel must agree with the recurrence, gradients included."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, naive

    from recipes.build.gdn import check_fla_kernels
    from recipes.errors import ConfigError

    try:
        check_fla_kernels()
    except ConfigError as refused:  # fla would refuse the backward below; model=gdn is refused the same way
        pytest.skip(str(refused))

    torch.manual_seed(0)
    b, s, h, hv, d = 2, 256, 2, 4, 64  # grouped values (hv = 2 h), as in model=gdn
    dev = torch.device("cuda")
    q = torch.nn.functional.normalize(torch.randn(b, s, h, d, device=dev), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, s, h, d, device=dev), dim=-1)
    v = torch.randn(b, s, hv, d, device=dev)
    beta, g = torch.rand(b, s, hv, device=dev), -torch.rand(b, s, hv, device=dev)
    leaves = [t.requires_grad_() for t in (q, k, v, beta, g)]
    out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    rep = hv // h  # the reference has no grouped heads: repeat q/k per value head
    ref, _ = naive.naive_recurrent_gated_delta_rule(q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2),
                                                    v, beta, g)
    ref_grads = torch.autograd.grad(ref.square().sum(), leaves)
    torch.testing.assert_close(out, ref.to(out.dtype), rtol=2e-3, atol=2e-3)
    for name, got, want in zip("q k v beta g".split(), grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=lambda m, n=name: f"d{n}: {m}")


def test_a_hopper_gpu_with_triton_before_3_7_1_is_refused_at_build_with_the_fix(monkeypatch):
    """recipes.build.gdn.check_fla_kernels on a simulated H200 with the image's Triton 3.6: refused before any
    step, naming fla #640 and the offline fix; Triton 3.7.1 or tilelang passes; no CUDA passes."""
    import importlib.util

    from fla import utils

    from recipes.build import gdn
    from recipes.errors import ConfigError

    gdn.check_fla_kernels()  # this machine as it is: no CUDA (CI), or a GPU with a fixed Triton
    monkeypatch.setattr(gdn, "cuda_available", lambda: True)
    monkeypatch.setattr(utils, "IS_NVIDIA_HOPPER", True)
    monkeypatch.setattr(utils, "TRITON_ABOVE_3_4_0", True)
    monkeypatch.setattr(utils, "TRITON_ABOVE_3_7_1", False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tilelang"
                        else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"fla #640") as err:
        gdn.check_fla_kernels()
    assert err.value.option == "model=gdn" and "triton>=3.7.1" in err.value.fix and "pack_triton.sh" in err.value.fix
    monkeypatch.setattr(utils, "TRITON_ABOVE_3_7_1", True)
    gdn.check_fla_kernels()


def test_fla_still_guards_its_hopper_triton_bug():
    """check_fla_kernels mirrors fla-core's own guard in chunk_bwd_dqkwg. Fails once fla drops it
    (fixed kernels or a new bound): then update or delete the check."""
    import inspect

    from fla.ops.common import chunk_o

    source = inspect.getsource(chunk_o.chunk_bwd_dqkwg)
    assert "IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1" in source
