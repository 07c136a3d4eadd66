"""recipes.measure.regions: a checkpoint region's host cost, measured on regions that really replay."""

import torch
from conftest import build_trainer, compose


def test_region_host_ms_replays_each_kind_of_region(megatron_world, monkeypatch):
    """Each kind's variant ran a real region: megatron's replay ran once per repetition (a hook for
    CheckpointWithoutOutput, the node's backward for tensor_parallel.checkpoint), and the prices are
    host milliseconds, not negative."""
    from megatron.core.tensor_parallel import random as r

    from recipes.build.compat import seed_model_parallel_rng
    from recipes.measure.regions import region_forward_host_ms, region_host_ms

    seed_model_parallel_rng(1234)
    replays = {"without_output": 0, "checkpoint": 0}
    hook, backward = r.CheckpointWithoutOutput._recompute, r.CheckpointFunction.backward

    def counted_hook(self, grad):
        replays["without_output"] += 1
        return hook(self, grad)

    def counted_backward(ctx, *grads):
        replays["checkpoint"] += 1
        return backward(ctx, *grads)

    monkeypatch.setattr(r.CheckpointWithoutOutput, "_recompute", counted_hook)
    monkeypatch.setattr(r.CheckpointFunction, "backward", staticmethod(counted_backward))
    ms = region_host_ms(torch.device("cpu"), repeats=5)
    assert set(ms) == {"without_output", "checkpoint"}
    assert replays == {"without_output": 5 + 3, "checkpoint": 5 + 3}
    assert all(0.0 <= v < 50.0 for v in ms.values())
    # the forward's part: each region still replays (its backward runs, untimed after each forward);
    # on a CPU a forward's machinery is tens of microseconds, within the noise, so only its range is asked
    forward = region_forward_host_ms(torch.device("cpu"), repeats=5)
    assert set(forward) == {"without_output", "checkpoint"}
    assert replays == {"without_output": 2 * (5 + 3), "checkpoint": 2 * (5 + 3)}
    assert all(0.0 <= v < 50.0 for v in forward.values()), forward
    # where CheckpointWithoutOutput would first have to build megatron's C++ extension, that kind is
    # left out (the price falls back to estimate.replay_region_ms for it)
    monkeypatch.setattr("recipes.measure.regions._without_output_ready", lambda device: False)
    assert set(region_host_ms(torch.device("cpu"), repeats=2)) == {"checkpoint"}


def test_function_host_ms_times_the_experts_activation_under_grad_only(megatron_world):
    """moe_act's region function is timed where it runs with grad (the training forward, and a
    replay), once a micro-batch and MoE layer, and not where it runs under no_grad (a checkpoint's
    first forward); outside the block it is megatron's own again."""
    from recipes.build.experts import GroupedExperts
    from recipes.measure.regions import function_host_ms

    plain = GroupedExperts.activation
    trainer = build_trainer(compose("model=moe", "size=tiny", "recompute=none"))
    try:
        with function_host_ms() as calls:
            trainer.compute_gradients()
            trainer.optimizer.zero_grad()
            trainer.forward_only()
        layers, microbatches = trainer.config.num_layers, trainer.num_microbatches
        assert len(calls["moe_act"]) == layers * microbatches
        assert all(t > 0 for t in calls["moe_act"])
        assert GroupedExperts.activation is plain
    finally:
        trainer.close()


def test_region_functions_name_real_labels_and_methods():
    """Every timed function belongs to an elementwise label and exists where it is named: a rename
    upstream or here fails this instead of silently timing nothing."""
    from importlib import import_module

    from recipes.measure.regions import REGION_FUNCTIONS
    from recipes.recompute import LABELS

    for label, (module, cls, method) in REGION_FUNCTIONS.items():
        assert label in LABELS
        assert callable(getattr(getattr(import_module(module), cls), method))


def test_offload_host_ms_moves_groups_through_megatrons_manager(megatron_world, monkeypatch):
    """The synthetic step really offloads: after its warm-up each timed repetition commits
    OFFLOAD_GROUPS groups to the copy stream and reloads them, with 1 and then 4 tensors each; the
    model's own manager is back after; a machine without copy streams gives None."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    from recipes.build.offload import emulate_copy_streams_on_cpu
    from recipes.measure import regions

    emulate_copy_streams_on_cpu()
    tensors = []
    offload = fgo.ChunkOffloadHandler.bulk_offload_group

    def counted(self, group):
        offload(self, group)
        tensors.append(sum(isinstance(s, tuple) for s in group._tensors.values()))  # (device, host copy, pool)

    monkeypatch.setattr(fgo.ChunkOffloadHandler, "bulk_offload_group", counted)
    model_manager = fgo.PipelineOffloadManager.get_instance()
    # five timed repetitions: their median outlasts a stall or two of a loaded machine (with two, whose
    # median is their mean, a fresh-clone CI run on 2 cores once put a group over the bound)
    repeats = 5
    ms = regions.offload_host_ms(torch.device("cpu"), repeats=repeats)
    assert fgo.PipelineOffloadManager.OFFLOAD_MGR is model_manager
    assert set(ms) == {"group", "tensor"} and all(0.0 <= v < 50.0 for v in ms.values())
    few, many = regions.OFFLOAD_TENSORS
    warm = regions.OFFLOAD_GROUPS + 1  # the warm-up step moves every group, the last one too
    per_variant = warm + (repeats + 3) * regions.OFFLOAD_GROUPS  # then 3 untimed and the timed repetitions
    assert tensors == [few] * per_variant + [many] * per_variant
    # the same groups timed method by method: each moved group copied out and reloaded once
    tensors.clear()
    calls = regions.offload_calls(torch.device("cpu"))
    assert fgo.PipelineOffloadManager.OFFLOAD_MGR is model_manager
    assert tensors == [many] * (warm + regions.OFFLOAD_GROUPS)  # its warm-up step, then the timed one
    for method in ("bulk_offload_group", "bulk_reload_group"):
        assert calls["methods"][f"ChunkOffloadHandler.{method}"][0] == regions.OFFLOAD_GROUPS
    assert calls["methods"]["ChunkOffloadHandler.tensor_push"][0] == calls["groups"] * many
    monkeypatch.setattr("recipes.build.offload.copy_streams_ready", lambda device: False)
    assert regions.offload_host_ms(torch.device("cpu"), repeats=2) is None
    assert regions.offload_calls(torch.device("cpu")) is None
