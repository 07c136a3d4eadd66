"""The activation-memory model against measurement, against the paper, and its refusals.

Every family x applicable recompute label is built on three shapes (the tiny size, MHA with dropout
at another sequence length, GQA with LayerNorm/GELU/shared experts; GDN on two shapes of its own),
on the unfused path and, where the label changes what attention saves, on SDPA too, and one
micro-batch's saved-for-backward ledger is measured in this process (``measured``); the prediction
must be within 5% of it, in total and per module kind. (On the CPU
it is exact today: the terms were read off this ledger, so a miss means the code that runs changed.
For GDN, whose CPU terms are fla's naive reference, the test asserts it byte for byte.)
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, compose, measured

from recipes.errors import ConfigError
from recipes.predict.compare import compare_result
from recipes.predict.estimate import in_flight_chunks, predict, rank_options
from recipes.predict.estimate_command import main
from recipes.predict.paper import paper_config, paper_terms_bytes, table2
from recipes.predict.static import num_parameters, static_bytes
from recipes.recompute import KINDS, options_for

COMMON = ["none", "control", "selective/core_attn", "selective/layernorm", "full"]
LABELS = {
    "standard_attn": COMMON + ["selective/mlp"],
    "mla": COMMON + ["selective/mlp", "selective/mla_up_proj", "selective/mla_up_proj-core_attn"],
    "moe": COMMON + ["selective/moe_act", "selective/moe", "selective/moe_act-layernorm"],
    "gdn": COMMON + ["selective/mlp", "selective/gdn_norm_out", "selective/gdn_norm_out-core_attn", "full/block"],
    # Issue 20 (every option of these: tests/test_models.py): a dense first layer, then MoE
    "mla_moe": ["none", "selective/mla_up_proj-moe_act", "selective/mlp", "full/block"],
    "gdn_moe": ["none", "selective/gdn_norm_out-moe_act", "selective/mlp"],
}
#: The layer pattern of the composed families in these tests: one dense layer, then MoE.
FAMILY_OVERRIDES = {"mla_moe": ["model.moe_layer_freq=[0,1]"], "gdn_moe": ["model.moe_layer_freq=[0,1]"]}
#: GDN's own shapes: sequences padded to 2 and 3 of the delta rule's 64-token chunks, one and three
#: sequences, value heads 2x and 1x the key heads, unequal head dims, conv widths, a LayerNorm, dropout.
GDN_SHAPES = {
    "gdn_s96_dropout": ["train.seq_length=96", "train.micro_batch_size=1", "model.hidden_size=96",
                        "model.num_attention_heads=6", "model.num_query_groups=null", "model.ffn_hidden_size=160",
                        "model.hidden_dropout=0.1", "model.attention_dropout=0.1", "model.num_layers=4",
                        "model.linear_attention_freq=2", "model.linear_num_key_heads=3",
                        "model.linear_num_value_heads=6", "model.linear_key_head_dim=8",
                        "model.linear_value_head_dim=12", "model.linear_conv_kernel_dim=3"],
    "gdn_s150_layernorm": ["train.seq_length=150", "train.micro_batch_size=3", "model.hidden_size=128",
                           "model.num_attention_heads=8", "model.num_query_groups=2", "model.ffn_hidden_size=192",
                           "model.normalization=LayerNorm", "model.gated_linear_unit=false", "model.num_layers=3",
                           "model.linear_attention_freq=3", "model.linear_num_key_heads=4",
                           "model.linear_num_value_heads=4", "model.linear_key_head_dim=16",
                           "model.linear_value_head_dim=8"],
}
SHAPES = {
    "tiny": [],
    "mha_dropout_s96": ["train.seq_length=96", "train.micro_batch_size=1", "model.hidden_size=96",
                        "model.num_attention_heads=6", "model.num_query_groups=null",
                        "model.ffn_hidden_size=160", "model.hidden_dropout=0.1",
                        "model.attention_dropout=0.1", "model.moe_router_topk=3",
                        "model.moe_ffn_hidden_size=48", "model.q_lora_rank=24", "model.v_head_dim=8"],
    "gqa_layernorm_gelu": ["train.seq_length=48", "train.micro_batch_size=3", "model.hidden_size=128",
                           "model.num_attention_heads=8", "model.num_query_groups=2",
                           "model.ffn_hidden_size=192", "model.normalization=LayerNorm",
                           "model.gated_linear_unit=false", "model.activation=gelu",
                           "model.moe_shared_expert_intermediate_size=64", "model.kv_lora_rank=24",
                           "model.qk_layernorm=true"],
    "fused_swiglu": ["model.bias_activation_fusion=true",  # megatron's bias_swiglu (a GPU's default)
                     "model.moe_shared_expert_intermediate_size=64"],
    **GDN_SHAPES,
}
#: Every label on the tiny size; on the other shapes, the labels whose terms depend on the shape.
OTHER_SHAPES = {
    "mha_dropout_s96": {"standard_attn": ["none", "selective/core_attn"],
                        "mla": ["none", "selective/mla_up_proj", "selective/core_attn"],
                        "moe": ["none", "selective/moe_act", "selective/core_attn"]},
    "gqa_layernorm_gelu": {"standard_attn": ["none", "full"], "mla": ["none", "selective/mla_up_proj"],
                           "moe": ["none", "selective/moe_act", "selective/shared_experts"],
                           "mla_moe": ["none", "selective/mla_up_proj-moe_act", "selective/shared_experts"]},
    "fused_swiglu": {"standard_attn": ["none"], "moe": ["selective/shared_experts"]},  # dense, expert, shared
    "gdn_s96_dropout": {"gdn": ["none", "selective/gdn_norm_out", "full/block"]},
    "gdn_s150_layernorm": {"gdn": ["none", "selective/gdn_norm_out", "selective/layernorm", "full/block"]},
}
CASES = [(family, label, "tiny") for family, labels in LABELS.items() for label in labels]
CASES += [(family, label, shape) for shape, by_family in OTHER_SHAPES.items()
          for family, labels in by_family.items() for label in labels]


def backend_matters(label: str) -> bool:
    """Whether attention's saved tensors under ``label`` are not those of ``none``: the label recomputes
    core attention (or the whole layer), or discards what feeds it (MLA's up-projections, which SDPA and
    the unfused path keep in different shapes). Elsewhere the backend changes the ledger by what it
    changes under ``none``."""
    return label == "none" or label.startswith("full") or "core_attn" in label or "mla_up_proj" in label


#: Each case on the unfused path; on SDPA too where ``backend_matters``. The other labels' SDPA
#: predictions are held to their unfused ones by test_the_backend_changes_a_label_as_it_changes_none.
MEASURED = [(*case, "unfused") for case in CASES]
MEASURED += [(*case, "sdpa") for case in CASES if backend_matters(case[1])]

def assert_close(predicted: dict, measured: dict, what: str, tol: float = 0.05) -> None:
    total_p, total_m = sum(predicted.values()), sum(measured.values())
    assert abs(total_p - total_m) <= tol * total_m, f"{what}: predicted {total_p}, measured {total_m}"
    for kind in KINDS:  # per kind: 5% of the kind, or 1% of the total for small kinds
        p, m = predicted[kind], measured.get(kind, 0)
        assert abs(p - m) <= max(tol * m, 0.01 * total_m), f"{what} [{kind}]: predicted {p}, measured {m}"


def _config(family: str, label: str, shape: str, backend: str) -> dict:
    return compose(f"model={family}", f"attention={backend}", f"recompute={label}", *SHAPES[shape],
                   *FAMILY_OVERRIDES.get(family, ()))


#: One worker runs these with tests/test_recompute_exact.py and tests/test_models.py: the points they
#: share (the tiny families' none, control, core_attn, mlp and full) are measured once (conftest.measured).
@pytest.mark.xdist_group("measured")
@pytest.mark.parametrize("family,label,shape,backend", MEASURED, ids=lambda x: str(x))
def test_prediction_matches_the_measured_ledger(megatron_world, family, label, shape, backend):
    cfg = _config(family, label, shape, backend)
    _, grads, ledger, _ = measured(cfg)
    predicted = predict(cfg, device="auto")  # what this machine ran: fp32 on a CPU, bf16 on a GPU
    assert_close(predicted["activation_bytes_by_kind"], ledger, f"{family} {label} {shape} {backend}")
    if family == "gdn" and predicted["device"] == "cpu":  # byte for byte, every kind
        assert predicted["activation_bytes_by_kind"] == {k: ledger.get(k, 0) for k in KINDS}
    assert sum(predicted["per_layer"][0].values()) > 0
    if label == "none" and predicted["device"] == "cpu":  # the count static memory is built on
        assert sum(num_parameters(cfg, 0)) == sum(g.numel() for g in grads.values())


@pytest.mark.parametrize("family,label,shape", [c for c in CASES if not backend_matters(c[1])], ids=lambda x: str(x))
def test_the_backend_changes_a_label_as_it_changes_none(family, label, shape):
    """A label measured on the unfused path only: on SDPA its prediction moves, kind by kind, by what
    SDPA moves ``none``'s (measured on both backends above), and nothing else changes."""
    def by_kind(label, backend):
        return predict(_config(family, label, shape, backend), device="cpu")["activation_bytes_by_kind"]

    none_u, none_s, unfused, sdpa = (by_kind(*a) for a in (("none", "unfused"), ("none", "sdpa"),
                                                           (label, "unfused"), (label, "sdpa")))
    assert {k: sdpa[k] - unfused[k] for k in KINDS} == {k: none_s[k] - none_u[k] for k in KINDS}
    assert any(none_s[k] != none_u[k] for k in KINDS)  # the backends differ here: the check can fail


