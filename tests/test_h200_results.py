"""The committed H200 measurements (docs/h200/, 2026-11-29) hold the tools to account on CPU.

These results came from real runs (`bash benchmarks/gpu_suite.sh ...`, see docs/h200-results.md);
CI has no GPU, so these tests use them as fixtures: the estimator must stay within its accuracy
targets against every measured row, the one fit rule must never call the point that ran out of
memory a fit, and the advisor and the MFU table must keep reading them as the docs say. A change to
the estimator's terms that breaks agreement with the GPU fails here. The checks of the data itself
(every pair measured, the docs' claims, short names and manifests, reports that regenerate) are
checks/test_committed_data.py (`make check-data`).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import REPO

from recipes.analyze.advise import (
    advise,
    advise_before_running,
    explain,
    measured_candidates,
    predicted_candidates,
)
from recipes.predict import estimate
from recipes.predict.estimate import compare_result, predict
from recipes.predict.fit import FITS, fits, verdict
from recipes.results import first_sentence

H200 = REPO / "docs" / "h200"
RESULTS = sorted(H200.rglob("result.json"))
#: Every family is checked, GatedDeltaNet hybrids (model=gdn) too.
MODELED = RESULTS
FUSED_ADAM = [p for p in MODELED if json.loads(p.read_text())["config"]["train"].get("fused_adam")]
GDN = [p for p in RESULTS if json.loads(p.read_text())["config"]["model"]["family"] == "gdn"]
#: Test ids: sweep/point (point directories are short: recipes.config.slug, at most 64 characters).
POINT_ID = lambda p: f"{p.parent.parent.name}/{p.parent.name}"  # noqa: E731


@pytest.mark.parametrize("path", MODELED, ids=POINT_ID)
def test_estimator_against_every_measured_h200_row(path):
    """Issue 5's targets: ledger within 5%, peak allocated within 10% of max_memory_allocated."""
    result = json.loads(path.read_text())
    for row in compare_result(result):
        ledger_err = row["predicted_ledger_bytes"] / row["measured_ledger_bytes"] - 1
        peak_err = row["predicted_peak_gib"] / row["measured_peak_gib"] - 1
        assert abs(ledger_err) < 0.05, f"ledger {ledger_err:+.1%}"
        assert abs(peak_err) <= 0.10, f"peak {peak_err:+.1%}"


@pytest.mark.parametrize("path", GDN, ids=POINT_ID)
def test_estimator_matches_the_gdn_h200_rows_byte_for_byte(path):
    """GDN's terms on CUDA were derived from fla's and megatron's saved tensors: every module kind of
    the ledger (the 6 GDN layers' `gdn` bytes among them) and its total are predicted to the byte."""
    result = json.loads(path.read_text())
    for rank in result["ranks"]:
        predicted = predict(result["config"], "cuda", stage=rank["coords"]["pp"])
        assert predicted["activation_bytes_by_kind"] == rank["ledger"]["bytes_by_kind"]
        assert predicted["activation_bytes"] == rank["ledger"]["total_bytes"]
        assert predicted["static"]["num_parameters"] == rank["num_parameters"]


@pytest.mark.parametrize("path", FUSED_ADAM, ids=POINT_ID)
def test_estimator_peak_within_one_percent_with_fused_adam(path):
    """The runs with the default optimizer kernel (Runs B-D) are predicted within 1%: this holds only
    with the head freed before the last layer's backward (without it, full recompute is +6.7% dense,
    +6.8% MLA, +7.6% at h200_long) and with the MoE dispatcher fix measured (Run A: -10%)."""
    for row in compare_result(json.loads(path.read_text())):
        assert abs(row["predicted_peak_gib"] / row["measured_peak_gib"] - 1) <= 0.01


def test_advisor_picks_mlp_where_none_does_not_fit_at_the_realistic_size():
    advice = advise(measured_candidates(H200 / "long_standard_attn"), 137.0)
    assert advice["choice"]["recompute"] == "selective/mlp"
    assert {c["recompute"] for c in advice["not_fitting"]} >= {"none", "control"}  # real OOMs
    text = explain(advice, "long")
    assert "ran out of memory" in text and "Failed to CUDA calloc" in text


def test_advisor_budget_that_forces_a_choice_at_the_facts_shape():
    advice = advise(measured_candidates(H200 / "sweep_standard_attn"), 18.0)
    assert advice["choice"]["recompute"] == "selective/mlp" and not advice["fragmentation"]


def test_advisor_picks_gdn_norm_out_over_its_noisy_superset():
    """Issue 11's GPU table: the advisor picks the narrow label over its superset, which measured
    faster only within the noise."""
    advice = advise(measured_candidates(H200 / "sweep_gdn"), 25.2)
    assert advice["choice"]["recompute"] == "selective/gdn_norm_out"
    assert [c["recompute"] for c in advice["superfluous"]] == ["selective/gdn_norm_out-core_attn"]


def test_first_sentence_keeps_what_was_asked_and_drops_torchs_advice():
    oom = ("CUDA out of memory. Tried to allocate 128.00 MiB. GPU 0 has a total capacity of 139.80 GiB "
           "of which 42.12 MiB is free. If reserved but unallocated memory is large try ...")
    assert first_sentence(oom) == "CUDA out of memory. Tried to allocate 128.00 MiB."
    assert first_sentence("Failed to CUDA calloc async 608 bytes\nmore") == "Failed to CUDA calloc async 608 bytes"
    assert first_sentence(None) == ""


