"""Each workaround for a megatron-core 0.19.2 bug has a test here that reproduces the bug on
pristine megatron-core code. When upstream fixes the bug, the test fails: delete the workaround."""

from __future__ import annotations

import inspect

import pytest
import torch

from conftest import compose, gradients


def test_checkpoint_without_output_fp8_default_is_still_true():
    """recipes.upstream.fix_checkpoint_without_output_fp8_default: ``fp8=False`` -> ``self.fp8=True``."""
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

    from recipes import upstream

    upstream.fix_checkpoint_without_output_fp8_default()
    pristine = CheckpointWithoutOutput.__new__(CheckpointWithoutOutput)
    CheckpointWithoutOutput._recipes_original_init(pristine, fp8=False)
    assert pristine.fp8 is True, "upstream fixed the fp8 default: delete the workaround"
    assert CheckpointWithoutOutput(fp8=False).fp8 is False  # the workaround is in force


def test_dot_product_attention_still_rejects_k_channels():
    """recipes.attention exists because megatron's DotProductAttention cannot build MLA (issue 1589)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    params = inspect.signature(DotProductAttention.__init__).parameters
    assert "k_channels" not in params, "upstream accepts k_channels now: MLA may use it directly"


def test_sequential_mlp_still_ignores_moe_act(megatron_world):
    """recipes.experts exists because SequentialMLP accepts moe_act and recomputes nothing."""
    cfg = compose("model=moe", "model.experts=sequential", "recompute=control",
                  "recompute.recompute_modules=[moe_act]")
    _, _, _, counts = gradients(cfg)
    assert "moe_act" not in counts, "upstream SequentialMLP recomputes moe_act now"


def test_schedules_still_allocate_on_cuda():
    """recipes.compat redirects the schedules' token counter (device="cuda") on a CPU."""
    from megatron.core.pipeline_parallel import schedules

    source = inspect.getsource(schedules.forward_backward_no_pipelining)
    assert 'device="cuda"' in source, "schedules no longer hard-code CUDA: drop _TorchOnCpu"


def test_default_causal_mask_still_cuda_only():
    """recipes.attention builds its causal masks on the query's device because megatron's don't."""
    from megatron.core.transformer import utils

    assert 'device="cuda"' in inspect.getsource(utils.get_default_causal_mask)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU compatibility layer is CPU-only")
def test_cpu_compat_is_needed_and_scoped(monkeypatch):
    """The layer patches only without CUDA: pretending CUDA exists makes it a no-op."""
    from recipes import compat

    monkeypatch.setattr(compat, "_INSTALLED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compat.install_cpu_compat() is False
