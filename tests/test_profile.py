"""Peak attribution and memory timeline (recipes/measure/profile.py, recipes/measure/memtrace.py) on the tiny models.

On a CPU the trace is the storages saved for backward, so at the end of a micro-batch's forward the
attribution must equal the activation ledger exactly (same storages, same kinds): with one
micro-batch and no recompute nothing is freed before the backward starts, so the peak is that
moment and its activation bytes are the ledger's. The allocator path's bookkeeping is tested with
synthetic snapshots; the real allocator only on a GPU (skipped here).
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_trainer, compose, train_in_process

from recipes.measure.memtrace import BEFORE, TRANSIENT, Trace, allocator_trace
from recipes.measure.profile import profile_step, replay
from recipes.measure.timeline import first_label_to_try, plot_timelines, top_contributors, write_timeline_pngs
from recipes.recompute import KINDS

#: The saved-tensor path (what CI runs). On a GPU the allocator path runs instead: it also counts
#: transients and megatron's optimizer, so the CPU equalities below do not apply there.
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="saved-tensor (CPU) semantics")


def _profile(*overrides: str, run_dir=None) -> tuple[dict, dict, object]:
    """(profile, the reference step's ledger, trainer) after one warm-up step."""
    cfg = compose(*overrides)
    trainer = build_trainer(cfg)
    try:
        trainer.step()  # optimizer state exists from here on, as in the worker's profiled step
        prof = profile_step(trainer, cfg, run_dir)
        assert prof.get("status") == "ok", prof
        return prof, dict(trainer.ledger.bytes_by_kind), trainer
    finally:
        trainer.close()


@CPU_ONLY
@pytest.mark.parametrize("overrides", [
    ("attention=unfused", "recompute=control"),
    ("model=moe", "recompute=control"),
    ("model=mla", "recompute=selective/mla_up_proj"),
], ids=["dense-unfused", "moe", "mla-up-proj"])
def test_activation_bytes_at_the_peak_equal_the_ledger(megatron_world, overrides):
    prof, ledger, trainer = _profile(*overrides)
    assert prof["ledger_bytes_by_kind"] == ledger  # the ledger's measure, taken by the profiler's hooks
    assert prof["forward_end"]["activation_bytes_by_kind"] == ledger
    assert prof["peak_phase"].startswith("forward"), prof["peak_phase"]  # one micro-batch: see above
    assert {k: prof["bytes_by_kind"][k] for k in KINDS} == ledger
    # static memory from the tensors themselves; the attribution is the peak by construction
    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
              for c in trainer.chunks for p in c.parameters()}
    states = sum(t.untyped_storage().nbytes() for s in trainer.optimizer.state.values()
                 for t in s.values() if isinstance(t, torch.Tensor))
    assert prof["bytes_by_kind"]["parameters"] == sum(params.values())
    assert prof["bytes_by_kind"]["optimizer_state"] == states
    assert sum(prof["bytes_by_kind"].values()) == prof["peak_bytes"] == max(prof["timeline"]["total"])
    assert prof["cost"]["peak_change"] == 0.0 and prof["cost"]["time_ratio"] > 0


@CPU_ONLY
def test_discarding_a_module_output_removes_its_bytes(megatron_world):
    control, _, _ = _profile("attention=unfused", "recompute=control")
    core, ledger, _ = _profile("attention=unfused", "recompute=selective/core_attn")
    assert control["bytes_by_kind"]["core_attn"] > 0
    assert core["bytes_by_kind"]["core_attn"] == 0 == ledger["core_attn"]
    # megatron's mlp checkpoint keeps its input outside the MLP (kind other), recipes.build.mlp's
    # inside it (kind mlp): both keep nothing else of the MLP
    mlp, ledger, _ = _profile("attention=unfused", "recompute=selective/mlp", "recompute.mlp_replays_fc2=true")
    assert control["bytes_by_kind"]["mlp"] > 0
    assert mlp["forward_end"]["activation_bytes_by_kind"]["mlp"] == 0 == ledger["mlp"]
    ours, ours_ledger, _ = _profile("attention=unfused", "recompute=selective/mlp")
    assert ours["forward_end"]["activation_bytes_by_kind"]["mlp"] == ours_ledger["mlp"] == ledger["other"] > 0
    # the peak moves into the backward, where at most one layer's MLP is recomputed and alive
    num_layers = compose()["model"]["num_layers"]
    assert mlp["peak_phase"].startswith("backward layer")
    assert 0 < mlp["bytes_by_kind"]["mlp"] <= control["bytes_by_kind"]["mlp"] / num_layers
    assert all(not p.startswith("forward") for p in mlp["alive_by_phase"] if "mlp" in p)


