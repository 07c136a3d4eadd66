"""Module times (``measure.module_times``): each layer's modules timed in one more forward and
backward, and the recompute labels priced from them (``recipes.predict.offload.measured_replay_s``)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_trainer, compose, train_in_process

from recipes.measure.moduletime import time_modules
from recipes.predict.offload import measured_replay_s, recompute_s

TINY = ("size=tiny", "attention=unfused", "profile=none", "train.train_iters=3", "measure.start_step=2")


def test_a_run_times_each_layers_modules_and_tells_replays_apart(megatron_world):
    """On a CPU (wall clock) with ``measure.module_times=true``: every layer's modules have a forward
    time, core attention's replay (selective/core_attn) is recorded apart, once a layer, and nothing
    else was replayed."""
    rank = train_in_process(compose(*TINY, "recompute=selective/core_attn", "measure.module_times=true"))
    times = rank["module_times"]
    assert times["layers"] == [1, 2] and times["microbatches"] == 1
    fwd, replay = times["forward_ms"], times["replay_ms"]
    for name in ("", "input_layernorm", "self_attention", "self_attention.core_attention",
                 "self_attention.linear_qkv", "mlp", "mlp.linear_fc1", "mlp.linear_fc2"):
        assert len(fwd[name]) == 2 and all(ms > 0 for ms in fwd[name]), name
    assert "mlp.router" not in fwd  # a dense layer has none; names a layer lacks are skipped
    assert all(fwd[""][i] >= fwd["self_attention"][i] + fwd["mlp"][i] for i in range(2))  # nested
    assert set(replay) == {"self_attention.core_attention"} and all(ms > 0 for ms in replay[
        "self_attention.core_attention"])


def test_timing_leaves_no_hooks_no_update_and_no_gradient_for_the_optimizer(megatron_world):
    """The extra pass changes nothing the run goes on with: its hooks are removed, the parameters are
    not updated, and no gradient is left for the optimizer (the next step zeroes megatron's gradient
    buffers first, as every step does)."""
    trainer = build_trainer(compose(*TINY, "recompute=none"))

    def hooks() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for c in trainer.chunks for m in c.modules())

    try:
        before, hooked = {n: p.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()}, hooks()
        times = time_modules(trainer)
        assert times["replay_ms"] == {} and times["forward_ms"]["mlp"]
        assert hooks() == hooked
        for chunk in trainer.chunks:
            for n, p in chunk.named_parameters():
                assert torch.equal(p, before[n]), n
                assert p.grad is None or not p.grad.any(), n
    finally:
        trainer.close()


def test_off_by_default_on_a_cpu_and_refused_under_compile():
    from recipes.errors import ConfigError
    from recipes.run.worker import times_modules
    from recipes.validate import validate

    assert not times_modules(compose(*TINY), on_gpu=False)
    assert times_modules(compose(*TINY), on_gpu=True)
    assert not times_modules(compose(*TINY, "model.compile=layer"), on_gpu=True)  # hooks would break its graph
    with pytest.raises(ConfigError) as err:
        validate(compose(*TINY, "model.compile=layer", "measure.module_times=true"), num_gpus=1)
    assert "measure.module_times" in str(err.value) and "model.compile=none" in str(err.value)


def _times(layers: list[int], **forward_ms: float) -> dict:
    """Synthetic module times: each name's ms, the same in every layer ('_' for '.', 'layer' for '')."""
    names = {k.replace("__", ".").replace("layer", ""): v for k, v in forward_ms.items()}
    return {"layers": layers, "microbatches": 4, "replay_ms": {},
            "forward_ms": {n: [ms] * len(layers) for n, ms in names.items()}}


