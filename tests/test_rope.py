"""Fused RoPE without Transformer Engine (``recipes.build.rope``): megatron's unfused rotary embedding
in one Triton kernel each way, bit-identical. On a CPU the kernels run under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from conftest import compose, gradients

from recipes.build import rope
from recipes.build.model import resolve_rope_fusion


def _eager(t, freqs, mla_interleaved=False, mscale=1.0):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    rope.uninstall()
    return _apply_rotary_pos_emb_bshd(t, freqs, mla_rotary_interleaved=mla_interleaved, mscale=mscale)


@pytest.mark.parametrize("seq,batch,heads,dim,rot,mla,strided,mscale", [
    (8, 2, 3, 16, 16, False, False, 1.0),   # q or k of the standard attention
    (8, 2, 3, 16, 16, False, True, 1.0),    # a view of the fused qkv output (the layer's case)
    (5, 1, 2, 24, 16, False, False, 1.0),   # fewer rotary dims than the head: the tail passes through
    (6, 2, 2, 8, 8, True, False, 0.7),      # MLA's interleaved rotary part, a yarn-like mscale
    (7, 2, 2, 12, 8, True, True, 1.0),
])
def test_outputs_and_input_gradients_are_bit_identical_to_megatrons(seq, batch, heads, dim, rot, mla, strided, mscale):
    gen = torch.Generator().manual_seed(seq * dim)
    base = torch.randn(seq, batch, heads, 3 * dim if strided else dim, generator=gen).to(torch.bfloat16)
    freqs = torch.randn(seq, 1, 1, rot, generator=gen) * 3
    grad = torch.randn(seq, batch, heads, dim, generator=gen).to(torch.bfloat16)
    results = []
    for fused in (False, True):
        leaf = base.clone().requires_grad_()
        t = leaf[..., :dim]
        out = (rope.fused_rotary_pos_emb(t, freqs, mla, mscale, interpret=True) if fused
               else _eager(t, freqs, mla, mscale))
        out.backward(grad)
        results.append((out.detach(), leaf.grad))
    (out_e, grad_e), (out_f, grad_f) = results
    assert torch.equal(out_f, out_e) and torch.equal(grad_f, grad_e)
    assert out_f.is_contiguous() and out_e.is_contiguous()
    assert not torch.equal(out_f, base[..., :dim])  # the rotation did something


def test_only_cos_and_sin_are_kept_for_backward_as_eager_keeps_them():
    """The activation ledger (and the estimator's RoPE term) stays as it was: two [s, 1, 1, rot] tensors."""
    t = torch.randn(4, 2, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    freqs = torch.randn(4, 1, 1, 8)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: kept.append(tuple(x.shape)) or x, lambda x: x):
        rope.fused_rotary_pos_emb(t, freqs, interpret=True)
    assert kept == [(4, 1, 1, 8), (4, 1, 1, 8)]


@pytest.mark.parametrize("overrides,replays", [(("model=standard_attn",), 1), (("model=standard_attn", "recompute=full"), 2),
                                               (("model=mla",), 1)])
def test_installed_it_replaces_megatrons_rope_in_a_whole_model_step_with_the_same_bits(megatron_world, overrides, replays):
    """A bf16 training step of a tiny model, with and without the fused RoPE routed in (under the
    interpreter on a CPU): the same loss, the same gradients, the same ledger; and it ran, in the
    forward and in full recompute's replay."""
    calls = []
    cfg = compose("size=tiny", "train.precision=bf16", *overrides)
    try:
        def fused(trainer):
            assert rope.install(interpret=True)
            original = rope.FusedRotaryPosEmb.apply
            rope.FusedRotaryPosEmb.apply = lambda *a: calls.append(1) or original(*a)
            fused.restore = lambda: setattr(rope.FusedRotaryPosEmb, "apply", original)

        loss_f, grads_f, ledger_f, _ = gradients(cfg, before=fused)
        fused.restore()
    finally:
        rope.uninstall()
    loss_e, grads_e, ledger_e, _ = gradients(cfg)
    assert len(calls) == 2 * cfg["model"]["num_layers"] * replays  # q and k in every layer
    assert loss_f == loss_e and ledger_f == ledger_e
    assert grads_f.keys() == grads_e.keys() and all(torch.equal(grads_f[n], grads_e[n]) for n in grads_e)


def test_what_it_does_not_cover_takes_megatrons_code():
    """Installed (interpreter on), rotate-half on bf16 goes through the kernels; ``rotary_interleaved``
    and fp32 tensors go to megatron's function unchanged."""
    from megatron.core.models.common.embeddings import rope_utils

    calls = []
    original = rope.FusedRotaryPosEmb.apply
    rope.FusedRotaryPosEmb.apply = lambda *a: calls.append(1) or original(*a)
    try:
        assert rope.install(interpret=True)
        freqs = torch.randn(4, 1, 1, 8)
        t = torch.randn(4, 2, 2, 8)
        for x, kwargs in ((t.bfloat16(), {}), (t.bfloat16(), {"rotary_interleaved": True}), (t, {})):
            before = len(calls)
            out = rope_utils._apply_rotary_pos_emb_bshd(x, freqs, **kwargs)
            expected = rope._ORIGINAL["bshd"](x, freqs, **kwargs)
            assert torch.equal(out, expected)
            assert len(calls) - before == (0 if kwargs or x.dtype == torch.float32 else 1)
    finally:
        rope.FusedRotaryPosEmb.apply = original
        rope.uninstall()


def test_uninstall_puts_megatrons_function_back():
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_bshd
    assert rope.install()
    assert rope_utils._apply_rotary_pos_emb_bshd is not original
    rope.uninstall()
    assert rope_utils._apply_rotary_pos_emb_bshd is original


def test_auto_fuses_on_a_gpu_for_rope_models_and_is_refused_where_it_means_nothing():
    from recipes.config import upgrade
    from recipes.errors import ConfigError
    from recipes.validate import validate

    model = compose("size=tiny")["model"]
    assert model["apply_rope_fusion"] is None
    assert resolve_rope_fusion(model, on_gpu=True) and not resolve_rope_fusion(model, on_gpu=False)
    assert not resolve_rope_fusion({**model, "position_embedding_type": "learned_absolute"}, on_gpu=True)
    assert not resolve_rope_fusion({**model, "apply_rope_fusion": False}, on_gpu=True)
    assert not resolve_rope_fusion({**model, "compile": "layer"}, on_gpu=True)  # inductor fuses it
    for overrides, gpus in ((["model.apply_rope_fusion=true"], 0),
                            (["model.apply_rope_fusion=true", "model.compile=layer"], 1),
                            (["model.apply_rope_fusion=true", "model.position_embedding_type=learned_absolute"], 1)):
        with pytest.raises(ConfigError) as err:
            validate(compose("size=tiny", *overrides), num_gpus=gpus)
        assert "model.apply_rope_fusion" in str(err.value) and "null" in str(err.value)
    validate(compose("size=tiny", "model.apply_rope_fusion=true"), num_gpus=1)
    stored = compose("size=tiny")
    del stored["model"]["apply_rope_fusion"]
    assert upgrade(stored)["model"]["apply_rope_fusion"] is False  # results measured before it ran unfused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the compiled Triton kernels")
@pytest.mark.parametrize("mla", [False, True])
def test_the_compiled_kernels_match_megatron_bit_for_bit_on_a_gpu(mla):
    """The same check as above through Triton's compiled kernels, at a layer's shape (the interpreter
    and the GPU must round alike: the kernels spell bf16 rounding out)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    seq, batch, heads, dim = 512, 2, 8, 64 if mla else 128
    base = torch.randn(seq, batch, heads, 3 * dim, generator=gen, device="cuda").to(torch.bfloat16)
    freqs = torch.randn(seq, 1, 1, dim, generator=gen, device="cuda") * 3
    grad = torch.randn(seq, batch, heads, dim, generator=gen, device="cuda").to(torch.bfloat16)
    results = []
    for fused in (False, True):
        leaf = base.clone().requires_grad_()
        t = leaf[..., :dim]
        out = rope.fused_rotary_pos_emb(t, freqs, mla) if fused else _eager(t, freqs, mla)
        out.backward(grad)
        results.append((out.detach(), leaf.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