def test_timeline_png_console_line_and_side_by_side(megatron_world, tmp_path):
    prof, _, _ = _profile("attention=unfused", "recompute=control", run_dir=tmp_path)
    png = tmp_path / "memory_timeline.png"
    assert not png.exists()  # the worker does not draw: the controller does, after it exits
    assert write_timeline_pngs({"ranks": [{"rank": 0, "profile": prof}]}, tmp_path) == [png]
    assert prof["png"] == str(png) and png.stat().st_size > 10_000
    if not torch.cuda.is_available():  # no allocator: no snapshot for memory_viz, and the result says why
        assert prof["snapshot"] is None and prof["snapshot_note"].startswith("no memory snapshot on a CPU")
        assert not list(tmp_path.glob("*.pickle"))
    phases = [p for _, _, p in prof["timeline"]["phases"]]
    assert {"forward layer 1", "backward layer 2", "optimizer step"} <= set(phases)
    assert phases.index("forward layer 2") < phases.index("backward layer 2") < phases.index("backward layer 1")
    line = top_contributors({"ranks": [{"rank": 0, "profile": prof}], "worst_rank": 0})
    assert line.startswith("peak ") and " in forward" in line and line.count("%") == 3
    full, _, _ = _profile("attention=unfused", "recompute=full")
    runs = [{"name": "control", "ranks": [{"rank": 0, "profile": prof}], "worst_rank": 0},
            {"name": "full", "ranks": [{"rank": 0, "profile": full}], "worst_rank": 0}]
    side = plot_timelines(runs, tmp_path / "side.png")
    assert side.stat().st_size > 10_000
    assert plot_timelines([{"name": "no profile", "ranks": [{"rank": 0}]}], tmp_path / "x.png") is None


def test_profile_switch(megatron_world):
    assert compose()["measure"]["profile"] == "peak"  # on by default: every run's result has it
    assert compose("profile=none")["measure"]["profile"] == "none"
    assert compose("measure.profile=none")["measure"]["profile"] == "none"
    assert "profile" not in train_in_process(compose("profile=none", "train.train_iters=3"))
    result = train_in_process(compose("train.train_iters=3"))  # through the worker's call site
    assert result["profile"]["status"] == "ok"
    assert result["profile"]["cost"]["step_time_s"] == result["timing"]["step_time_s"]
    from recipes.errors import ConfigError

    with pytest.raises(ConfigError, match="measure.profile"):
        profile_step(None, {"measure": {"profile": "peek"}})


def _fake_profile(peak_phase: str = "forward logits/loss", **bytes_by_kind: int) -> dict:
    kinds = dict.fromkeys(("parameters", "gradients", "optimizer_state", *KINDS, TRANSIENT), 0)
    kinds.update({k.replace("_slash_", "/"): v for k, v in bytes_by_kind.items()})
    return {"status": "ok", "peak_bytes": sum(kinds.values()), "peak_phase": peak_phase,
            "bytes_by_kind": kinds, "timeline": {}}


@pytest.mark.parametrize("family,experts,dominant,label", [
    ("standard_attn", "grouped", "core_attn", "selective/core_attn"),
    ("mla", "grouped", "attn_proj", "selective/mla_up_proj"),
    ("standard_attn", "grouped", "attn_proj", "full"),
    ("moe", "grouped", "moe", "selective/moe_act"),
    ("moe", "sequential", "moe", "selective/moe"),
    ("standard_attn", "grouped", "mlp", "selective/mlp"),
    ("standard_attn", "grouped", "norm", "selective/layernorm"),
    ("standard_attn", "grouped", "logits", None),
    ("standard_attn", "grouped", "optimizer_state", None),
])
def test_first_label_to_try_follows_the_guide(family, experts, dominant, label):
    prof = _fake_profile(**{"embedding": 1, "parameters": 1, dominant: 10})
    result = {"profile": prof, "config": {"model": {"family": family, "experts": experts},
                                          "attention": {"backend": "unfused"}}}
    got, why = first_label_to_try(result)
    assert got == label, why
    assert why
    if dominant == "logits":
        assert "vocabulary-parallel" in why
    if dominant == "optimizer_state":
        assert "distributed optimizer" in why


