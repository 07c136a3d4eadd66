"""Activation offload changes no gradient, and it really moves bytes (counts, ledger), on a CPU.

The runs go through megatron-core's own offload manager with its copy streams emulated on the CPU
(``recipes.build.offload``, ``offload.emulate_on_cpu=true``): a copy on a copy stream lands only when
something waits for it, and fresh buffers hold NaN, so a missing wait shows in the gradients
(``tests/test_upstream.py`` shows megatron's own, issue 7398, that way).
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_trainer, compose, train_in_process
from test_parallel import two_ranks

from recipes.errors import ConfigError

EMULATED = ["offload.emulate_on_cpu=true", "offload.min_offloaded_tensor_size=0"]
#: min_offloaded_tensor_size above every tensor: the offload points stay in the graph, nothing moves.
NOTHING_MOVED = ["offload.emulate_on_cpu=true", "offload.min_offloaded_tensor_size=1000000000"]
STEPS = 3  # the manager's warm-up step, then two planned ones


def run_steps(cfg: dict, steps: int = STEPS) -> list[dict]:
    """Per step: loss, gradients (before the update), what offload moved, the ledger (second step)."""
    trainer = build_trainer(cfg)
    out = []
    try:
        for i in range(steps):
            before = trainer.offload_meter.snapshot() if trainer.offload_meter else None
            loss = trainer.compute_gradients(record_ledger=i == 1)
            grads = {n: p.grad.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()
                     if p.grad is not None}
            moved = trainer.offload_meter.since(before) if before is not None else None
            out.append({"loss": loss, "grads": grads, "moved": moved,
                        "ledger": dict(trainer.ledger.bytes_by_kind) if i == 1 else None,
                        "host": dict(trainer.ledger.host_bytes_by_kind) if i == 1 else None})
            trainer.optimizer.step()
    finally:
        trainer.close()
    return out


def assert_equal_runs(a: list[dict], b: list[dict], what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert x["loss"] == y["loss"], f"{what}: step {i + 1} loss differs"
        assert x["grads"].keys() == y["grads"].keys()
        for name in x["grads"]:
            assert torch.equal(x["grads"][name], y["grads"][name]), f"{what}: step {i + 1} gradient of {name}"


#: (model overrides, recompute option, offload option)
CASES = [
    (["model=standard_attn"], "none", "core_attn-attn_proj"),
    (["model=standard_attn", "attention=unfused", "model.hidden_dropout=0.1", "model.attention_dropout=0.1"],
     "none", "qkv_linear-core_attn-attn_proj"),
    (["model=standard_attn"], "selective/core_attn", "qkv_linear"),
    (["model=standard_attn"], "none", "attn_norm"),
    (["model=standard_attn"], "selective/layernorm", "attn_norm-mlp_norm"),
    (["model=mla"], "selective/mla_up_proj", "core_attn-attn_proj"),
    (["model=moe"], "none", "expert_fc1-moe_act"),
    (["model=moe"], "selective/moe_act-layernorm", "expert_fc1-moe_act"),
    (["model=moe"], "selective/moe", "attn_norm"),
    (["model=gdn", "model.num_layers=4"], "none", "core_attn-attn_proj"),  # 2 attention layers of 4
    (["model=mla_moe"], "selective/mla_up_proj-moe_act", "core_attn-attn_proj"),
    (["model=mla_moe"], "none", "expert_fc1-moe_act"),
    (["model=gdn_moe", "model.num_layers=4"], "selective/moe_act", "expert_fc1"),
    # several micro-batches: each one's groups reload while the others' copies are in flight
    (["model=standard_attn", "train.global_batch_size=6"], "none", "qkv_linear-core_attn-attn_proj"),
    (["model=moe", "train.global_batch_size=6"], "selective/layernorm", "expert_fc1-moe_act"),
]


@pytest.mark.parametrize("model,recompute,offload", CASES, ids=[f"{m[0][6:]}-{r}-{o}" for m, r, o in CASES])
def test_offload_is_bit_exact_and_moves_bytes(megatron_world, model, recompute, offload):
    """Loss and every gradient equal the run without offload bit for bit, on every step from the
    manager's warm-up on; every step copies bytes out and the same bytes back; after the warm-up
    the manager keeps the last group of each module on the device; the ledger holds fewer device
    bytes and counts the host copies."""
    base = [*model, f"recompute={recompute}"]
    plain = run_steps(compose(*base))
    cfg = compose(*base, f"offload={offload}", *EMULATED)
    off = run_steps(cfg)
    assert_equal_runs(plain, off, f"offload={offload}")
    train = cfg["train"]
    micro_batches = (train["global_batch_size"] or train["micro_batch_size"]) // train["micro_batch_size"]
    modules = set(offload.split("-"))
    for step in off:
        assert step["moved"]["d2h_bytes"] > 0 and step["moved"]["d2h_bytes"] == step["moved"]["h2d_bytes"]
        assert set(step["moved"]["d2h_bytes_by_module"]) <= modules
    assert off[1]["moved"]["d2h_tensors"] < off[0]["moved"]["d2h_tensors"], "the warm-up moves every group"
    assert sum(off[1]["ledger"].values()) < sum(plain[1]["ledger"].values())
    assert sum(off[1]["host"].values()) * micro_batches == off[1]["moved"]["d2h_bytes"]  # each keeps its last layer


def test_norm_offload_points_reorder_a_gradient_sum(megatron_world):
    """``mlp_norm`` (and ``attn_norm-mlp_norm``) are exact only to fp32 rounding against no offload,
    as ``layernorm`` recompute is, and not because of the copies: with the offload points in the
    graph and nothing moved the gradients are the same bit for bit. megatron's identity nodes at the
    points change the order autograd adds a norm input's gradient terms in (layer 0 and the embedding
    differ by a few ULPs; the loss is identical)."""
    base = ["model=standard_attn", "offload=mlp_norm"]
    plain = run_steps(compose("model=standard_attn"))
    moved = run_steps(compose(*base, *EMULATED))
    unmoved = run_steps(compose(*base, *NOTHING_MOVED))
    assert all(s["moved"]["d2h_bytes"] > 0 for s in moved) and all(s["moved"]["d2h_bytes"] == 0 for s in unmoved)
    assert_equal_runs(unmoved, moved, "offload=mlp_norm against its points with nothing moved")
    differ = [n for n in plain[0]["grads"] if not torch.equal(plain[0]["grads"][n], moved[0]["grads"][n])]
    assert differ and all(p["loss"] == m["loss"] for p, m in zip(plain, moved))
    for p, m in zip(plain, moved):
        for name, grad in p["grads"].items():
            torch.testing.assert_close(m["grads"][name], grad, rtol=1e-5, atol=1e-6 * grad.abs().max())


def test_grouped_experts_offload_their_activations_not_their_weights(megatron_world):
    """``expert_fc1`` moves each MoE layer's permuted tokens (rows x hidden); ``moe_act`` what the
    SwiGLU activation saves: FC1's output as its two halves (each copied as a contiguous rows x ffn),
    SiLU's output, the gated product (rows x ffn each) and the router probs (rows). The stacked
    weights, whose views the GEMMs save, stay on the device."""
    cfg = compose("model=moe", "offload=expert_fc1-moe_act", *EMULATED)
    m, t = cfg["model"], cfg["train"]
    rows = t["seq_length"] * t["micro_batch_size"] * m["moe_router_topk"]
    first = run_steps(cfg, steps=1)[0]["moved"]["d2h_bytes_by_module"]
    layers, fp32 = m["num_layers"], 4
    assert first["expert_fc1"] == layers * rows * m["hidden_size"] * fp32
    assert first["moe_act"] == layers * rows * (4 * m["moe_ffn_hidden_size"] + 1) * fp32


def test_a_run_records_what_offload_moved(megatron_world):
    """The worker's result: the ledger's host bytes after the manager's plan, bytes moved per measured
    step (the same every step), and the plan; the window starts after two warm-up steps."""
    cfg = compose("model=standard_attn", "offload=core_attn-attn_proj", *EMULATED, "train.train_iters=5",
                  "measure.start_step=2", "profile=none")
    result = train_in_process(cfg)
    assert result["status"] == "ok" and result["window"] == [3, 5]
    off = result["offload"]
    assert off["modules"] == ["core_attn", "attn_proj"] and off["moved_steps_equal"]
    assert off["moved_per_step"]["d2h_bytes"] == result["ledger"]["host_total_bytes"] > 0
    assert off["groups_kept"] == {"core_attn": 1, "attn_proj": 1}
    assert off["groups_moved"] == {"core_attn": 1, "attn_proj": 1}  # tiny: 2 layers
    assert "link" not in off  # GPU only


def test_each_micro_batch_keeps_its_last_layer_on_the_device(megatron_world):
    """With several micro-batches and no pipeline parallel, megatron's plan flags only the step's very
    last group of a module as kept, but each micro-batch's backward follows its forward, so the manager
    also keeps every micro-batch's last layer (``should_bulk_offload``). The groups recorded are the
    ones the step moved: 4 micro-batches of 2 layers move 4 groups a module, not the 7 the flags say,
    and the bytes are the ledger's micro-batch times 4."""
    cfg = compose("model=standard_attn", "offload=core_attn-attn_proj", *EMULATED, "train.train_iters=5",
                  "measure.start_step=2", "profile=none", "train.micro_batch_size=1", "train.global_batch_size=4")
    result = train_in_process(cfg)
    off = result["offload"]
    assert off["groups_moved"] == {"core_attn": 4, "attn_proj": 4}
    assert off["groups_kept"] == {"core_attn": 4, "attn_proj": 4}
    assert off["moved_per_step"]["d2h_bytes"] == 4 * result["ledger"]["host_total_bytes"] > 0


