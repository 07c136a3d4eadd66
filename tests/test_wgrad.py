"""Gradient-accumulation fusion without Apex (``recipes.build.wgrad``): megatron's linear layers add
each weight gradient into the fp32 ``main_grad`` inside the GEMM."""

from __future__ import annotations

import pytest
import torch
from conftest import build_trainer, compose

from recipes.build.wgrad import enable, resolve_wgrad_fusion


def _linear_backward(fusion: bool, main_grad: torch.Tensor | None):
    """megatron's linear autograd function, one backward: (weight.grad, main_grad after)."""
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

    torch.manual_seed(0)
    x = torch.randn(6, 2, 16, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(8, 16))
    if main_grad is not None:
        weight.main_grad = main_grad
    out = linear_with_grad_accumulation_and_async_allreduce(x, weight, None, fusion, False, False)
    out.backward(torch.randn_like(out))
    return weight.grad, main_grad


def test_the_weight_gradient_is_added_into_main_grad_by_megatrons_own_backward():
    """With the fusion megatron's backward computes no weight gradient of its own: it calls the kernel,
    which adds grad_output^T x input onto what main_grad held (the earlier micro-batches')."""
    assert enable() in (True, False)
    from megatron.core.tensor_parallel import layers

    assert layers._grad_accum_fusion_available
    reference, _ = _linear_backward(fusion=False, main_grad=None)
    earlier = torch.full((8, 16), 0.5)
    grad, main_grad = _linear_backward(fusion=True, main_grad=earlier.clone())
    assert grad is None  # nothing left for the data-parallel wrapper to add
    torch.testing.assert_close(main_grad, earlier + reference, rtol=1e-6, atol=1e-6)
    assert not torch.equal(main_grad, earlier)


def test_auto_is_on_only_where_there_is_a_main_grad_and_refused_elsewhere():
    from recipes.errors import ConfigError
    from recipes.validate import validate

    model = compose("size=tiny")["model"]
    assert model["gradient_accumulation_fusion"] is None
    assert resolve_wgrad_fusion(model, on_gpu=True, megatron_optimizer=True)
    assert not resolve_wgrad_fusion(model, on_gpu=False, megatron_optimizer=False)
    assert not resolve_wgrad_fusion(model, on_gpu=True, megatron_optimizer=False)  # train.optimizer=adamw
    assert not resolve_wgrad_fusion({**model, "gradient_accumulation_fusion": False}, True, True)
    for overrides, gpus in ((["model.gradient_accumulation_fusion=true"], 0),
                            (["model.gradient_accumulation_fusion=true", "train.optimizer=adamw"], 1)):
        with pytest.raises(ConfigError) as err:
            validate(compose("size=tiny", *overrides), num_gpus=gpus)
        assert "model.gradient_accumulation_fusion" in str(err.value) and "null" in str(err.value)
    validate(compose("size=tiny", "model.gradient_accumulation_fusion=true"), num_gpus=1)


def test_a_stored_config_without_the_field_reads_as_unfused():
    """Results measured before the option ran without it: they read as false, not as today's auto."""
    from recipes.config import upgrade

    stored = compose("size=tiny")
    del stored["model"]["gradient_accumulation_fusion"]
    assert upgrade(stored)["model"]["gradient_accumulation_fusion"] is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: megatron's fp32 main_grad buffers")
def test_fused_gradients_match_the_unfused_step_on_a_gpu(megatron_world):
    """One step's accumulated gradients (4 micro-batches) with and without the fusion: the same within
    bf16 rounding of the unfused path's per-micro-batch weight gradients."""
    def main_grads(fusion: str) -> dict[str, torch.Tensor]:
        cfg = compose("size=tiny", "train.precision=bf16", "train.global_batch_size=8",
                      f"model.gradient_accumulation_fusion={fusion}")
        trainer = build_trainer(cfg)
        try:
            assert trainer.config.gradient_accumulation_fusion == (fusion == "true")
            trainer.compute_gradients()
            return {n: p.main_grad.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()}
        finally:
            trainer.close()

    fused, unfused = main_grads("true"), main_grads("false")
    linear = [n for n in fused if "linear" in n and n.endswith("weight")]
    assert linear
    for name in fused:
        torch.testing.assert_close(fused[name], unfused[name], rtol=2e-2, atol=1e-4)
