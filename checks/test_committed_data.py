"""Checks of the committed GPU evidence (docs/evidence/*.jsonl.gz): what it holds, not what the code does.

    make check-data          # = .venv/bin/python -m pytest -q checks, then tools/evidence.py tables --check

These re-read the measurements and hold the docs' claims and the project's constants to them: every
(family, option) pair has a GPU row, full/block is linear in the layers it recomputes, layernorm
frees one hidden state per norm, the GDN table, the allocator, expert-parallel and offload slacks
(``recipes.predict.fit``) cover every point they were measured on, and every evidence table
(docs/evidence/<name>.md) is what its evidence renders. The tests of the code that reads this data
(estimator, advisor, MFU table) are in tests/test_h200_results.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tools")]

import evidence  # noqa: E402  (tools/, after the repo is on sys.path)

from recipes.analyze.candidates import measured_candidates  # noqa: E402
from recipes.offload import modules_of  # noqa: E402
from recipes.predict.fit import ALLOCATOR_SLACK, EP_MOE_SLACK, slack_for  # noqa: E402
from recipes.recompute import BASE_FAMILIES as FAMILIES  # noqa: E402  (the measured ones; mla_moe, gdn_moe: no H200 rows yet)
from recipes.recompute import LABELS, conf_options, selective_labels  # noqa: E402

H200 = evidence.load("h200")
RESULTS = H200.results()
FUSED_ADAM = [r for r in RESULTS if r["config"]["train"].get("fused_adam")]


def _measured_pairs() -> dict[tuple[str, str], list[dict]]:
    """(model, recompute option) -> results at the h200 size (size=h200: 8 layers, h 2048, s 4096, b 2)."""
    pairs: dict[tuple[str, str], list[dict]] = {}
    for result in RESULTS:
        choices = result["choices"]
        if choices["size"] == "h200":
            pairs.setdefault((choices["model"], choices["recompute"]), []).append(result)
    return pairs


def test_the_h200_results_are_there():
    assert len(RESULTS) >= 40 and all(r["ranks"] for r in RESULTS)


@pytest.mark.parametrize("name", evidence.names())
def test_every_evidence_file_says_how_where_and_when_it_was_measured(name):
    """The header names the commands, the date and the GPU; each point record names its sweep and point."""
    ev = evidence.load(name)
    assert ev.header["commands"] and ev.header["date"] and ev.header["gpu"]
    assert all(r["sweep"] and r["point"] and r["result"]["ranks"] is not None for r in ev.points())
    assert ev.header["points"] == len(ev.points())


def test_every_evidence_table_regenerates_identically():
    """docs/evidence/<name>.md is what tools/evidence.py renders from <name>.jsonl.gz: the sweep
    reports (``python -m recipes report``'s table and notes) and the quoted console output."""
    stale = []
    assert evidence.tables(check=True, out=stale.append) == 0, stale


def test_every_family_option_pair_that_applies_has_an_h200_row():
    """Every recompute option in conf/ whose labels all apply to a family (recipes.recompute's LABELS)
    ran on the H200 at size=h200 and finished; an option added without a GPU row fails."""
    measured = _measured_pairs()
    missing = [(family, option) for family in FAMILIES for option in conf_options()
               if all(family in LABELS[label].families for label in selective_labels(option) or ())
               and not any(r["status"] == "ok" for r in measured.get((family, option), []))]
    assert not missing, f"no H200 row for {missing}: run benchmarks/gpu_suite.sh labels:<family>"


def test_full_block_peak_is_linear_in_the_layers_recomputed():
    """4 of 8 layers under full/block land on the midpoint of the control and full recompute."""
    measured = _measured_pairs()
    for family in FAMILIES:
        peak = {o: min(r["ranks"][0]["memory"]["peak_allocated_gib"] for r in measured[(family, o)]
                       if r["config"]["train"].get("fused_adam"))
                for o in ("control", "full", "full/block")}
        block = measured[(family, "full/block")][0]["config"]["recompute"]
        assert block["recompute_method"] == "block" and block["recompute_num_layers"] == 4
        midpoint = (peak["control"] + peak["full"]) / 2
        assert abs(peak["full/block"] - midpoint) < 0.06, (family, peak)


def test_layernorm_frees_one_hidden_state_per_norm_on_every_family():
    """selective/layernorm's ledger saving is 2 norms x L layers x one [s, b, h] bf16 tensor, against
    the control of the same sweep (the norms' fp32 statistics add well under 1%)."""
    for family in FAMILIES:
        sweep = next(p["sweep"] for p in H200.points() if p["sweep"].startswith(("sweep_", "labels_"))
                     and p["result"]["choices"]["recompute"] == "selective/layernorm"
                     and p["result"]["choices"]["model"] == family)
        ledger, cfg = {}, None
        for result in H200.results(sweep):
            ledger[result["choices"]["recompute"]] = result["ranks"][0]["ledger"]["total_bytes"]
            cfg = result["config"]
        m, t = cfg["model"], cfg["train"]
        norms = 2 * m["num_layers"] * t["seq_length"] * t["micro_batch_size"] * m["hidden_size"] * 2
        saved = ledger["control"] - ledger["selective/layernorm"]
        assert norms <= saved < norms * 1.01, (family, saved, norms)


def test_gdn_table_gdn_norm_out_saves_what_core_attn_does_not(tmp_path):
    """The GDN table (fla kernels, Triton 3.7.1): gdn_norm_out lowers the ledger and the peak;
    core_attn under SDPA saves nothing."""
    rows = {c["recompute"]: c for c in measured_candidates(H200.sweep_dir("sweep_gdn", tmp_path))}
    assert all(c["status"] == "ok" for c in rows.values()) and len(rows) == 6
    assert rows["selective/gdn_norm_out"]["d_peak_gib"] < -0.3 and rows["selective/gdn_norm_out"]["d_ledger_pct"] < -3
    assert abs(rows["selective/core_attn"]["d_peak_gib"]) < 0.01


def test_allocator_slack_covers_every_measured_row():
    """recipes.predict.fit.ALLOCATOR_SLACK (what a predicted peak needs on top to fit) covers reserved
    over allocated on every fused-Adam H200 point."""
    for result in FUSED_ADAM:
        for rank in result["ranks"]:
            if rank.get("status") == "ok":
                m = rank["memory"]
                assert m["peak_reserved_gib"] <= m["peak_allocated_gib"] * (1 + ALLOCATOR_SLACK), result["name"]


def test_the_expert_parallel_slack_covers_every_ep_rank_on_two_h200s():
    """recipes.predict.fit.EP_MOE_SLACK covers reserved over allocated on every MoE rank under expert
    parallel measured on two H200s (up to 1.166x, ep2 none rank 0), which the 8.5% does not."""
    ratios = [r["memory"]["peak_reserved_gib"] / r["memory"]["peak_allocated_gib"]
              for result in evidence.load("h200x2").results() if slack_for(result["config"]) == EP_MOE_SLACK
              for r in result["ranks"] if r.get("status") == "ok" and r.get("memory")]
    assert len(ratios) >= 7 and max(ratios) <= 1 + EP_MOE_SLACK
    assert max(ratios) > 1 + ALLOCATOR_SLACK


OFFLOAD = evidence.load("offload-h200")


def test_every_family_offload_option_pair_measured_has_its_saving_and_cost():
    """The offload sweeps at the h200 size: dense, MoE and MLA each ran without offload and with
    several offload options; every such point finished with its peak, host bytes and step time."""
    for sweep, least in (("standard_attn_h200", 5), ("moe_h200", 4), ("mla_h200", 3)):
        points = OFFLOAD.results(sweep)
        offloading = [r for r in points if modules_of(r["config"])]
        assert len(offloading) >= least and len(points) > len(offloading), sweep
        for r in points:
            rank = r["ranks"][0]
            assert r["status"] == "ok" and rank["memory"]["peak_allocated_gib"] > 0, r["name"]
            assert rank["timing"]["step_time_s"] > 0, r["name"]
            assert not modules_of(r["config"]) or rank["ledger"]["host_total_bytes"] > 0, r["name"]


def test_the_offload_slack_covers_every_measured_offload_point():
    """recipes.predict.fit.slack_for, on the estimator's predicted peak as the planner applies it, covers
    the reserved peak of every activation-offload point measured on one H200 without a memory cap
    (under a cap the allocator frees its cache to stay below it, so reserved measures the cap) and
    without allocator retries (``memory.alloc_retries``: the device itself was full, as at the
    h200_long size's MoE offload, 137.3 of 139.8 GiB reserved; the same plan fits under a 137 GiB cap,
    fused_rope_h200_long/moe_capped); ALLOCATOR_SLACK alone does not."""
    from recipes.config import upgrade
    from recipes.predict.estimate import predict

    needed = []
    for data in OFFLOAD.results():
        cfg = upgrade(data["config"])
        if cfg["measure"]["memory_budget_gib"] is not None or cfg["measure"]["memory_fraction"] is not None:
            continue
        for rank in data["ranks"]:
            if rank.get("status") == "ok" and rank.get("memory") and modules_of(cfg) \
                    and not rank["memory"].get("alloc_retries"):
                predicted = predict(cfg, "cuda")["peak_bytes"] / 2**30
                needed.append(rank["memory"]["peak_reserved_gib"] / predicted - 1)
                assert needed[-1] <= slack_for(cfg), data["name"]
    assert len(needed) >= 40 and max(needed) > ALLOCATOR_SLACK


def test_the_mla_offload_sweep_is_predicted():
    """MLA's offload points (one H200, 2026-12-05), each a fresh process: every point's peak predicted
    within 1% and each offload point's host bytes exactly (MLA's qkv_linear copies its input once for
    each down-projection, and RoPE's cos and sin stay, each below offload.min_offloaded_tensor_size)."""
    from recipes.config import upgrade
    from recipes.predict.estimate import predict

    points = OFFLOAD.results("mla_h200")
    assert len(points) == 8
    for data in points:
        cfg, rank = upgrade(data["config"]), data["ranks"][0]
        p = predict(cfg, "cuda")
        assert abs(p["peak_bytes"] / 2**30 / rank["memory"]["peak_allocated_gib"] - 1) < 0.01, data["name"]
        if modules_of(cfg):
            assert p["host_bytes"] == rank["ledger"]["host_total_bytes"], data["name"]


@pytest.mark.parametrize("name", [n for n in evidence.names() if n.startswith("planner-")])
def test_every_planner_verdict_held_on_its_gpu(name, tmp_path):
    """Every top point a plan called fitting that ran did not run out of memory (a refused one, such as
    GDN on a Triton too old for Hopper, never started), and every point planned past its budget that
    today's estimator calls ``over`` ran out of memory."""
    from recipes.predict.fit import OVER

    ev = evidence.load(name)
    for r in ev.records:
        if r.get("file", "").endswith(".plan.json"):
            question = r["file"][: -len(".plan.json")]
            ran = {next(o for o in p["overrides"] if o.startswith("+point="))[7:]: p["result"]["status"]
                   for p in ev.points(question)}
            for top in r["json"]["top"]:
                assert top["fits"] and ran.get(top["point"]) != "oom", (question, top["point"])
    for o in evidence.over_points(ev, tmp_path):
        assert o["verdict"] != OVER or o["status"] == "oom", o
