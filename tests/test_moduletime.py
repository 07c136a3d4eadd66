"""Module times (``measure.module_times``): each layer's modules timed in one more forward and
backward, and the recompute labels priced from them (``recipes.predict.cost.measured_replay_s``)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_trainer, compose, train_in_process

from recipes.measure.moduletime import time_modules
from recipes.predict.cost import measured_replay_s, recompute_s

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
    from recipes.run.window import prices_others, times_modules
    from recipes.validate import validate

    assert prices_others(compose(*TINY)) and prices_others(compose(*TINY, "recompute=control"))  # the timeline
    assert not any(prices_others(compose(*TINY, o)) for o in ("recompute=full", "recompute=selective/mlp",
                                                               "offload=core_attn"))
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
    moe = measured_replay_s(compose("model=moe", "size=h200", "recompute=selective/moe",
                                    "model.moe_shared_expert_intermediate_size=128"),  # the layers it covers
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
    from recipes.predict.cost import layer_forward_s
    from recipes.predict.estimate import predict

    cfg = compose("size=h200", "offload=core_attn")
    p = predict(cfg, "cuda")
    assert layer_forward_s(cfg, 400.0, _times([1, 2], layer=6.0)) == pytest.approx(6e-3)
    assert layer_forward_s(cfg, 400.0, _times([1, 2], mlp=6.0)) == pytest.approx(layer_forward_s(cfg, 400.0))
    fast, slow = (price(cfg, p, 400.0, 2.0, 0, _times(list(range(1, 9)), layer=ms)) for ms in (0.5, 50.0))
    assert fast["offload_stall_s"] > slow["offload_stall_s"] >= 0.0
    assert fast["offload_copy_s"] == slow["offload_copy_s"] > 0


def test_the_passes_run_with_pythons_collector_off_and_give_it_back(megatron_world):
    """A full collection inside a pass would read as the host's pace (310 ms in one MoE host pass on an
    H200): every pass runs with the collector off, and it is on again after, as it was."""
    import gc

    from recipes.measure.moduletime import transformer_layers

    trainer = build_trainer(compose(*TINY, "recompute=none"))
    seen: list[bool] = []
    handle = transformer_layers(trainer.chunks)[0].register_forward_pre_hook(lambda *_: seen.append(gc.isenabled()))
    try:
        assert gc.isenabled()
        time_modules(trainer)
        assert seen and not any(seen) and gc.isenabled()
        gc.disable()  # a run with train.manual_gc keeps it off: the passes leave it so
        time_modules(trainer)
        assert not gc.isenabled()
    finally:
        gc.enable()
        handle.remove()
        trainer.close()


def test_the_timeline_marks_each_modules_forward_and_backward_in_the_hosts_order(megatron_world):
    """``marks`` (recorded on a GPU; here on a CPU's wall clock): every timed module's forward start and
    end in forward order, its backward start once backward reaches it, later layers' first, on a clock
    that only moves forward. A recompute's replays make no marks, and a checkpointed module (its forward
    ran without autograd) has no backward of its own."""
    from recipes.measure.moduletime import ModuleTimer, _pass

    timelines = {}
    for option in ("none", "selective/core_attn"):
        trainer = build_trainer(compose(*TINY, f"recompute={option}"))
        try:
            counted = ModuleTimer(trainer.chunks, cuda=False)
            _pass(trainer, counted)
            timer = ModuleTimer(trainer.chunks, cuda=False, marks="host")
            _pass(trainer, timer)
            timelines[option] = [m[0] for m in timer.marks], [m[1] for m in timer.marks], counted.summary(1)
        finally:
            trainer.close()
    names, host, summary = timelines["none"]
    assert names[0] == "start" and all(b >= a for a, b in zip(host, host[1:]))
    for layer in (1, 2):
        for module in ("", "self_attention", "self_attention.core_attention", "mlp", "mlp.linear_fc1"):
            pre, end, bwd = (names.index(f"{layer}:{module}:{k}") for k in ("pre", "end", "bwd"))
            assert pre < end < bwd and names.count(f"{layer}:{module}:pre") == 1, (layer, module)
    assert names.index("2::bwd") < names.index("1::bwd") < names.index("1:mlp:bwd") and \
        names.index("2:mlp:bwd") < names.index("2:self_attention:bwd")
    assert names[-1] == "input:bwd" and len(names) == 2 + 3 * len(summary["forward_ms"]) * 2  # backward's end
    recomputed, _, summary = timelines["selective/core_attn"]
    assert summary["replay_ms"]["self_attention.core_attention"]  # replayed, and not marked:
    assert recomputed.count("1:self_attention.core_attention:pre") == 1
    assert "1:self_attention.core_attention:bwd" not in recomputed


def _marks(host: list[float], gpu: list[float]) -> dict:
    """A synthetic timeline: the host's clock at each mark, the GPU's work (ms) up to each."""
    return {"names": [f"m{j}" for j in range(len(host))], "host_ms": host,
            "gpu_ms": [0.0] + [b - a for a, b in zip(gpu, gpu[1:])]}


def test_inserted_work_costs_its_gpu_time_where_the_host_is_ahead_and_its_host_time_where_it_is_not():
    """Timeline.finish: work inserted where the host leads the GPU by more than its host time costs the
    step its GPU time; where the GPU waits for the host, its host time; a lead between pays the host
    time beyond it. An interval the GPU may have waited inside reads the clean one between the same marks
    of another micro-batch."""
    from recipes.predict.replay import Timeline

    # the host issues 10 marks 1 ms apart; the GPU needs 3 ms between marks: it trails by more and more
    ahead = Timeline.of(_marks([float(j) for j in range(11)], [3.0 * j for j in range(11)]))
    assert ahead.finish() == pytest.approx(30.0)
    assert ahead.finish({5: (4.0, 2.0)}) - ahead.finish() == pytest.approx(2.0)
    # the host needs 3 ms between marks, the GPU 1: every mark waits for the host
    behind = Timeline.of(_marks([3.0 * j for j in range(11)], [float(j) for j in range(11)]))
    assert behind.finish({5: (4.0, 2.0)}) - behind.finish() == pytest.approx(4.0)
    # host-bound to mark 5, then the GPU needs 2 ms a mark: it trails the host by 1, 2, 3 ms at marks 6-8
    mixed = Timeline.of(_marks([0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5.0, 7, 9, 11]))
    assert mixed.finish() == pytest.approx(11.0)
    # 4 ms of host work after mark 6: the GPU, 2 ms ahead of the host by mark 7, waits the other 2
    assert mixed.finish({6: (4.0, 0.0)}) - mixed.finish() == pytest.approx(2.0)
    assert mixed.finish({6: (4.0, 3.0)}) - mixed.finish() == pytest.approx(3.0)  # its GPU time is more
    assert Timeline.of({**_marks([0.0, 1.0], [0.0, 1.0]), "gpu_ms": []}) is None  # no GPU pass
    twice = {"names": ["start", "a", "b", "a", "b"], "host_ms": [0.0, 1, 2, 3, 4], "gpu_ms": [0.0, 1, 2, 1, 9],
             "gpu_clean": [True, True, True, True, False]}
    assert Timeline.of(twice).work == [0.0, 1, 2, 1, 2]


def _layer_marks(layers: list[int], host_step: float, gpu_step: float, microbatches: int = 1) -> dict:
    """A synthetic pass: each layer's forward (layer, its MLP) then backward in reverse, the host
    ``host_step`` ms and the GPU ``gpu_step`` ms between consecutive marks."""
    names = ["start"]
    for _ in range(microbatches):
        names += [f"{n}:{m}:{k}" for n in layers for m, k in (("", "pre"), ("mlp", "pre"), ("mlp", "end"), ("", "end"))]
        names += [f"{n}:{m}:bwd" for n in reversed(layers) for m in ("", "mlp")]
    return {"names": names, "host_ms": [host_step * j for j in range(len(names))],
            "gpu_ms": [0.0] + [gpu_step] * (len(names) - 1), "gpu_clean": [True] * len(names)}


def test_a_replay_costs_its_gpu_time_on_a_gpu_bound_timeline_and_its_host_time_on_a_host_bound_one():
    """timeline_recompute_costs: MoE's whole-layer label replays each MoE layer's forward where its
    backward begins. With the host far ahead it costs the forwards' GPU time; with the GPU waiting on
    the host, their host time and the checkpoint region's (``estimate.replay_region_ms``); a point run
    in several processes, the median of theirs; a label with no place on the timeline, no price (the
    module times' then)."""
    from recipes.predict.cost import timeline_recompute_costs

    cfg = compose("model=moe", "size=h200", "recompute=selective/moe", "model.num_layers=2")
    region = cfg["estimate"]["replay_region_ms"]

    def cost(marks) -> float:
        costs = timeline_recompute_costs(cfg, {"layers": [1, 2], "marks": marks})
        return costs[len(costs) // 2] * 1e3  # the median process's, as the planner prices it

    assert cost(_layer_marks([1, 2], 0.01, 1.0)) == pytest.approx(2 * 1.0)  # an MLP forward: 1 GPU ms
    assert cost(_layer_marks([1, 2], 1.0, 0.01)) == pytest.approx(2 * (1.0 + region))  # 1 host ms
    assert cost(_layer_marks([1, 2], 0.01, 1.0, microbatches=2)) == pytest.approx(4 * 1.0)
    runs = [_layer_marks([1, 2], 0.01, gpu) for gpu in (1.0, 3.0, 2.0)]
    assert cost(runs) == pytest.approx(2 * 2.0)
    # the planner also shows how far apart the processes price it (their host pace differs)
    from recipes.analyze.plan import describe, price
    from recipes.predict.estimate import predict

    row = {"recompute": "selective/moe", "offload": "none", "predicted_peak_gib": 1.0,
           **price(cfg, predict(cfg, "cuda"), 400.0, 50.0, 0, {"layers": [1, 2], "marks": runs})}
    assert row["recompute_spread_s"] == pytest.approx((2e-3, 6e-3)) and "4.0 ms, 2.0-6.0 by process" in describe(row)
    one = price(cfg, predict(cfg, "cuda"), 400.0, 50.0, 0, {"layers": [1, 2], "marks": runs[0]})
    assert "recompute_spread_s" not in one
    full = compose("model=moe", "size=h200", "recompute=full", "recompute.recompute_num_layers=1",
                   "model.num_layers=2")
    # a layer's forward is three intervals of the pass: 3 GPU ms each layer
    assert timeline_recompute_costs(full, {"layers": [1, 2], "marks": runs[0]}) == pytest.approx([2 * 3e-3])
    gdn = compose("model=gdn", "size=h200", "recompute=selective/gdn_norm_out")
    assert timeline_recompute_costs(gdn, {"layers": [1, 2], "marks": runs[0]}) is None
    assert timeline_recompute_costs(cfg, {"layers": [1, 2], "marks": {"error": "OutOfMemoryError"}}) is None


def test_the_hosts_wait_at_the_steps_sync_caps_what_the_timeline_hides():
    """Timeline.added: host work inserted where the host leads the GPU moves the last mark nothing, but
    the host issues all of it before the step's grad-norm read returns, where the measured steps' host
    was only ``step_host_wait_ms`` ahead: what exceeds that wait costs the step. A point that did not
    record the wait (before 2026-12-05) is priced on the timeline alone, as before."""
    from recipes.predict.replay import Timeline

    marks = {"names": ["1::pre", "1::end", "1::bwd"], "host_ms": [0.0, 1.0, 2.0], "gpu_ms": [0.0, 10.0, 10.0],
             "gpu_clean": [True] * 3}
    five = {0: (5.0, 0.0)}  # 5 host ms where the host is 9 ms ahead of the GPU
    assert Timeline.of(marks).added(five) == pytest.approx(0.0)
    assert Timeline.of({**marks, "step_host_wait_ms": 3.0}).added(five) == pytest.approx(2.0)
    from recipes.measure.moduletime import note_host_wait  # how a run puts its steps' wait there

    noted, failed = {"marks": dict(marks)}, {"marks": {"error": "OutOfMemoryError"}}
    note_host_wait(noted, 3.0), note_host_wait(failed, 3.0), note_host_wait(None, 3.0)
    assert Timeline.of(noted["marks"]).added(five) == pytest.approx(2.0) and "step_host_wait_ms" not in failed["marks"]
    assert Timeline.of({**marks, "step_host_wait_ms": 30.0}).added(five) == pytest.approx(0.0)
    # GPU work inserted is the timeline's, whatever the wait; a saving of host time is no cost
    assert Timeline.of({**marks, "step_host_wait_ms": 0.0}).added({0: (0.0, 4.0)}) == pytest.approx(4.0)
    assert Timeline.of({**marks, "step_host_wait_ms": 0.0}).added({0: (-1.0, 0.0)}) == pytest.approx(0.0)
    # the offload manager's host work, priced on such a timeline: its whole host time beyond the wait
    from recipes.predict.copies import timeline_offload_costs

    layer = {"names": ["1:self_attention.core_attention:pre", "1:self_attention.core_attention:end",
                       "1:self_attention.core_attention:bwd"], "offload_ms": {"group": 1.0, "tensor": 0.5}}
    ahead = {**marks, **layer}
    assert timeline_offload_costs([{"core_attn": 2}], {"layers": [1], "marks": ahead}) == pytest.approx([0.0])
    waited = {**ahead, "step_host_wait_ms": 0.5}
    assert timeline_offload_costs([{"core_attn": 2}], {"layers": [1], "marks": waited}) == pytest.approx([1.5e-3])


def test_a_forward_only_pass_draws_the_steps_micro_batches_and_leaves_no_gradient(megatron_world):
    """Trainer.forward_only, the no-grad pass the timeline times: every micro-batch of a step forward,
    under no_grad, in training mode; nothing for backward."""
    from recipes.measure.moduletime import transformer_layers

    trainer = build_trainer(compose("model=moe", "size=tiny", "recompute=none"))
    grad_enabled = []
    layer = transformer_layers(trainer.chunks)[0]
    handle = layer.register_forward_hook(lambda m, a, o: grad_enabled.append((torch.is_grad_enabled(), m.training)))
    try:
        drawn = trainer.data.drawn
        trainer.forward_only()
        assert trainer.data.drawn == drawn + trainer.num_microbatches
        assert grad_enabled == [(False, True)] * trainer.num_microbatches
        assert all(p.grad is None for c in trainer.chunks for p in c.parameters())
    finally:
        handle.remove()
        trainer.close()


def _nograd_marks(marks: dict, layers: list[int], mlp_ms: float, gap_ms: float, microbatches: int = 1) -> dict:
    """``marks`` with a forward-only pass under no_grad: each MLP forward ``mlp_ms`` of host, the
    layer's forward ``gap_ms`` more either side of it."""
    names, host, t = ["start"], [0.0], 0.0
    for _ in range(microbatches):
        for n in layers:
            for name, step in ((f"{n}::pre", gap_ms), (f"{n}:mlp:pre", gap_ms), (f"{n}:mlp:end", mlp_ms),
                               (f"{n}::end", gap_ms)):
                t += step
                names.append(name)
                host.append(t)
    return {**marks, "nograd_names": names, "nograd_host_ms": host}


def test_a_checkpoints_first_forward_saves_the_host_what_no_grad_saves_it_where_the_host_is_behind():
    """megatron runs a checkpoint's first forward under no_grad: no autograd graph, no MoE aux loss. Where
    the pass recorded a no-grad forward, the replayed modules' forward costs its host time there, not
    the training pass's: on a host-bound timeline the price falls by the difference; on a GPU-bound one
    it does not move; a point recorded without it is priced as before."""
    from recipes.predict.cost import timeline_recompute_costs
    from recipes.predict.replay import Timeline

    moe = compose("model=moe", "size=h200", "recompute=selective/moe", "model.num_layers=2")
    full = compose("model=moe", "size=h200", "recompute=full", "recompute.recompute_num_layers=1",
                   "model.num_layers=2")
    region = moe["estimate"]["replay_region_ms"]
    host_bound = _layer_marks([1, 2], 1.0, 0.01)  # an MLP forward: 1 host ms; a layer's: 3
    lighter = _nograd_marks(host_bound, [1, 2], mlp_ms=0.4, gap_ms=0.5)  # no grad: 0.4 and 1.4
    assert Timeline.of(lighter).forward_nograd(2, "mlp") == pytest.approx([0.4])
    assert Timeline.of(lighter).forward_nograd(1, "") == pytest.approx([1.4])

    def cost(cfg, marks) -> float:
        return timeline_recompute_costs(cfg, {"layers": [1, 2], "marks": marks})[0] * 1e3

    assert cost(moe, host_bound) == pytest.approx(2 * (1.0 + region))
    assert cost(moe, lighter) == pytest.approx(2 * (1.0 + region) - 2 * 0.6)
    assert cost(full, lighter) == pytest.approx(2 * (3.0 + region) - 2 * 1.6)
    gpu_bound = _layer_marks([1, 2], 0.5, 1.0)
    assert cost(moe, _nograd_marks(gpu_bound, [1, 2], mlp_ms=0.1, gap_ms=0.2)) == pytest.approx(cost(moe, gpu_bound))
    # a no-grad forward slower than the training one (a stall) saves nothing, and costs nothing
    assert cost(moe, _nograd_marks(host_bound, [1, 2], mlp_ms=5.0, gap_ms=0.5)) == pytest.approx(cost(moe, host_bound))


def _region_marks(layers: list[int], regions: dict | None) -> dict:
    """A host-bound synthetic pass (1 host ms and 0.01 GPU ms between marks) with each layer's norms,
    attention and experts marked, and with ``regions`` the pass's region measurements."""
    forward = [("", "pre"), ("input_layernorm", "pre"), ("input_layernorm", "end"), ("self_attention", "pre"),
               ("self_attention", "end"), ("pre_mlp_layernorm", "pre"), ("pre_mlp_layernorm", "end"), ("mlp", "pre"),
               ("mlp.experts", "pre"), ("mlp.experts", "end"), ("mlp", "end"), ("", "end")]
    backward = [("", "bwd"), ("mlp", "bwd"), ("mlp.experts", "bwd"), ("self_attention", "bwd")]
    names = ["start"] + [f"{n}:{m}:{k}" for n in layers for m, k in forward]
    names += [f"{n}:{m}:{k}" for n in reversed(layers) for m, k in backward]
    marks = {"names": names, "host_ms": [1.0 * j for j in range(len(names))],
             "gpu_ms": [0.0] + [0.01] * (len(names) - 1), "gpu_clean": [True] * len(names)}
    return {**marks, **regions} if regions else marks


def test_a_region_costs_the_host_what_the_pass_measured_for_its_kind_and_its_function():
    """Where the pass measured regions (recipes.measure.regions), a host-bound replay costs each region
    its kind's measured machinery plus its function: moe_act the experts' activation as timed, a norm
    its forward on the timeline; a module replay the region of its kind (tensor_parallel.checkpoint for
    the whole MoE layer) plus the modules' forward. Without them, estimate.replay_region_ms and the
    kernels at estimate.launch_us, as before."""
    from recipes.predict.cost import activation_kernels, timeline_recompute_costs

    regions = {"region_ms": {"without_output": 0.3, "checkpoint": 0.2}, "region_function_ms": {"moe_act": 0.25}}

    def cost(option: str, marks: dict) -> float:
        cfg = compose("model=moe", "size=h200", f"recompute={option}", "model.num_layers=2")
        return timeline_recompute_costs(cfg, {"layers": [1, 2], "marks": marks})[0] * 1e3

    measured = _region_marks([1, 2], regions)
    assert cost("selective/moe_act", measured) == pytest.approx(2 * (0.3 + 0.25))
    assert cost("selective/layernorm", measured) == pytest.approx(2 * 2 * (0.3 + 1.0))  # a norm: 1 host ms
    assert cost("selective/moe", measured) == pytest.approx(2 * (0.2 + 3.0))  # the MoE layer: 3 host ms
    cfg = compose("model=moe", "size=h200", "recompute=selective/moe_act")
    est, act = cfg["estimate"], activation_kernels(cfg["model"])
    # a kind the pass could not measure (megatron's extension not built yet) takes the setting
    partial = _region_marks([1, 2], {**regions, "region_ms": {"checkpoint": 0.2}})
    assert cost("selective/moe_act", partial) == pytest.approx(2 * (est["replay_region_ms"] + 0.25))
    before = _region_marks([1, 2], None)
    assert cost("selective/moe_act", before) == pytest.approx(
        2 * (est["replay_region_ms"] + act * est["launch_us"] / 1e3))
    assert cost("selective/moe", before) == pytest.approx(2 * (est["replay_region_ms"] + 3.0))


def test_a_regions_forward_machinery_costs_the_step_where_the_forward_is_host_bound():
    """A region's forward part (recipes.measure.regions.region_forward_host_ms: the RNG states, the
    first call under no_grad, the output freed) runs where its module's forward does. On a timeline
    whose forward is host-bound and whose backward the GPU bounds by far (a dense step's first
    micro-batch), the backward's part is hidden and the forward's is step time: each region costs its
    forward part. Where the whole step is host-bound the split moves nothing; a pass without the
    forward part prices the whole region at the replay, as before."""
    from recipes.predict.cost import timeline_recompute_costs

    regions = {"region_ms": {"without_output": 0.3, "checkpoint": 0.2}, "region_function_ms": {"moe_act": 0.25}}
    split = {**regions, "region_forward_ms": {"without_output": 0.1, "checkpoint": 0.05}}

    def cost(option: str, marks: dict) -> float:
        cfg = compose("model=moe", "size=h200", f"recompute={option}", "model.num_layers=2")
        return timeline_recompute_costs(cfg, {"layers": [1, 2], "marks": marks})[0] * 1e3

    def gpu_bound_backward(marks: dict) -> dict:
        work = [10.0 if name.endswith(":bwd") else w for name, w in zip(marks["names"], marks["gpu_ms"])]
        return {**marks, "gpu_ms": work}

    ahead = gpu_bound_backward(_region_marks([1, 2], split))
    assert cost("selective/layernorm", gpu_bound_backward(_region_marks([1, 2], regions))) == pytest.approx(0.0)
    assert cost("selective/layernorm", ahead) == pytest.approx(2 * 2 * 0.1)  # two norms a layer
    assert cost("selective/moe_act", ahead) == pytest.approx(2 * 0.1)
    assert cost("selective/moe", ahead) == pytest.approx(2 * (0.05 + 0.03))  # and the MoE layer's GPU work
    # all host-bound: the region costs the same wherever its parts run
    assert cost("selective/layernorm", _region_marks([1, 2], split)) == pytest.approx(2 * 2 * (0.3 + 1.0))
    # a forward part above the whole (noise) is capped at the whole
    over = {**regions, "region_forward_ms": {"without_output": 0.5}}
    assert cost("selective/layernorm", gpu_bound_backward(_region_marks([1, 2], over))) == pytest.approx(2 * 2 * 0.3)


def test_offload_groups_cost_the_host_what_the_pass_measured_where_the_host_does_not_lead():
    """timeline_offload_costs: each moved group's measured host cost (a group's plus a tensor's each)
    is inserted half at its module's forward end and half at its backward start, every micro-batch: on
    a host-bound timeline it is all step time, on one where the host leads the GPU by more, none; a
    point whose pass did not measure it has no such price. ``price`` adds it to the copies' fitted
    rates (what a step that hides it pays)."""
    from recipes.analyze.plan import price
    from recipes.predict.copies import timeline_offload_costs
    from recipes.predict.estimate import predict

    measured = {"offload_ms": {"group": 0.4, "tensor": 0.1}}
    tensors = [{"moe_act": 3, "expert_fc1": 1}, {}]  # layer 1 moves two groups, layer 2 (kept) none
    bound = _region_marks([1, 2], measured)
    cost = timeline_offload_costs(tensors, {"layers": [1, 2], "marks": bound})
    assert cost == [pytest.approx(((0.4 + 3 * 0.1) + (0.4 + 0.1)) / 1e3)]
    ahead = {**bound, "host_ms": [0.001 * j for j in range(len(bound["names"]))], "gpu_ms": [0.0] + [1.0] * (
        len(bound["names"]) - 1)}
    assert timeline_offload_costs(tensors, {"layers": [1, 2], "marks": ahead}) == [pytest.approx(0.0)]
    assert timeline_offload_costs(tensors, {"layers": [1, 2], "marks": _region_marks([1, 2], None)}) is None
    # a module the pass did not mark (this one has no norm backward marks): no price
    assert timeline_offload_costs([{"attn_norm": 1}, {}], {"layers": [1, 2], "marks": bound}) is None

    cfg = compose("model=moe", "size=h200", "offload=moe_act", "model.num_layers=2")
    p = predict(cfg, "cuda")
    moved = p["host_terms_per_layer"]
    assert moved[0] == {"moe_act": 1} and moved[1] == {}  # the manager keeps the last layer's group
    with_host = price(cfg, p, 400.0, 50.0, module_times={"layers": [1, 2], "marks": bound})
    without = price(cfg, p, 400.0, 50.0, module_times={"layers": [1, 2], "marks": _region_marks([1, 2], None)})
    assert with_host["offload_host_s"] == pytest.approx((0.4 + 0.1) / 1e3)  # the synthetic pass: 1 micro-batch
    assert "offload_host_s" not in without
    assert with_host["offload_overhead_s"] == pytest.approx(without["offload_overhead_s"] + with_host["offload_host_s"])
    assert with_host["cost_s"] == pytest.approx(without["cost_s"] + with_host["offload_host_s"])


def test_the_gpu_pass_is_read_at_the_pace_the_stream_pass_measured_for_its_gpu_bound_kernels():
    """stream_pace: the module-time pass's stream time over the GPU pass's time for the same forwards,
    where the host was far ahead (the GPU pass's sleeps let the same kernels run about a tenth faster
    on an H200); forwards the host was slow to issue do not count, and the ratio is kept within
    PACE_RANGE. A replay is then priced at that pace: a GPU-bound MoE replay costs its GPU time 1.2x."""
    from recipes.predict.cost import timeline_recompute_costs
    from recipes.predict.replay import PACE_RANGE, Timeline, stream_pace

    names = ["start", "1:mlp.experts:pre", "1:mlp.experts:end", "2:mlp.experts:pre", "2:mlp.experts:end"]
    marks = {"names": names, "host_ms": [0.0, 0.1, 0.2, 0.3, 0.4], "gpu_ms": [0.0, 0.5, 2.0, 0.5, 2.0]}
    timeline = Timeline.of(marks)
    assert stream_pace(timeline, {"mlp.experts": [2.2, 2.4]}, [1, 2]) == pytest.approx(1.15)
    host_bound = Timeline.of({**marks, "host_ms": [0.0, 0.1, 1.5, 1.6, 3.0]})  # 1.4 host ms a 2 GPU ms forward
    assert stream_pace(host_bound, {"mlp.experts": [2.2, 2.4]}, [1, 2]) is None
    assert stream_pace(timeline, {"mlp.experts": [6.0, 6.0]}, [1, 2]) == PACE_RANGE[1]
    assert stream_pace(timeline, {}, [1, 2]) is None

    layer = [("", "pre"), ("mlp", "pre"), ("mlp.experts", "pre"), ("mlp.experts", "end"), ("mlp", "end"), ("", "end")]
    names = ["start"] + [f"{n}:{m}:{k}" for n in (1, 2) for m, k in layer] + [f"{n}:{m}:bwd" for n in (2, 1) for m in ("", "mlp")]
    gpu_bound = {"names": names, "host_ms": [0.01 * j for j in range(len(names))],
                 "gpu_ms": [0.0] + [1.0] * (len(names) - 1)}
    cfg = compose("model=moe", "size=h200", "recompute=selective/moe", "model.num_layers=2")
    plain = timeline_recompute_costs(cfg, {"layers": [1, 2], "marks": gpu_bound})
    paced = timeline_recompute_costs(cfg, {"layers": [1, 2], "marks": gpu_bound,
                                           "forward_ms": {"mlp.experts": [1.2, 1.2]}})
    assert plain == pytest.approx([2 * 3e-3]) and paced == pytest.approx([2 * 3e-3 * 1.2])
    # a process whose forwards the host issued too slowly to tell (0.6 host ms a 1 GPU ms interval) has
    # no pace of its own: it is read at its point's other processes'
    slower = {**gpu_bound, "host_ms": [0.6 * j for j in range(len(names))]}
    assert stream_pace(Timeline.of(slower), {"mlp.experts": [1.2, 1.2]}, [1, 2]) is None
    at_pace = {**slower, "gpu_ms": [w * 1.2 for w in slower["gpu_ms"]]}
    mixed = timeline_recompute_costs(cfg, {"layers": [1, 2], "marks": [gpu_bound, slower],
                                           "forward_ms": {"mlp.experts": [1.2, 1.2]}})
    expected = timeline_recompute_costs(cfg, {"layers": [1, 2], "marks": [at_pace]})[0]
    assert mixed == pytest.approx(sorted([2 * 3e-3 * 1.2, expected]))
    assert timeline_recompute_costs(cfg, {"layers": [1, 2], "marks": [slower]})[0] != pytest.approx(expected)


def test_recompute_s_prices_on_the_timeline_where_the_point_recorded_one():
    """The timeline's price replaces the module times' and the FLOPs' for the whole option; without
    one (older points, a failed pass) the module times price it as before."""
    cfg = compose("model=moe", "size=h200", "recompute=selective/moe", "model.num_layers=2")
    times = {**_times([1, 2], mlp=7.0), "microbatches": 1}
    assert recompute_s(cfg, 400.0, 2, 1, 0, 3000.0, times) == pytest.approx(2 * 7e-3)
    timed = {**times, "marks": _layer_marks([1, 2], 0.01, 1.0)}
    assert recompute_s(cfg, 400.0, 2, 1, 0, 3000.0, timed) == pytest.approx(2 * 1e-3)
    failed = {**times, "marks": {"error": "OutOfMemoryError: CUDA out of memory"}}
    assert recompute_s(cfg, 400.0, 2, 1, 0, 3000.0, failed) == pytest.approx(2 * 7e-3)


def test_a_host_cost_measurement_notes_what_it_took_and_a_failed_one_gives_none():
    """The pass's host-cost measurements (recipes.measure.regions) note the seconds each took, kept in
    the marks as host_cost_s; one that fails leaves None, and its time is noted too."""
    import time

    from recipes.measure.moduletime import _host_cost

    def slow(device):
        time.sleep(0.05)
        return {"group": 0.4}

    def broken(device):
        raise RuntimeError("no copy streams")

    spent = {}
    assert _host_cost(slow, spent, "offload") == {"group": 0.4} and _host_cost(broken, spent, "region") is None
    assert 0.05 <= spent["offload"] < 5.0 and spent["region"] >= 0.0  # no wall-clock ceiling on a loaded machine


def test_a_repeated_point_keeps_every_processs_timeline():
    """merge_module_times: module times merge to medians, timelines do not merge (each is priced, then
    the median taken), so the merged point keeps them all."""
    from recipes.analyze.sweep import merge_module_times

    runs = [{**_times([1, 2], mlp=ms), "marks": _layer_marks([1, 2], 0.01, ms)} for ms in (1.0, 3.0, 2.0)]
    merged = merge_module_times(runs)
    assert merged["forward_ms"]["mlp"] == [2.0, 2.0] and [m["gpu_ms"][1] for m in merged["marks"]] == [1.0, 3.0, 2.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: CUDA events and torch.cuda._sleep")
def test_on_a_gpu_the_timeline_replays_to_the_pass_it_was_measured_in(megatron_world):
    """On a GPU the GPU pass's intervals are clean (the sleep at each mark kept the host ahead), both
    passes mark the same points, and the timeline reproduces the host pass's duration less the work
    after the last mark (the loss and the gradient reduction, which the timeline does not see): at the
    tiny size a pass is about 20 ms, and on one H200 (2026-12-04, ten passes in one process) the
    timeline came to 0.77-0.93 of it, and 0.70 once in a fresh process. It must not come out longer."""
    from recipes.predict.replay import Timeline

    trainer = build_trainer(compose("model=moe", "size=tiny", "profile=none", "train.train_iters=3",
                                    "measure.start_step=2", "recompute=none"))
    try:
        trainer.compute_gradients()  # as in a run, the pass comes after steps: kernels loaded, fusions traced
        time_modules(trainer)  # and once more: the passes' own first calls (see the docstring)
        marks = time_modules(trainer)["marks"]
    finally:
        trainer.close()
    assert "error" not in marks and 0.0 <= marks["mark_cost_ms"] <= 0.1
    unclean = [name for name, clean in zip(marks["names"], marks["gpu_clean"]) if not clean]
    assert len(unclean) <= len(marks["names"]) // 50, unclean
    timeline = Timeline.of(marks)
    assert 0.6 * marks["pass_ms"] <= timeline.finish() <= 1.05 * marks["pass_ms"]
    assert all(g > 0 for _, g in timeline.forward(1, "mlp")) and timeline.where(1, "mlp", "bwd")
    # the no-grad forward: every layer's MoE layer, a forward a micro-batch, less host than with grad
    # (no autograd graph, no aux loss)
    nograd = [timeline.forward_nograd(n, "mlp") for n in (1, 2)]
    assert all(len(f) == trainer.num_microbatches for f in nograd), nograd
    assert sum(map(sum, nograd)) < sum(h for n in (1, 2) for h, _ in timeline.forward(n, "mlp"))
    # the host cost of each kind of checkpoint region (CheckpointWithoutOutput's only where megatron's
    # extension is built: this point recomputes nothing), and moe_act's function (the experts' activation)
    from recipes.validate.share_storage import share_storage_built

    kinds = {"checkpoint"} | ({"without_output"} if share_storage_built() is not False else set())
    assert set(marks["region_ms"]) == kinds
    assert all(0.0 < ms < 5.0 for ms in marks["region_ms"].values()), marks["region_ms"]
    assert set(marks["region_forward_ms"]) == kinds
    assert all(0.0 <= ms < 5.0 for ms in marks["region_forward_ms"].values()), marks["region_forward_ms"]
    # what an offload group costs the host through megatron's manager (this point offloads nothing)
    assert 0.0 < marks["offload_ms"]["group"] < 5.0 and 0.0 <= marks["offload_ms"]["tensor"] < 1.0, marks["offload_ms"]
    # what the two measurements added to the pass, in seconds
    assert set(marks["host_cost_s"]) == {"region", "region_forward", "offload"} and all(0.0 < s < 60 for s in marks["host_cost_s"].values())
    assert 0.0 < marks["region_function_ms"]["moe_act"] < 5.0