def test_reload_waits_are_counted_where_each_moved_group_is_needed(megatron_world):
    """CopyTimeline: in a planned step each moved group's module waits once for its reload (the tiny
    size's first layer moves core_attn and attn_proj: 2 waits a micro-batch); the kept groups never
    wait; a CPU has no clock for them; the strided tensors copied out are counted per point;
    megatron's method is back afterwards."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import OffloadTensorGroup

    from recipes.measure.offload import CopyTimeline
    from recipes.predict.estimate import predict

    original = OffloadTensorGroup.wait_reload_event
    cfg = compose("model=standard_attn", "offload=core_attn-attn_proj", *EMULATED, "train.micro_batch_size=1",
                  "train.global_batch_size=2")
    trainer = build_trainer(cfg)
    try:
        trainer.compute_gradients()  # the manager's warm-up: it plans after this step
        with CopyTimeline() as waits:
            trainer.compute_gradients()
    finally:
        trainer.close()
    moved = sum(predict(cfg, "cpu")["host_groups_per_layer"])
    assert moved == 2 and waits.count == moved * trainer.num_microbatches == 4 and waits.seconds() is None
    # core attention saves transposed views (q, k, v, its output, the log-sum-exp); the projection its whole input
    assert waits.summary()["strided_out"]["core_attn"] > 0 == waits.summary()["strided_out"]["attn_proj"]
    assert OffloadTensorGroup.wait_reload_event is original


def test_evaluation_passes_leave_the_offload_plan_alone(megatron_world):
    """Forward-only evaluation runs with the manager's offload off; training after it stays exact."""
    base = ["model=standard_attn", "train.train_iters=4", "data.eval_interval=2", "profile=none",
            "measure.ledger=false"]
    plain = train_in_process(compose(*base))
    off = train_in_process(compose(*base, "offload=core_attn-attn_proj", *EMULATED))
    assert off["loss"] == plain["loss"] and off["eval_loss"] == plain["eval_loss"]