def _bench_mfu():
    spec = importlib.util.spec_from_file_location("bench_mfu", REPO / "benchmarks" / "bench_mfu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_mfu_table_from_measured_sweeps_takes_the_narrowest_fitting_option():
    bench = _bench_mfu()
    rows = bench.rows_from_results([H200 / "long_standard_attn"])
    assert [r["recompute"] for r in rows] == ["selective/mlp", "selective/core_attn", "full"]
    table = bench.table(rows)
    assert "| standard_attn | selective/mlp | ok | 1556.6 |" in table and "| oom |" in table


def test_mfu_table_keeps_two_sizes_of_one_family_apart():
    bench = _bench_mfu()
    rows = bench.rows_from_results([H200 / "sweep_standard_attn", H200 / "long_standard_attn"])
    assert [(r["family"], r["recompute"]) for r in rows] == [
        ("standard_attn (size=h200)", "none"), ("standard_attn (size=h200)", "selective/core_attn"),
        ("standard_attn (size=h200)", "full"), ("standard_attn (size=h200_long)", "selective/mlp"),
        ("standard_attn (size=h200_long)", "selective/core_attn"), ("standard_attn (size=h200_long)", "full")]


def _oom_point() -> tuple[dict, list[str]]:
    """The committed point that ran out of memory (confirm_long) and its overrides (the manifest's)."""
    sweep = H200 / "confirm_long"
    manifest = json.loads((sweep / "manifest.json").read_text())
    point = next(name for name, entry in manifest.items() if entry["status"] == "oom")
    return json.loads((sweep / point / "result.json").read_text()), manifest[point]["overrides"]


def test_the_block_that_ran_out_of_memory_is_not_predicted_to_fit():
    """2026-11-29, H200: `--predict` once offered full/block over 5 of 32 layers at size=h200_long for
    139 GiB (predicted 136.02 GiB allocated). It ran out of memory asking for 4 GiB at 131.96 GiB
    allocated: the estimator was right about the bytes, the fit rule had no room for the allocator."""
    result, overrides = _oom_point()
    failure = result["ranks"][0]["memory_at_failure"]
    predicted = predict(result["config"], "cuda")["peak_bytes"] / 2**30
    assert abs(predicted / (failure["allocated_gib"] + 4.0) - 1) < 0.01  # what it was about to hold
    assert not fits(predicted, 139.0)
    block = next(r for r in advise_before_running(overrides, 139.0)["options"] if r["recompute"] == "full/block")
    assert block["recompute_num_layers"] > result["config"]["recompute"]["recompute_num_layers"]


def test_the_oom_point_is_never_said_to_fit_by_any_tool(capsys):
    """Issue 17: one fit rule. The committed OOM point (full/block over 5 of 32 layers at
    size=h200_long, 139 GiB H200) is "tight" or "over" in recipes.predict.fit, in `python -m recipes
    estimate --budget-gib 139` (one option and --all) and in the advisor, before and after running."""
    result, overrides = _oom_point()
    assert result["status"] == "oom" and result["config"]["recompute"]["recompute_num_layers"] == 5
    assert "recompute=full/block" in overrides and "size=h200_long" in overrides

    # the rule itself, on the estimator's prediction
    peak = predict(result["config"], "cuda")["peak_bytes"] / 2**30
    assert verdict(peak, 139.0) in ("tight", "over")

    # the estimator's command line, one option: the budget line's verdict
    assert estimate.main([*overrides, "--budget-gib", "139"]) == 0
    budget_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("budget 139 GiB"))
    assert ("TIGHT" in budget_line or "does NOT fit" in budget_line) and ": fits (" not in budget_line

    # ... and every option: full/block's row
    assert estimate.main([*overrides, "--budget-gib", "139", "--all"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("full/block "))
    assert row.split()[-1] in ("tight", "over")

    # the advisor before running: it never offers 5 layers, and nothing it calls a fit is tight
    before = advise_before_running(overrides, 139.0)
    block = next(r for r in before["options"] if r["recompute"] == "full/block")
    assert block["recompute_num_layers"] > 5 and block["fits"]  # the fewest layers that do fit
    assert all(verdict(r["predicted_peak_gib"], 139.0) == FITS for r in before["options"] if r["fits"])

    # the advisor after running: the measured OOM is not fitting, never the choice
    after = advise(measured_candidates(H200 / "confirm_long"), 139.0)
    assert after["choice"]["recompute"] == "selective/mlp"
    assert [c["recompute"] for c in after["not_fitting"]] == ["full/block"]


def test_sweep_advice_prices_the_unmeasured_block_at_the_fewest_layers_that_fit():
    """The realistic-size sweep measured no full/block: the advice lists it at the fewest layers that
    fit 137 GiB with the allocator's slack, with the overrides that run it (never as the choice)."""
    sweep = H200 / "long_standard_attn"
    predicted = predicted_candidates(sweep, 137.0)
    block = next(c for c in predicted if c["recompute"] == "full/block")
    assert block["recompute_num_layers"] == 8 and block["memory_gib"] <= 137.0
    advice = advise(measured_candidates(sweep) + predicted, 137.0)
    assert advice["choice"]["recompute"] == "selective/mlp"
    assert "worth a run (recompute=full/block recompute.recompute_num_layers=8)" in explain(advice, str(sweep))