@pytest.mark.parametrize("t,sp", [(1, False), (2, False), (2, True), (8, True)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("s,b,h,a", [(2048, 1, 1024, 16), (512, 4, 512, 8)])
def test_paper_table2_is_reproduced(s, b, h, a, t, sp, recompute):
    """Under the paper's assumptions the estimator's layer terms are Table 2, byte for byte, apart
    from the tensors the paper does not count (norm statistics, causal mask, mask-type int)."""
    p = predict(compose(*paper_config(s, b, h, a, t, sp, recompute)), device="cuda")
    counted, uncounted = paper_terms_bytes(p["layer_terms"])
    expected = table2(s, b, h, a, t, sp, recompute)
    if recompute == "full" and sp:  # megatron keeps only the input's sequence shard
        expected = 2 * s * b * h / t
    assert counted == expected
    norms = 0 if recompute == "full" else 2 * 8 * s * b // (t if sp else 1)
    mask = s * s if recompute == "none" else 0
    assert uncounted == norms + mask + (4 if recompute == "selective" else 0)


def test_modern_models_depart_from_the_paper():
    """The h200 size (8 layers, h 2048, 16 heads, s 4096, b 2): about 4 GiB a layer (measured on an H200,
    unfused SwiGLU) against the paper's 3.03."""
    p = predict(compose("size=h200", "attention=unfused", "model.attention_softmax_in_fp32=true",
                        "model.bias_activation_fusion=false"), "cuda")
    per_layer = sum(p["per_layer"][0].values()) / 2**30
    assert abs(table2(4096, 2, 2048, 16) / 2**30 - 3.03) < 0.01
    assert 3.8 < per_layer < 4.1


@pytest.mark.parametrize("pp,vpp,m", [(4, None, 8), (4, 2, 8), (8, 4, 16), (2, None, 1)])
def test_first_stage_holds_the_papers_in_flight_microbatches(pp, vpp, m):
    chunks = in_flight_chunks(pp, vpp, 0, m)
    v = vpp or 1
    paper = min(pp, m) if v == 1 else pp * (1 + (pp - 1) / (pp * v))
    assert len(chunks) / v == pytest.approx(paper)
    assert len(in_flight_chunks(pp, vpp, pp - 1, m)) <= len(chunks)


def test_static_bytes_distributed_optimizer_and_cpu_adamw():
    cfg = compose("model=moe", "size=h200")
    dense, experts = num_parameters(cfg, 0)
    gpu, cpu = static_bytes(cfg, "cuda"), static_bytes(cfg, "cpu")
    assert gpu["params"] + gpu["grads"] + gpu["optimizer"] == 18 * (dense + experts)  # dp = 1
    assert cpu["params"] + cpu["grads"] + cpu["optimizer"] == 16 * (dense + experts)  # fp32 AdamW
    dp4 = static_bytes(compose("model=moe", "size=h200", "launcher.nproc_per_node=4"), "cuda")
    assert dp4["optimizer"] == 12 * (dense + experts) // 4


@pytest.mark.parametrize("overrides,option", [
    (["attention=te"], "attention=te"),
    (["attention.backend=flash"], "attention"),
    (["model=moe", "model.moe_token_dispatcher_type=alltoall"], "model.moe_token_dispatcher_type"),
    (["model=moe", "model.moe_token_dispatcher_type=allgather", "model.moe_expert_capacity_factor=1.0"],
     "model.moe_expert_capacity_factor"),
    (["model.normalization=Foo"], "model.normalization"),
    (["parallel=cp2"], "parallel.context_parallel_size"),
    (["parallel=cp2", "attention=te"], "attention=te"),
    (["model=gdn", "parallel=tp2"], "parallel.tensor_model_parallel_size"),
    (["model=gdn", "model.normalization=LayerNorm"], "model.normalization"),
    (["model=gdn", "model.activation=gelu"], "model.activation"),
    (["model=gdn", "attention=unfused", "train.precision=fp32"], "train.precision"),
])
def test_unmodeled_configs_are_refused_by_name(overrides, option):
    with pytest.raises(ConfigError) as info:
        predict(compose(*overrides), device="cuda")
    assert info.value.option == option


def test_rank_options_are_predicted_and_sorted():
    ranked = rank_options(["model=standard_attn", "attention=unfused", "size=h200"])
    names = [name for name, _ in ranked]
    assert set(names) <= set(options_for("standard_attn")) and "full" in names
    assert [b for _, b in ranked] == sorted(b for _, b in ranked)
    assert names.index("full") < names.index("selective/core_attn") < names.index("none")
    cfg = compose("model=moe", "size=h200")
    assert "selective/shared_experts" not in [n for n, _ in rank_options(cfg)]  # no shared experts


def test_command_line(capsys):
    assert main(["model=moe", "recompute=selective/moe_act", "size=h200", "--budget-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "PREDICTED" in out and "fits" in out and "moe" in out
    assert main(["model=mla", "size=h200", "--all", "--budget-gib", "1"]) == 0
    out = capsys.readouterr().out
    assert "selective/mla_up_proj" in out and " over" in out
    assert main(["attention=te"]) == 2


@pytest.mark.slow
def test_tensor_and_sequence_parallel_ranks_match(tmp_path):
    """TP2 with sequence parallel in 2 gloo processes: MLA's gathered and re-sharded latents, the
    sequence-sharded norms and dropout, the vocab-parallel embedding and loss, per rank."""
    cmd = [sys.executable, "train.py", "parallel=tp2", "model=mla", "recompute=selective/mla_up_proj",
           "model.hidden_dropout=0.1", "train.train_iters=2", "measure.start_step=2",
           "measure.profile=none", f"output_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "result.json").read_text())
    for rank in result["ranks"]:
        predicted = predict(result["config"], device="auto", stage=rank["coords"]["pp"])
        assert_close(predicted["activation_bytes_by_kind"], rank["ledger"]["bytes_by_kind"], "tp2 mla")
        assert sum(num_parameters(result["config"], 0)) == rank["num_parameters"]
    rows = compare_result(result, "tp2")  # what `python -m recipes estimate --compare DIR` prints
    assert len(rows) == 2 and all(r["predicted_ledger_bytes"] == r["measured_ledger_bytes"] for r in rows)


@pytest.mark.slow
@pytest.mark.xdist_group("two-ranks-pp2_vpp2")
def test_gdn_layer_pattern_across_interleaved_pipeline_ranks(shared_runs):
    """model=gdn under pp2_vpp2 in 2 gloo processes (test_parallel's run, shared with its chunk
    bookkeeping): which layers are GatedDeltaNet follows the global layer index (rank 0 holds GDN, GDN |
    GDN, attention; rank 1 attention, GDN | GDN, GDN), per rank byte for byte, parameters included."""
    from test_parallel import interleaved_gdn_run

    result = interleaved_gdn_run(shared_runs)
    for rank in result["ranks"]:
        predicted = predict(result["config"], device="auto", stage=rank["coords"]["pp"])
        assert predicted["activation_bytes_by_kind"] == {k: rank["ledger"]["bytes_by_kind"].get(k, 0) for k in KINDS}
        assert sum(num_parameters(result["config"], rank["coords"]["pp"])) == rank["num_parameters"]


# --- expert parallel: the routed share (issue 23) ---------------------------------------------------

#: The per-routed-row terms of an MoE layer: what follows the routing under expert parallel.
ROUTED = ("permutation indices (int64)", "expert fc1 input (permuted)", "permuted probs", "expert fc1 output",
          "expert activation output", "expert x_linear + offset", "expert activation before the router prob",
          "expert fc2 input", "expert fc1 output (fused SwiGLU input)", "routed probs' gather indices (int64)")


def test_routed_share_scales_only_the_routed_rows_under_expert_parallel(capsys):
    from recipes.predict.activations import balanced_rows, routed_rows
    from recipes.predict.dims import dims

    cfg = compose("model=moe", "size=h200", "parallel=ep2")
    balanced, bound = predict(cfg, "cuda", routed_share=1), predict(cfg, "cuda")  # default: the bound
    assert bound["routed_share"] == 1.5 and balanced["routed_share"] == 1.0
    n = balanced_rows(dims(cfg, "cuda"))
    for (_kind, what, b), (_, what2, p) in zip(balanced["layer_terms"], bound["layer_terms"]):
        assert what == what2
        if what in ROUTED:  # bytes per row x ceil(1.5 n)
            assert p * n == b * routed_rows(dims(cfg, "cuda", 1.5)) and p > b, what
        else:  # the router's tensors, local routing map and probs: per gathered token, unscaled
            assert p == b, what
    assert dims(cfg, "cuda", 100).routed_share == 100 and routed_rows(dims(cfg, "cuda", 100)) == 2 * n  # every token
    assert main(["model=moe", "size=h200", "parallel=ep2", "--all"]) == 0
    assert "the worst EP rank, priced at 1.5x balanced routing: a BOUND" in capsys.readouterr().out


def test_without_expert_parallel_the_share_changes_nothing():
    for overrides in (("model=moe", "size=h200"), ("model=moe", "size=h200", "parallel=tp2")):
        cfg = compose(*overrides)
        assert predict(cfg, "cuda", routed_share=3.0) == predict(cfg, "cuda")
        assert predict(cfg, "cuda")["routed_share"] is None


def test_the_imbalance_bound_is_a_config_field():
    cfg = compose("model=moe", "size=h200", "parallel=ep2", "estimate.moe_imbalance=1.2")
    assert predict(cfg, "cuda")["routed_share"] == 1.2
    assert predict(cfg, "cuda")["peak_bytes"] < predict(compose("model=moe", "size=h200", "parallel=ep2"),
                                                        "cuda")["peak_bytes"]
    with pytest.raises(ConfigError) as info:
        predict(compose("model=moe", "parallel=ep2", "estimate.moe_imbalance=0.9"), "cpu")
    assert info.value.option == "estimate.moe_imbalance"


def test_recorded_rows_price_each_layer(tmp_path):
    """A rank's recorded rows (``moe_routing``) price its ledger layer by layer, exactly; its peak at
    the timed steps' worst micro-batch."""
    from recipes.predict.activations import balanced_rows
    from recipes.predict.compare import recorded_shares
    from recipes.predict.dims import dims

    cfg = compose("model=moe", "parallel=ep2")
    n, layers = balanced_rows(dims(cfg, "cpu")), cfg["model"]["num_layers"]
    rows = [n - 3 + 2 * i for i in range(layers)]
    ledger, peak = recorded_shares(cfg, "cpu", {"moe_routing": {"layers": layers, "ledger_rows": rows,
                                                               "max_rows_per_step": [sum(rows), layers * n + 7]}})
    assert [f * n for f in ledger] == rows and peak * n * layers == layers * n + 7
    per_layer = predict(cfg, "cpu", stage=0, routed_share=ledger)["per_layer"]
    flat = predict(cfg, "cpu", stage=0, routed_share=1)["per_layer"]
    per_row = (per_layer[1]["moe"] - per_layer[0]["moe"]) // 2  # the layers' rows differ by 2
    assert per_row > 0
    assert [p["moe"] - f["moe"] for p, f in zip(per_layer, flat)] == [(r - n) * per_row for r in rows]
    assert recorded_shares(compose("model=moe"), "cpu", {"moe_routing": {"layers": 2}}) == (None, None)  # EP 1