# --- the emulated streams themselves ---------------------------------------------------------------
def test_emulated_copy_lands_only_when_waited_for():
    """The CPU stand-in: a copy issued on a copy stream is held until an event or stream wait; the
    compute stream runs at once; fresh buffers are NaN."""
    from recipes.build.offload import HostEvent, _CudaOnCpu, _TorchForOffloadOnCpu

    cuda, torch_ = _CudaOnCpu(), _TorchForOffloadOnCpu()
    copy = cuda.Stream()
    dst, src = torch_.empty(4), torch.arange(4.0)
    assert dst.isnan().all()
    with cuda.stream(copy):
        dst.copy_(src)
        event = HostEvent()
        event.record(copy)
    assert dst.isnan().all(), "the copy landed before anything waited for it"
    cuda.current_stream().wait_event(event)
    assert torch.equal(dst, src)
    with cuda.stream(cuda.current_stream()):
        dst.copy_(src * 2)
    assert torch.equal(dst, src * 2)


def test_exposed_time_is_copy_time_without_compute():
    from recipes.measure.steptrace import exposed_time, trace_intervals

    assert exposed_time([(0, 4)], [(1, 2), (3, 5)]) == {"busy": 4, "exposed": 2}
    assert exposed_time([(0, 1), (0.5, 2)], []) == {"busy": 2, "exposed": 2}
    assert exposed_time([(2, 3)], [(0, 10)])["exposed"] == 0
    trace = {"traceEvents": [
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 20, "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 5, "dur": 20},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50}]}
    copies, compute = trace_intervals(trace)
    assert copies == {"d2h": [(0.0, 1e-5)], "h2d": [(2e-5, 2.5e-5)]} and compute == [(5e-6, 2.5e-5)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer; a GPU run records the numbers")
def test_gpu_measurements_are_none_on_a_cpu():
    from recipes.measure.offload import copy_overlap, host_link_bandwidth

    assert host_link_bandwidth() is None and copy_overlap(lambda: None) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: pinned copies and CUDA streams")
def test_host_link_bandwidth_on_a_gpu():
    from recipes.measure.offload import host_link_bandwidth

    link = host_link_bandwidth(1 << 26, repeats=2)
    assert link["d2h_gb_s"] > 1 and link["h2d_gb_s"] > 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: CUDA events on the compute stream")
def test_reload_waits_are_timed_on_a_gpu(megatron_world):
    """On a GPU each wait for a reload is timed: one a moved group and micro-batch, each at least 0 s,
    and a run's result records them (recipes.run.window.offload_measurements)."""
    from recipes.measure.offload import CopyTimeline
    from recipes.predict.estimate import predict

    cfg = compose("model=standard_attn", "offload=core_attn-attn_proj", "offload.min_offloaded_tensor_size=0",
                  "train.micro_batch_size=1", "train.global_batch_size=2")
    trainer = build_trainer(cfg)
    try:
        trainer.compute_gradients()  # the manager's warm-up
        with CopyTimeline() as waits:
            trainer.compute_gradients()
        seconds, summary, spans = waits.seconds(), waits.summary(), waits.timeline()
    finally:
        trainer.close()
    moved = sum(predict(cfg, "cuda")["host_groups_per_layer"]) * 2
    assert waits.count == moved > 0
    assert seconds is not None and 0.0 <= seconds < 1.0 and summary["reload_wait_s"] == seconds
    # every moved group's copy out and back is on the clock, in order, with the bytes it moved each way
    kinds = [kind for kind, *_ in spans]
    assert kinds.count("out") == kinds.count("back") == kinds.count("wait") == moved
    assert all(0.0 <= a <= b for *_, a, b in spans)
    out = sum(n for kind, _, n, *_ in spans if kind == "out")
    assert out == sum(n for kind, _, n, *_ in spans if kind == "back") > 0
    for kind, name, _, a, _ in spans:  # each group reloads after its copy out began and before its wait ends
        if kind == "back":
            assert a >= min(x for k, g, _, x, _ in spans if k == "out" and g == name)
    assert summary["copies"]["d2h_gb_s"] > 0 and summary["copies"]["h2d_gb_s"] > 0  # tiny copies: latency, not rate
    result = train_in_process(compose("model=standard_attn", "offload=core_attn-attn_proj",
                                      "offload.min_offloaded_tensor_size=0", "train.train_iters=4", "profile=none",
                                      "train.micro_batch_size=1", "train.global_batch_size=2"))
    assert result["offload"]["reload_waits"] > 0 and 0.0 <= result["offload"]["reload_wait_s"] < 1.0
    assert len(result["offload"]["copy_timeline"]) == 3 * result["offload"]["reload_waits"]
    # the groups a step moved, each micro-batch keeping its last layer, as on a CPU
    assert result["offload"]["groups_moved"] == {"core_attn": 2, "attn_proj": 2}
    assert result["offload"]["groups_kept"] == {"core_attn": 2, "attn_proj": 2}


#: (model overrides, recompute, offload)
ESTIMATED = [
    (["model=standard_attn"], "none", "core_attn-attn_proj"),
    (["model=standard_attn"], "none", "core_attn"),  # the projection keeps SDPA's output on the device
    (["model=standard_attn", "attention=unfused"], "none", "qkv_linear-core_attn-attn_proj"),
    (["model=standard_attn", "attention=unfused", "model.attention_dropout=0.1", "model.hidden_dropout=0.1"],
     "none", "core_attn-attn_proj"),
    (["model=standard_attn"], "none", "attn_norm-mlp_norm"),
    (["model=standard_attn", "model.normalization=LayerNorm"], "none", "attn_norm-mlp_norm"),
    (["model=standard_attn"], "selective/layernorm", "attn_norm-mlp_norm"),
    (["model=moe"], "none", "expert_fc1-moe_act"),
    (["model=moe"], "selective/moe_act", "expert_fc1-moe_act"),
    (["model=mla"], "none", "core_attn-attn_proj"),
    (["model=mla"], "none", "qkv_linear-core_attn-attn_proj"),  # both down-projections save the input
    (["model=gdn", "model.num_layers=4"], "none", "core_attn-attn_proj"),
    # the experts of gdn_moe's GatedDeltaNet layers offload too (the estimator once left them out)
    (["model=gdn_moe", "model.num_layers=4"], "selective/moe_act", "expert_fc1"),
    # megatron's activation_offload_fraction: the last int(n * (1 - f)) moved groups stay (forward order)
    (["model=standard_attn", "model.num_layers=4", "offload.activation_offload_fraction=0.5"], "none",
     "core_attn-attn_proj"),  # 6 groups: layers 0-2's two; layer 1's projection and layer 2's stay
    (["model=moe", "model.num_layers=4", "offload.activation_offload_fraction=0.4"], "none",
     "expert_fc1-moe_act"),  # 6 groups, int(3.6) = 3 stay: a cut inside a layer
]


@pytest.mark.parametrize("model,recompute,offload", ESTIMATED,
                         ids=[f"{m[-1][6:]}-{r}-{o}" for m, r, o in ESTIMATED])
def test_estimator_predicts_device_and_host_bytes(megatron_world, model, recompute, offload):
    """recipes.predict.estimate with offload, against the ledger of the manager's first planned step:
    the device bytes by kind exactly; the host copies by kind exactly (every save is
    copied: a tensor two ops save goes twice; a saved view goes as its own elements)."""
    from recipes.predict.estimate import predict

    cfg = compose(*model, f"recompute={recompute}", f"offload={offload}", *EMULATED)
    measured = run_steps(cfg, steps=2)[1]
    p = predict(cfg, device="cpu")
    assert p["activation_bytes_by_kind"] == measured["ledger"]
    assert p["host_bytes_by_kind"] == measured["host"]


def test_exposed_transfer_model():
    """megatron's manager played per group: a copy out is ready at its module's forward end and queues;
    compute never waits for it. Each group's backward end, moved or kept, issues the next reload (the
    last group moved first), which starts once the link is free and its copy out is done; the module's
    backward (the mirror of its forward span) waits for it. The overhead is per group and per GiB moved."""
    from recipes.predict.copies import exposed_transfer_s

    half = {"x": (0.0, 0.5)}  # a module over the first half of its layer's forward
    # 20 ms a copy each way: ready at 25 ms, back at 220 (issued as the kept layer's backward ends, at
    # 200), due at 250 (the module's backward begins halfway through its layer's): hidden
    hidden = exposed_transfer_s([[("x", 10**9)], [("x", 0)]], 0.05, 50.0, 1, half)
    assert hidden == {"copy_s": pytest.approx(0.04), "exposed_s": 0.0, "overhead_s": 0.0}
    # 5 ms layers: out done at 22.5 ms, reload 22.5-42.5 (issued at 20), due at 25: 17.5 ms a micro-batch
    slow = exposed_transfer_s([[("x", 10**9)], [("x", 0)]], 0.005, 50.0, 2, half)
    assert slow["exposed_s"] == pytest.approx(2 * 0.0175)
    # a module early in the forward is ready sooner and needed later in backward: out done at 21,
    # reload 21-41, due at 28
    early = exposed_transfer_s([[("x", 10**9)], [("x", 0)]], 0.005, 50.0, 1, {"x": (0.0, 0.2)})
    assert early["exposed_s"] == pytest.approx(0.013)
    # two groups a layer (a over the first half, m the second): outs a 2.5-22.5, m 22.5-42.5 ms. The
    # kept layer's m hook (15) reloads m (42.5-62.5), its a hook (20) reloads a (62.5-82.5); layer 0's
    # m is due at 20 (waits 42.5), its a at 67.5 (waits 15)
    both = {"a": (0.0, 0.5), "m": (0.5, 1.0)}
    two = exposed_transfer_s([[("a", 10**9), ("m", 10**9)], [("a", 0), ("m", 0)]], 0.005, 50.0, 1, both)
    assert two["exposed_s"] == pytest.approx(0.0425 + 0.015)
    # no hook issues it (the layer above has no group): the tensors reload as they are unpacked, at 20
    # after the copy out (5-25): 25-45
    unhooked = exposed_transfer_s([[("m", 10**9)], []], 0.005, 50.0, 1, both)
    assert unhooked["exposed_s"] == pytest.approx(0.025)
    # the overhead (h = half of it a pass) lengthens layer 0's forward and backward: its copy out is
    # done h/2 later, and its module's backward is due 1.5 h later, so h more of it is hidden
    h = 2e-3 * 10**9 / 2**30 / 2
    lengthened = exposed_transfer_s([[("x", 10**9)], [("x", 0)]], 0.005, 50.0, 2, half, s_per_gib=2e-3)
    assert lengthened["exposed_s"] == pytest.approx(2 * (0.0175 - h))
    assert lengthened["overhead_s"] == pytest.approx(2 * 2 * h)
    # the overhead: per group moved and per GiB moved, per micro-batch
    groups = [[("a", 2**29), ("m", 2**29), ("x", 0)], [("x", 2**30)], [("a", 0), ("m", 0), ("x", 0)]]
    over = exposed_transfer_s(groups, 0.05, 50.0, 2, {**half, **both}, s_per_group=1e-4, s_per_gib=2e-3)
    assert over["overhead_s"] == pytest.approx(2 * (3 * 1e-4 + 2 * 2e-3)) and over["exposed_s"] == 0.0


def test_offload_groups_and_where_they_sit():
    """The estimator's groups: every offload point a layer has, in forward order, with the bytes it
    copies; the kept last layer's copy nothing; fused attention's projection is a group of its own.
    Their places in the layer come from the FLOPs, or from a base point's step timeline."""
    from recipes.predict.copies import flop_positions, offload_positions
    from recipes.predict.cost import layer_forward_s
    from recipes.predict.estimate import predict

    cfg = compose("model=standard_attn", "offload=qkv_linear-core_attn-attn_proj", *EMULATED)
    groups = predict(cfg, "cpu")["offload_groups_per_layer"]
    assert [[point for point, _ in layer] for layer in groups] == [["qkv_linear", "core_attn", "attn_proj"]] * len(groups)
    assert all(n > 0 for layer in groups[:-1] for _, n in layer) and all(n == 0 for _, n in groups[-1])
    assert sum(n for layer in groups for _, n in layer) == sum(predict(cfg, "cpu")["host_bytes_per_layer"])
    flops = flop_positions(cfg)
    order = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"]
    assert [flops[p] for p in order] == sorted(flops.values()) and flops["moe_act"][1] == 1.0
    assert flops["qkv_linear"][1] == flops["core_attn"][0] > 0 and flops["attn_proj"][1] < 0.5  # the MLP is most
    # a layer of 10 ms the GPU reaches core attention's start at 2 and its end at 6 (the host far ahead)
    names = ["1::pre", "1:self_attention.core_attention:pre", "1:self_attention.core_attention:end", "1::end"]
    marks = {"names": names, "host_ms": [0.0] * 4, "gpu_ms": [0.0, 2.0, 4.0, 4.0]}
    timed = {"layers": [1], "forward_ms": {"": [25.0]}, "marks": marks}
    placed = offload_positions(cfg, timed)
    assert placed["core_attn"] == pytest.approx((0.2, 0.6)) and placed["qkv_linear"] == flops["qkv_linear"]
    # one mark for both expert points: FC1 commits where its share of the experts' FLOPs ends (SwiGLU:
    # FC1 is 2 of 3 parts), moe_act at the experts' end
    moe = compose("model=moe", "offload=expert_fc1-moe_act", *EMULATED)
    names = ["1::pre", "1:mlp.experts:pre", "1:mlp.experts:end", "1::end"]
    experts = {"layers": [1], "forward_ms": {}, "marks": {"names": names, "host_ms": [0.0] * 4,
                                                          "gpu_ms": [0.0, 4.0, 3.0, 3.0]}}
    split = offload_positions(moe, experts)
    assert split["expert_fc1"] == pytest.approx((0.4, 0.6)) and split["moe_act"] == pytest.approx((0.6, 0.7))
    # the layer forward the copies hide under is the timeline's, not the module-time pass's stream time
    assert layer_forward_s(cfg, 400.0, timed) == pytest.approx(0.010)
    assert layer_forward_s(cfg, 400.0, {**timed, "marks": None}) == pytest.approx(0.025)


def test_host_memory_is_checked_against_the_prediction(megatron_world):
    """The controller's check: the estimator's host bytes (micro-batches in flight) against the host
    memory given; the prediction is what the run copies."""
    from recipes.predict.estimate import planned_host_bytes
    from recipes.run.controller import check_point

    cfg = compose("model=standard_attn", "offload=core_attn-attn_proj", *EMULATED)
    planned = planned_host_bytes(cfg, "cpu")
    assert planned == run_steps(cfg, steps=2)[1]["moved"]["d2h_bytes"]
    check_point(cfg, num_gpus=0)  # this machine has room
    small = compose("model=standard_attn", "offload=core_attn-attn_proj", *EMULATED,
                    f"offload.host_memory_gib={planned / 2**30 / 2}")
    with pytest.raises(ConfigError, match="predicted at 0.1 MiB of host memory per node"):
        check_point(small, num_gpus=0)
    assert planned_host_bytes(compose("model=standard_attn")) is None


def test_the_planner_sets_aside_plans_the_host_cannot_hold():
    """advise --predict: an offload plan whose copies need more host memory per node than
    offload.host_memory_gib is not priced nor picked, and the plan's lines say why and the fix; the
    same plans come back with room for them."""
    from recipes.analyze.plan import explain_plan, plan
    from recipes.config import compose_config

    overrides = ["model=moe", "size=h200", "parallel=pp2", "launcher.nproc_per_node=2"]
    roomy = plan(compose_config([*overrides, "offload.host_memory_gib=1024"]), 60.0)
    assert not roomy["over_host"] and any(r["offload"] != "none" for r in roomy["rows"])
    least = min(r["host_gib"] for r in roomy["rows"] if r["host_gib"] > 0)
    # room for the smallest plan's copies on both ranks of a node, not for the others'
    tight = plan(compose_config([*overrides, f"offload.host_memory_gib={2 * least * 1.01}"]), 60.0)
    kept = [r for r in tight["rows"] if r["offload"] != "none"]
    assert kept and all(2 * r["host_gib"] <= 2 * least * 1.01 for r in kept)
    assert len(tight["over_host"]) == sum(r["offload"] != "none" for r in roomy["rows"]) - len(kept)
    line = next(x for x in explain_plan(tight, " ".join(overrides)) if "set aside for the host's memory" in x)
    assert "x 2 ranks), above offload.host_memory_gib" in line and "fix: offload fewer modules" in line


def test_a_sweep_with_offload_end_to_end_and_its_report(tmp_path):
    """``train.py -m`` on a CPU (emulated copy streams): the point is named by its offload, records
    what it moved, and the sweep's report lists it beside none."""
    import json
    import subprocess
    import sys

    from conftest import REPO, subprocess_env

    sweep = tmp_path / "sweep"
    args = [sys.executable, str(REPO / "train.py"), "-m", "model=standard_attn", "size=tiny", "profile=none",
            "offload=none,core_attn-attn_proj", "offload.emulate_on_cpu=true", "offload.min_offloaded_tensor_size=0",
            "train.train_iters=4", "measure.start_step=3", f"hydra.sweep.dir={sweep}"]
    done = subprocess.run(args, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = {r["name"]: r for r in (json.loads(p.read_text()) for p in sweep.glob("*/result.json"))}
    off = results["standard_attn sdpa none offload=core_attn-attn_proj"]
    assert off["status"] == "ok" and off["ranks"][0]["offload"]["moved_per_step"]["d2h_bytes"] > 0
    report = (sweep / "report.md").read_text()
    assert "| standard_attn sdpa none offload=core_attn-attn_proj | 0 | ok |" in report


#: (layout, offload option) run on two CPU ranks with gloo, against test_parallel's run of the layout
LAYOUTS = [
    # 4 micro-batches over two stages of two layers: the ledger's micro-batch is the first to run
    # backward, so it keeps the last group
    ("pp2", "offload=core_attn-attn_proj"),
    # sequence parallel: each rank moves its shard of core attention's heads
    ("tp2", "offload=core_attn-attn_proj"),
    # expert parallel: each rank moves the tokens routed to its experts, which differ by rank
    ("ep2", "offload=expert_fc1-moe_act"),
]


@pytest.mark.slow
@pytest.mark.parametrize("layout,offload", [pytest.param(*case, id=case[0], marks=two_ranks(case[0]))
                                            for case in LAYOUTS])
def test_parallel_offload_is_exact_and_predicted_per_rank(tmp_path, shared_runs, layout, offload):
    """Two ranks (gloo): the losses and gradient norms of every step equal the run without offload;
    each rank's device ledger and host bytes are what the estimator says for it (under expert
    parallel, for the tokens its experts were routed). The runs without offload are test_parallel's
    ``layout_run``, made once a session."""
    from test_parallel import SCHEDULE, TWO_RANK_LAYOUTS, layout_result, train_subprocess

    from recipes.predict.compare import compare_result

    plain, _ = layout_result(shared_runs, layout)
    off, _ = train_subprocess(tmp_path / "off", *TWO_RANK_LAYOUTS[layout], offload, *EMULATED, steps=SCHEDULE)
    for a, b in zip(plain["ranks"], off["ranks"]):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
        assert b["offload"]["moved_per_step"]["d2h_bytes"] > 0
    for row in compare_result(off):
        assert row["predicted_ledger_bytes"] == row["measured_ledger_bytes"]
        assert row["predicted_host_bytes"] == row["measured_host_bytes"] > 0


def test_one_hardware_queue_is_asked_for_only_under_tensor_parallelism(monkeypatch):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream behind one queue: an offload copy then holds up
    the compute stream (measured on the H200: docs/offload.md). megatron needs it for TP's comm order."""
    from conftest import compose

    from recipes.run.workers import worker_environment

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in worker_environment(compose("offload=core_attn"))
    assert worker_environment(compose("parallel=tp2"))["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "4")  # the user's own setting stands
    assert worker_environment(compose("parallel=tp2"))["CUDA_DEVICE_MAX_CONNECTIONS"] == "4"


def test_a_term_of_several_tensors_is_weighed_tensor_by_tensor_against_the_minimum():
    """MLA's RoPE cos and sin for q and k are four tensors of sequence x rotary dims: at the h200 size
    each holds 262,144 elements, below megatron's default offload.min_offloaded_tensor_size (1,048,576),
    so qkv_linear's groups leave them on the device (one H200 measured 588 MiB a micro-batch copied,
    docs/evidence/offload-h200's mla_h200), although the four together reach it."""
    from recipes.predict.estimate import predict

    def host(*extra):
        return predict(compose("model=mla", "size=h200", "offload=qkv_linear", *extra), "cuda")

    default, every = host(), host("offload.min_offloaded_tensor_size=0")
    rope = 4 * 2 * 4096 * 64  # four bf16 tensors of 4096 x 64
    moved = sum(default["host_groups_per_layer"])
    assert moved == 7 and every["host_bytes"] - default["host_bytes"] == moved * rope
    assert default["host_bytes"] == 588 * 2**20