def test_replay_and_allocator_trace_bookkeeping():
    """The GPU path's conversion on synthetic snapshots: rounding, static buckets by address,
    kinds from the labels of this step only, and the peak as the sum of live blocks."""
    start = {"segments": [{"device": 0, "blocks": [
        {"address": 1000, "size": 4096, "state": "active_allocated"},  # a parameter buffer
        {"address": 9000, "size": 512, "state": "active_allocated"},  # something persistent
        {"address": 7000, "size": 512, "state": "inactive"}]}]}
    tok = "t99"
    entries = [
        {"action": "alloc", "addr": 2000, "size": 1000, "user_metadata": f"forward layer 1|mlp|{tok}"},
        {"action": "segment_alloc", "addr": 50000, "size": 2 << 20},
        {"action": "alloc", "addr": 3000, "size": 600, "user_metadata": f"forward layer 1|core_attn|{tok}"},
        {"action": "alloc", "addr": 4000, "size": 100, "user_metadata": "stale|mlp|t1"},  # not this step
        {"action": "free_requested", "addr": 4000, "size": 100, "user_metadata": ""},
        {"action": "alloc", "addr": 5000, "size": 2048, "user_metadata": f"backward layer 1|grad|{tok}"},
        {"action": "free_requested", "addr": 3000, "size": 600, "user_metadata": f"backward layer 1|grad|{tok}"},
        {"action": "free_requested", "addr": 2000, "size": 1000, "user_metadata": f"backward layer 1|grad|{tok}"},
        {"action": "free_requested", "addr": 6000, "size": 512, "user_metadata": ""},  # unknown block
    ]
    trace, unmatched = allocator_trace(start, {"device_traces": [entries]}, tok, {1000: "parameters"},
                                       {1000: "parameters", 5000: "gradients"}, device=0)
    assert unmatched == 1 and trace.labelled == 5
    out = replay(trace)
    # peak after the gradient's allocation: 4096 + 512 + 1024 (mlp) + 1024 (core_attn) + 2048
    assert out["peak_bytes"] == 4096 + 512 + 1024 + 1024 + 2048
    assert out["peak_phase"] == "backward layer 1"
    b = out["bytes_by_kind"]
    assert (b["parameters"], b["mlp"], b["core_attn"], b["gradients"], b[TRANSIENT]) == (4096, 1024, 1024, 2048, 512)
    assert sum(b.values()) == out["peak_bytes"]
    assert out["forward_end"]["activation_bytes_by_kind"]["mlp"] == 1024
    assert out["alive_by_phase"][BEFORE] == 4096 + 512


def test_replay_markers_and_resizes():
    trace = Trace(start={0: 100}, bucket={0: "parameters", 1: "mlp"}, origin={0: BEFORE, 1: "forward layer 1"})
    trace.events = [(-1, 0, "forward layer 1"), (1, 50, "forward layer 1"), (1, 0, "forward layer 1"),
                    (1, 50, "backward layer 1"), (1, 0, "backward layer 1")]  # discarded, then recomputed
    out = replay(trace)
    assert out["peak_bytes"] == 150 and out["peak_event"] == 2 and out["peak_phase"] == "forward layer 1"
    assert out["forward_end"]["activation_bytes_by_kind"]["mlp"] == 0  # discarded before the backward


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator path needs a CUDA device")
def test_allocator_attribution_sums_to_max_memory_allocated(megatron_world):
    prof, _, _ = _profile("attention=unfused", "recompute=control")
    assert prof["source"] == "allocator" and prof["check"]["unmatched_frees"] == 0
    assert abs(prof["check"]["sum_ratio"] - 1) <= 0.02
    assert abs(prof["cost"]["peak_change"]) <= 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA caching allocator's snapshot")
def test_the_profiled_step_s_snapshot_opens_in_pytorch_s_memory_viewer(megatron_world, tmp_path):
    """``memory_snapshot.pickle`` is what ``torch.cuda.memory._dump_snapshot`` writes: the viewer's
    own converter (torch.cuda._memory_viz, behind pytorch.org/memory_viz) reads it."""
    import pickle

    from torch.cuda import _memory_viz

    prof, _, _ = _profile("attention=unfused", "recompute=control", run_dir=tmp_path)
    path = tmp_path / "memory_snapshot.pickle"
    assert prof["snapshot"] == str(path)
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert {"segments", "device_traces"} <= set(snapshot) and snapshot["device_traces"][torch.cuda.current_device()]
    assert "<html" in _memory_viz.trace_plot(snapshot).lower()