def test_a_label_replays_the_forward_time_of_its_modules_in_the_layers_it_covers():
    """The dense mlp label replays FC1 and the activation (the MLP less FC2) unless megatron's whole-MLP
    replay is asked for; full/block the first N layers of each model chunk; core attention every
    layer; a label whose modules were not timed is left to the FLOP price."""
    cfg = compose("size=h200", "recompute=selective/mlp")
    times = _times([1, 2, 3, 4, 5, 6, 7, 8], layer=10.0, mlp=4.0, mlp__linear_fc2=1.5,
                   self_attention__core_attention=2.0)
    s = measured_replay_s(cfg, times)
    assert s["mlp"] == pytest.approx(8 * 2.5e-3) and s["full"] == pytest.approx(8 * 10e-3)
    assert s["core_attn"] == pytest.approx(8 * 2e-3) and "shared_experts" not in s and "mla_up_proj" not in s
    megatron = measured_replay_s(compose("size=h200", "recompute=selective/mlp", "recompute.mlp_replays_fc2=true"),
                                 times)
    assert megatron["mlp"] == pytest.approx(8 * 4e-3)
    block = compose("size=h200", "recompute=full/block", "recompute.recompute_num_layers=2")
    # a rank holding two model chunks (virtual pipeline): layers 1-4 and 9-12; two of each replayed
    assert measured_replay_s(block, _times([1, 2, 3, 4, 9, 10, 11, 12], layer=10.0))["full"] == pytest.approx(4 * 10e-3)
    moe = measured_replay_s(compose("model=moe", "size=h200", "recompute=selective/moe"),
                            _times([1, 2], mlp=7.0, mlp__shared_experts=1.0))
    assert moe["moe"] == pytest.approx(2 * 7e-3) and moe["shared_experts"] == pytest.approx(2e-3)
    assert "mlp" not in moe or moe["mlp"] == 0.0  # no dense MLP layer among MoE ones


def test_measured_module_times_replace_the_flop_price_of_the_labels_they_cover():
    """recompute_s: a timed label costs its modules' forward time a micro-batch; the rest of the run's
    labels keep their FLOP, byte and region price."""
    mlp = compose("size=h200", "recompute=selective/mlp")
    times = _times(list(range(1, 9)), layer=10.0, mlp=4.0, mlp__linear_fc2=1.5)
    assert recompute_s(mlp, 400.0, 8, 4, 0, 3000.0, times) == pytest.approx(4 * 8 * 2.5e-3)
    flops = recompute_s(mlp, 400.0, 8, 4, 0, 3000.0)
    assert flops > 0 and flops != pytest.approx(4 * 8 * 2.5e-3)
    full = compose("size=h200", "recompute=full", "recompute.recompute_num_layers=1")
    assert recompute_s(full, 400.0, 8, 4, 0, 3000.0, times) == pytest.approx(4 * 8 * 10e-3)
    untimed = _times(list(range(1, 9)), self_attention__core_attention=2.0)  # no mlp: priced by FLOPs
    assert recompute_s(mlp, 400.0, 8, 4, 0, 3000.0, untimed) == pytest.approx(flops)
    # MLA's up projection is its attention less the modules outside the label's checkpoint; two
    # labels add up, and one untimed label of a pair keeps its FLOP price alongside the timed one
    both = compose("model=mla", "size=h200", "recompute=selective/mla_up_proj-core_attn")
    mla = _times(list(range(1, 9)), self_attention=3.0, self_attention__core_attention=1.0,
                 self_attention__linear_proj=0.5, self_attention__linear_q_proj=0.25,
                 self_attention__linear_kv_down_proj=0.25)
    assert measured_replay_s(both, mla)["mla_up_proj"] == pytest.approx(8 * 1e-3)
    assert recompute_s(both, 400.0, 8, 4, 0, 3000.0, mla) == pytest.approx(4 * 8 * 2e-3)
    only_core = compose("model=mla", "size=h200", "recompute=selective/core_attn")
    up_by_flops = recompute_s(both, 400.0, 8, 4, 0, 3000.0) - recompute_s(only_core, 400.0, 8, 4, 0, 3000.0)
    core_timed = _times(list(range(1, 9)), self_attention__core_attention=1.0)
    assert recompute_s(both, 400.0, 8, 4, 0, 3000.0, core_timed) == pytest.approx(4 * 8 * 1e-3 + up_by_flops)


def test_offload_hides_its_copies_behind_the_measured_layer_forward():
    """Where a point timed its layers, offload's copies are priced against their measured forward (the
    mean of the layers'), not against the FLOPs at the step's rate: a slower measured forward hides
    more of the same copies."""
    from recipes.analyze.plan import price
    from recipes.predict.estimate import predict
    from recipes.predict.offload import layer_forward_s

    cfg = compose("size=h200", "offload=core_attn")
    p = predict(cfg, "cuda")
    assert layer_forward_s(cfg, 400.0, _times([1, 2], layer=6.0)) == pytest.approx(6e-3)
    assert layer_forward_s(cfg, 400.0, _times([1, 2], mlp=6.0)) == pytest.approx(layer_forward_s(cfg, 400.0))
    fast, slow = (price(cfg, p, 400.0, 2.0, 0, _times(list(range(1, 9)), layer=ms)) for ms in (0.5, 50.0))
    assert fast["offload_stall_s"] > slow["offload_stall_s"] >= 0.0
    assert fast["offload_copy_s"] == slow["offload_copy_s"] > 0
