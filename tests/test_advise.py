"""The advisor and the report on recorded results: synthetic sweeps written through the real schema.

Each point is written the way a sweep writes it: worker rank files (``ranks/rank<N>.json``) merged
by ``recipes.results.merge_result`` into ``result.json``. The numbers are measured H200 rows (the h200 size: 8 layers, h 2048, s 4096, b 2)
(dense, unfused vs SDPA), plus an ``oom`` point and a second rank where the tests need one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import compose

from recipes.analyze import advise, candidates, explain, pareto, predicted, report
from recipes.analyze.plan import explain_plan
from recipes.analyze.sweep import find_results, merge_module_times, merge_repeats

#: (attention, recompute): (peak allocated GiB, peak reserved GiB, step s); None = out of memory.
from recipes.files import GIB, MIB, write_json_atomic
from recipes.predict.fit import fits
from recipes.results import merge_result

H200_DENSE = {
    ("unfused", "none"): (38.9, 39.7, 0.196),
    ("unfused", "control"): (38.9, 39.8, 0.197),
    ("unfused", "selective/core_attn"): (18.0, 18.6, 0.247),
    ("unfused", "selective/mlp"): (37.2, 40.7, 0.203),
    ("unfused", "selective/layernorm"): None,
    ("unfused", "full"): (13.3, 17.4, 0.266),  # fragmented: 4.1 GiB reserved above allocated
    ("sdpa", "none"): (10.7, 11.0, 0.077),
    ("sdpa", "control"): (10.7, 11.0, 0.078),
    ("sdpa", "selective/core_attn"): (10.7, 11.0, 0.080),
}
_CONFIG = {}


def _config(attention: str, recompute: str) -> dict:
    """A real resolved config for the point (composed once per choice pair)."""
    key = (attention, recompute)
    if key not in _CONFIG:
        _CONFIG[key] = compose(f"attention={attention}", f"recompute={recompute}", "size=h200")
    return _CONFIG[key]


def rank_result(rank: int, measured: tuple | None, ledger_bytes: int | None = None) -> dict:
    """One worker rank file: ``measured`` = (allocated, reserved, step s) on a GPU, None = oom."""
    result = {"rank": rank, "status": "ok", "host": "h200", "device": "NVIDIA H200",
              "ledger": {"bytes_by_kind": {}, "total_bytes": ledger_bytes}}
    if measured is None:
        msg = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.80 GiB"
        result.update(status="oom", error=msg, memory_at_failure={
            "allocated_gib": 70.1, "reserved_gib": 71.0, "peak_allocated_gib": 70.1, "peak_reserved_gib": 71.0})
        return result
    alloc, reserved, step = measured
    if alloc is not None:
        result["memory"] = {"peak_allocated_gib": alloc, "peak_reserved_gib": reserved,
                            "static_allocated_gib": 2.0, "activation_gib": alloc - 2.0,
                            "fragmentation_gib": reserved - alloc, "total_gib": 139.8}
    result["timing"] = {"steps": 5, "step_time_s": step, "tokens_per_s": 8192 / step, "mfu": 0.3}
    return result


def write_point(sweep: Path, attention: str, recompute: str, ranks: list[dict]) -> Path:
    """A sweep point directory holding result.json, merged from rank files like the controller does."""
    run_dir = sweep / f"attention={attention}__recompute={recompute.replace('/', '.')}"
    for r in ranks:
        write_json_atomic(run_dir / "ranks" / f"rank{r['rank']}.json", r)
    meta = {"name": f"standard_attn {attention} {recompute}", "run_dir": str(run_dir),
            "choices": {"model": "standard_attn", "attention": attention, "recompute": recompute},
            "config": _config(attention, recompute)}
    write_json_atomic(run_dir / "result.json", merge_result(run_dir, meta, len(ranks), None))
    return run_dir


def make_sweep(root: Path, attentions=("unfused",), second_rank: dict | None = None) -> Path:
    """The H200 dense sweep; ``second_rank`` maps recompute -> rank-1 numbers (else one rank)."""
    for (attention, recompute), measured in H200_DENSE.items():
        if attention in attentions:
            ranks = [rank_result(0, measured)]
            if second_rank and recompute in second_rank:
                ranks.append(rank_result(1, second_rank[recompute]))
            write_point(root, attention, recompute, ranks)
    return root


def run_advise(sweep: Path, budget: float) -> tuple[dict, str]:
    advice = advise.advise(candidates.measured_candidates(sweep), budget)
    return advice, explain.explain(advice, str(sweep))


def test_picks_narrow_label_over_full_and_flags_fragmentation(tmp_path):
    advice, text = run_advise(make_sweep(tmp_path), budget=20)
    assert advice["device"] == "gpu"
    assert advice["choice"]["recompute"] == "selective/core_attn"  # full fits too, but it is last
    assert [f["recompute"] for f in advice["full_fitting"]] == ["full"]
    assert advice["choice"]["d_peak_gib"] == pytest.approx(18.0 - 38.9)  # against control
    assert advice["choice"]["d_time_pct"] == pytest.approx((0.247 / 0.197 - 1) * 100)
    assert advice["choice"]["control"] == "standard_attn unfused control"
    frag = advice["fragmentation"]
    assert [(f["recompute"], round(f["fragmentation_gib"], 2)) for f in frag] == [("full", 4.1)]
    assert "expandable_segments" in text and "4.10 GiB" in text
    assert "saves 20.90 GiB" in text and "+25.4% step time" in text and "last resort" in text
    oom = [c["recompute"] for c in advice["not_fitting"] if c["status"] == "oom"]
    assert oom == ["selective/layernorm"] and "ran out of memory" in text


def test_full_only_when_nothing_narrower_fits(tmp_path):
    advice, _ = run_advise(make_sweep(tmp_path), budget=18)
    assert advice["choice"]["recompute"] == "full"


def test_nothing_fits_names_closest_and_next_steps(tmp_path):
    advice, text = run_advise(make_sweep(tmp_path), budget=15)
    assert advice["choice"] is None
    assert advice["closest"]["recompute"] == "full"
    assert "2.40 GiB over" in text
    assert [c["recompute"] for c in advice["fits_if_defragmented"]] == ["full"]  # 13.3 allocated
    assert "expandable_segments" in text and "tensor_model_parallel_size" in text and "offload" in text
    assert "recompute=full (the broadest" not in text  # full was measured: not suggested again


def test_no_recompute_when_it_fits(tmp_path):
    advice, text = run_advise(make_sweep(tmp_path), budget=100)
    assert advice["choice"]["recompute"] == "none"
    assert "no recompute" in text


def test_worst_rank_decides_fit(tmp_path):
    sweep = make_sweep(tmp_path, second_rank={"selective/core_attn": (19.5, 21.0, 0.250)})
    advice, _ = run_advise(sweep, budget=20)
    assert advice["choice"]["recompute"] == "full"  # core_attn's rank 1 reserves 21 GiB
    rows = report.rank_rows(find_results(sweep))
    core = [r for r in rows if r["recompute"] == "selective/core_attn"]
    assert [(r["rank"], r["worst"], r["rank_label"]) for r in core] == [(0, False, "0"), (1, True, "1*")]


def test_attention_backend_saves_more_than_a_label(tmp_path):
    advice, text = run_advise(make_sweep(tmp_path, attentions=("unfused", "sdpa")), budget=20)
    assert (advice["choice"]["attention"], advice["choice"]["recompute"]) == ("sdpa", "none")
    a = advice["attention"]
    assert (a["from"], a["to"], a["best_label"]) == ("unfused", "sdpa", "selective/core_attn")
    assert a["saving_gib"] == pytest.approx({"none": 39.7, "control": 39.8}[a["control"]] - 11.0)
    assert a["saving_gib"] > a["label_saving_gib"] == pytest.approx(39.8 - 18.6)
    assert f"attention=sdpa saves {a['saving_gib']:.2f} GiB" in text and "before recomputing" in text


def test_cpu_results_rank_by_ledger_and_say_so(tmp_path):
    for recompute, ledger, step in (("none", 4 << 20, 0.010), ("control", 4 << 20, 0.010),
                                    ("selective/core_attn", 3 << 20, 0.012), ("full", 1 << 20, 0.015)):
        rank = rank_result(0, (None, None, step), ledger_bytes=ledger)
        rank["device"] = "cpu"
        write_point(tmp_path, "unfused", recompute, [rank])
    advice, text = run_advise(tmp_path, budget=3.5 / 1024)  # 3.5 MiB of activations
    assert advice["device"] == "cpu" and advice["basis"].startswith("ledger")
    assert advice["choice"]["recompute"] == "selective/core_attn"
    assert "CPU results" in text and "GPU" in text


def test_report_rows_plot_and_csv(tmp_path):
    sweep = make_sweep(tmp_path, second_rank={"full": (13.0, 14.0, 0.266)})
    md = report.write_report(sweep)
    rows = report.rank_rows(find_results(sweep))
    full0 = next(r for r in rows if r["recompute"] == "full" and r["rank"] == 0)
    assert full0["worst"] and full0["d_peak_gib"] == pytest.approx(13.3 - 38.9)
    control = next(r for r in rows if r["recompute"] == "control")
    assert control["control"] == "standard_attn unfused none"  # the control is compared with none
    assert [r["recompute"] for r in pareto.point_rows(rows)][:2] == ["none", "control"]
    front = pareto.pareto_front(pareto.point_rows(rows), "peak_allocated_gib")
    assert [r["recompute"] for r in front] == ["none", "selective/mlp", "selective/core_attn", "full"]
    assert "| 0* |" in md and "peak alloc GiB" in md and "oom" in md
    png = sweep / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    csv_lines = (sweep / "report.csv").read_text().splitlines()
    assert len(csv_lines) == 1 + len(rows) and csv_lines[0].startswith("point,rank,worst")


def test_json_output_for_scripts(tmp_path, capsys):
    sweep = make_sweep(tmp_path)
    assert advise.main([str(sweep), "--budget-gib", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["choice"]["recompute"] == "selective/core_attn" and out["budget_gib"] == 20
    assert out["text"].startswith("Advice for")


@pytest.mark.parametrize("budget", ["0", "-3", "abc", "nan", "inf"])
def test_bad_budget_is_refused(tmp_path, capsys, budget):
    make_sweep(tmp_path)
    with pytest.raises(SystemExit) as exc:
        advise.main([str(tmp_path), "--budget-gib", budget])
    assert exc.value.code == 2
    assert "--budget-gib must be a" in capsys.readouterr().err


@pytest.mark.parametrize("tool", ["advise", "report"])
def test_directory_without_results(tmp_path, capsys, tool):
    args = [str(tmp_path)] + (["--budget-gib", "80"] if tool == "advise" else [])
    main = advise.main if tool == "advise" else report.main
    assert main(args) == 2
    assert "no result.json under" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")] + args[1:]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_predicted_before_any_run_picks_the_narrowest_fitting_option():
    """--predict ranks the family's options by recipes.predict.estimate (marked predicted) and picks the
    fitting option that replays the least work: moe_act at the h200 MoE shape for 26 GiB, with the unfused
    SwiGLU (fused, moe_act frees one [rows, ffn] tensor per layer, 0.5 GiB, as much as layernorm, which
    replays less: the advisor then picks layernorm)."""
    advice = predicted.advise_before_running(["model=moe", "size=h200", "model.bias_activation_fusion=false"], 26.0)
    assert advice["source"] == "predicted"
    by_option = {r["recompute"]: r for r in advice["options"]}
    assert not by_option["none"]["fits"] and by_option["full"]["fits"]
    assert by_option["full"]["predicted_peak_gib"] < by_option["selective/moe_act"]["predicted_peak_gib"]
    assert advice["choice"]["recompute"] == "selective/moe_act"
    assert "PREDICTED" in predicted.explain_prediction(advice)


def test_sweep_advice_lists_unmeasured_options_as_predicted_and_shows_predictions(tmp_path):
    """With a sweep: options it did not measure are listed (never chosen) and each measured point
    shows the estimator's prediction beside its measurement."""
    sweep = make_sweep(tmp_path, attentions=("sdpa",))
    predicted = candidates.predicted_candidates(sweep)
    options = {c["recompute"] for c in predicted}
    assert "full" in options and "selective/mlp" in options and "none" not in options
    assert all(c["source"] == "predicted" for c in predicted)
    advice = advise.advise(candidates.measured_candidates(sweep) + predicted, 80.0)
    assert advice["choice"]["source"] == "measured"
    pairs = candidates.predicted_next_to_measured(sweep)
    assert {p["point"] for p in pairs} == {"standard_attn sdpa none", "standard_attn sdpa control",
                                          "standard_attn sdpa selective/core_attn"}
    assert all(p["predicted_peak_gib"] > 0 for p in pairs)


def _candidate(recompute: str, reserved: float, step_ms: float, d_time_pct: float | None = None) -> dict:
    return {"point": f"gdn sdpa {recompute}", "model": "gdn", "attention": "sdpa", "recompute": recompute,
            "status": "ok", "source": "measured", "key": "k", "family_key": "f",
            "ranks": [{"rank": 0, "peak_allocated_gib": reserved - 0.5, "peak_reserved_gib": reserved}],
            "peak_allocated_gib": reserved - 0.5, "peak_reserved_gib": reserved, "ledger_bytes": 1,
            "step_ms": step_ms, "d_time_pct": d_time_pct, "control": "gdn sdpa control"}


def test_a_wider_label_that_saves_nothing_more_is_never_chosen_for_its_noisy_lead():
    """gdn_norm_out-core_attn replays everything gdn_norm_out does and more (core_attn saves nothing
    under SDPA): measured faster, it is noise between processes; the narrower label is the choice."""
    cands = [_candidate("none", 25.4, 116.6), _candidate("control", 26.4, 124.3, +6.6),
             _candidate("selective/gdn_norm_out", 25.05, 122.0, -1.9),
             _candidate("selective/gdn_norm_out-core_attn", 25.05, 113.8, -8.4)]
    advice = advise.advise(cands, 25.2)
    assert advice["choice"]["recompute"] == "selective/gdn_norm_out"
    assert [s["recompute"] for s in advice["superfluous"]] == ["selective/gdn_norm_out-core_attn"]
    assert advice["noise_floor_pct"] == pytest.approx(6.6)
    text = explain.explain(advice)
    assert "its lead is noise between processes" in text and "within this sweep's noise floor (6.6%)" in text


def test_a_wider_label_that_saves_more_memory_stays_a_candidate():
    cands = [_candidate("control", 26.4, 124.3, +0.5), _candidate("selective/gdn_norm_out", 25.05, 122.0, -1.9),
             _candidate("selective/gdn_norm_out-core_attn", 24.0, 120.0, -3.5)]
    advice = advise.advise(cands, 25.2)  # both fit; the wider one saves 1 GiB more and measured faster
    assert advice["choice"]["recompute"] == "selective/gdn_norm_out-core_attn" and not advice["superfluous"]
    assert advise.selective_labels("full") is None and advise.selective_labels("control") == frozenset()


def test_points_of_one_name_are_told_apart_by_what_the_sweep_varied():
    """`-m train.global_batch_size=2,8`: same model/attention/recompute, so the report names the knob."""
    def result(gbs: int, run_dir: str) -> dict:
        return {"name": "standard_attn sdpa none", "run_dir": run_dir,
                "config": {"train": {"global_batch_size": gbs, "seed": 1}, "output_dir": run_dir}}

    names = report.point_names([result(2, "a"), result(8, "b"), {"name": "moe sdpa none", "config": {}}])
    assert names == ["standard_attn sdpa none train.global_batch_size=2",
                     "standard_attn sdpa none train.global_batch_size=8", "moe sdpa none"]


def test_repeated_points_merge_into_one_row_with_their_spread_over_processes():
    """`-m measure.repeat=0,1,2`: three processes of one point become one row: the median of their
    median steps, the highest peaks, and the spread between processes, which feeds the noise floor."""
    def point(repeat: int, step_s: float, peak: float, status: str = "ok") -> dict:
        config = compose("recompute=control", "size=h200", f"measure.repeat={repeat}")
        rank = {"rank": 0, "status": status, "device": "NVIDIA H200",
                "memory": {"peak_allocated_gib": peak, "peak_reserved_gib": peak + 0.5},
                "timing": {"step_time_s": step_s, "step_time_min_s": step_s * 0.99, "tokens_per_s": 8192 / step_s,
                           "mfu": 0.1 / step_s},
                "ledger": {"total_bytes": 100}}
        return {"name": "standard_attn sdpa control", "status": status, "config": config, "choices": {},
                "run_dir": f"r{repeat}", "ranks": [rank]}

    results = [point(0, 0.100, 20.0), point(1, 0.110, 20.1), point(2, 0.090, 20.0), point(3, 0.2, 30.0, "oom")]
    rows = report.rank_rows(results)
    merged = next(r for r in rows if r["status"] == "ok")
    assert len(rows) == 2 and merged["repeats"] == 3
    assert merged["step_ms"] == pytest.approx(100.0) and merged["step_spread"] == pytest.approx(0.110 / 0.090 - 1)
    assert merged["peak_allocated_gib"] == 20.1 and merged["mfu"] == pytest.approx(1.0)
    assert merged["point"] == "standard_attn sdpa control"  # measure.repeat is not a distinguishing setting
    assert "spread over processes" in report.format_markdown(rows)
    # the advisor's noise floor takes the spread
    assert advise.noise_floor_pct([{"recompute": "control", "step_spread": merged["step_spread"]}]) == \
        pytest.approx(100 * (0.110 / 0.090 - 1))


def test_a_point_is_read_by_what_it_recomputed_not_by_its_option_name(tmp_path):
    """`recompute=control recompute.recompute_modules=[core_attn]` recomputes core_attn: it is neither
    the sweep's matched control nor a no-recompute choice for the advisor."""
    write_point(tmp_path, "unfused", "control", [rank_result(0, (38.9, 39.8, 0.197))])
    run_dir = tmp_path / "attention=unfused__recompute=control__modules=core_attn"
    write_json_atomic(run_dir / "ranks" / "rank0.json", rank_result(0, (18.0, 18.6, 0.247)))
    config = compose("attention=unfused", "recompute=control", "recompute.recompute_modules=[core_attn]", "size=h200")
    meta = {"name": "standard_attn unfused control", "run_dir": str(run_dir), "config": config,
            "choices": {"model": "standard_attn", "attention": "unfused", "recompute": "control"}}
    write_json_atomic(run_dir / "result.json", merge_result(run_dir, meta, 1, None))

    rows = {r["recompute"]: r for r in report.rank_rows(find_results(tmp_path))}
    assert set(rows) == {"control", "selective/core_attn"}
    assert rows["selective/core_attn"]["d_peak_gib"] == pytest.approx(18.0 - 38.9)
    advice, _ = run_advise(tmp_path, budget=20)
    assert advice["choice"]["recompute"] == "selective/core_attn"


def _gdn_like_sweep(root: Path, none_step_s: float | None) -> Path:
    """Run E's GDN numbers (H200): mlp and full/block (4 of 8 layers) fit in the same memory, and the
    partial block measured faster; ``none_step_s`` sets the none/control gap (the noise floor)."""
    points = {"control": (24.94, 25.40, 0.1086), "selective/mlp": (19.93, 21.13, 0.1381),
              "full/block": (19.89, 20.25, 0.1217)}
    if none_step_s is not None:
        points["none"] = (24.94, 25.40, none_step_s)
    for recompute, measured in points.items():
        write_point(root, "sdpa", recompute, [rank_result(0, measured)])
    return root


@pytest.mark.parametrize("none_step_s,chosen,says", [
    (0.1100, "full/block", "Chosen over selective/mlp"),  # floor 1.3%: the 13.5% lead is resolved
    (0.0900, "selective/mlp", "within this sweep's noise floor"),  # floor 20.7%: not resolved
    (None, "selective/mlp", "cannot tell from noise"),  # no none point: no floor at all
])
def test_a_partial_full_block_measured_faster_than_a_wide_label(tmp_path, none_step_s, chosen, says):
    advice, text = run_advise(_gdn_like_sweep(tmp_path, none_step_s), budget=21.5)
    assert advice["choice"]["recompute"] == chosen and says in text
    assert advice["faster_full"]["lead_pct"] == pytest.approx((0.1381 / 0.1217 - 1) * 100)
    assert ("last resort" in text) is False


def test_predicted_full_block_takes_the_fewest_layers_that_fit():
    """Dense at the realistic size, 137 GiB for the allocator: full/block over the fewest layers that
    fit with the allocator's slack replays less than mlp (8 of 32 layers in full against 53% of every
    layer), so it is the one to try first; one layer fewer does not fit."""
    from recipes.config import compose_config
    from recipes.predict.estimate import predict
    from recipes.recompute import recompute_config

    advice = predicted.advise_before_running(["model=standard_attn", "size=h200_long"], 137.0)
    block = next(r for r in advice["options"] if r["recompute"] == "full/block")
    k = block["recompute_num_layers"]
    assert block["fits"] and advice["choice"] is block and 1 < k < 32
    assert block["replay_fraction"] < next(r for r in advice["options"] if r["recompute"] == "selective/mlp")["replay_fraction"]
    cfg = compose_config(["model=standard_attn", "size=h200_long"])
    fewer = predict({**cfg, "recompute": {**recompute_config("full/block"), "recompute_num_layers": k - 1}}, "cuda")
    assert not fits(fewer["peak_bytes"] / 2**30, 137.0)
    text = predicted.explain_prediction(advice)
    assert f"recompute=full/block recompute.recompute_num_layers={k}" in text and "runner-up recompute=selective/mlp" in text
    # the planner over recompute x offload agrees here: no offload makes the 32 layers fit cheaper
    plan = advice["plan"]
    assert plan["choice"]["recompute"] == "full/block" and plan["choice"]["offload"] == "none"
    assert plan["runner_up"]["recompute"] == "selective/mlp" and "runner-up: recompute=selective/mlp" in text


# --- one planner over recompute and activation offload --------------------------------------------
#: The planner's budgets below were chosen for megatron's unfused SwiGLU, as the H200 measured it (a GPU
#: fuses it by default since: 2 GiB less for dense none, and moe_act then frees 0.5 GiB, not 2).
UNFUSED = "model.bias_activation_fusion=false"


@pytest.fixture
def offload_fragments_as_allocation_does(monkeypatch):
    """The planner's pricing tests below predate the measured offload fragmentation (fit.OFFLOAD_SLACK),
    which makes core attention's offload fit nowhere no offload would not: they price with the allocator's
    ordinary slack, to test the pricing."""
    from recipes.predict import fit

    monkeypatch.setattr(fit, "OFFLOAD_SLACK", dict.fromkeys(fit.OFFLOAD_SLACK, fit.ALLOCATOR_SLACK))


def test_offloading_core_attention_is_judged_with_the_fragmentation_it_measured():
    """On the H200 none + core_attn offload, --predict's old 19 GiB dense choice, held 19.62 GiB reserved
    for 17.32 allocated and ran out of memory under a 19 GiB cap. With OFFLOAD_SLACK its row does not
    fit there; the choice is the plan that measured fitting under that cap (layernorm recompute with the
    norms offloaded: 17.48 GiB allocated, 18.96 reserved)."""
    from recipes.analyze.plan import plan
    from recipes.config import compose_config
    from recipes.predict.fit import ALLOCATOR_SLACK, OFFLOAD_SLACK, slack_for

    cfg = compose_config(["model=standard_attn", "size=h200"])
    assert slack_for(compose_config(["model=standard_attn", "offload=core_attn"])) == OFFLOAD_SLACK["core_attn"]
    assert slack_for(compose_config(["model=standard_attn", "offload=qkv_linear"])) == ALLOCATOR_SLACK
    assert slack_for(compose_config(["model=moe", "offload=moe_act"])) == OFFLOAD_SLACK["moe"]
    p = plan(cfg, 19.0)
    by = {(r["recompute"], r["offload"]): r for r in p["rows"]}
    assert not by[("none", "core_attn")]["fits"] and by[("none", "core_attn")]["predicted_peak_gib"] < 19.0 / 1.085
    assert (p["choice"]["recompute"], p["choice"]["offload"]) == ("selective/layernorm", "attn_norm-mlp_norm")


def test_the_planner_prices_recompute_and_offload_in_one_unit(offload_fragments_as_allocation_does):
    """Dense at the h200 size, 21.5 GiB: no recompute does not fit; offloading core attention's tensors
    (which core_attn recompute cannot drop under SDPA) fits with its reloads hidden under compute, but
    each group and GiB moved costs the step (as the H200 measured); layernorm recompute's two replayed
    regions a layer cost more (estimate.replay_region_ms, as the H200 measured), so core attention's
    offload alone at the smallest fraction that fits is the choice, one fully recomputed layer the
    runner-up (another plan, not the choice plus more); combinations megatron-core refuses are never
    priced."""
    from recipes.analyze.plan import overrides_of, plan
    from recipes.config import EstimateConfig, compose_config

    a, b = EstimateConfig().offload_ms_per_group / 1e3, EstimateConfig().offload_ms_per_gib / 1e3
    p = plan(compose_config(["model=standard_attn", "size=h200", UNFUSED]), 21.5)
    by = {(r["recompute"], r["offload"]): r for r in p["rows"]}
    assert not by[("none", "none")]["fits"] and by[("none", "core_attn")]["fits"]
    choice = p["choice"]
    assert (choice["recompute"], choice["offload"]) == ("none", "core_attn")
    assert (p["runner_up"]["recompute"], p["runner_up"]["offload"]) == ("full/block", "none")
    assert by[("selective/layernorm", "core_attn")]["cost_s"] > choice["cost_s"]
    # the smallest activation_offload_fraction that fits; estimate.offload_ms_per_group and _per_gib
    assert choice["activation_offload_fraction"] == 0.75 and choice["offload_stall_s"] == 0.0
    assert (f"offload={choice['offload']} offload.activation_offload_fraction="
            f"{choice['activation_offload_fraction']:g}") in overrides_of(choice)
    assert choice["offload_overhead_s"] == pytest.approx(
        choice["offload_groups"] * a + choice["offload_gib"] * b)
    core = by[("none", "core_attn")]  # reloads hidden; the overhead is what it costs
    assert core["offload_s"] == pytest.approx(core["offload_overhead_s"]) and core["offload_stall_s"] == 0.0
    assert core["activation_offload_fraction"] == 0.75
    # 6 of the 7 movable layers' groups (int(7 * 0.25) stay), 4 micro-batches
    assert core["offload_groups"] == 6 * 4 and core["offload_gib"] == pytest.approx(4 * core["host_gib"])
    assert core["offload_overhead_s"] == pytest.approx(24 * a + core["offload_gib"] * b)
    assert p["runner_up"] is not None and p["runner_up"] is not p["choice"]
    assert ("selective/core_attn", "core_attn") not in by and ("full", "attn_norm") not in by
    assert all(fits(r["predicted_peak_gib"], 21.5, p["allocator_slack"]) for r in p["rows"] if r["fits"])
    assert any("core attention recompute replaces the offload point" in r["why"] for r in p["refused"])
    # a slower link exposes copies: offload rows get dearer, recompute rows do not
    slow = plan(compose_config(["model=standard_attn", "size=h200", UNFUSED]), 21.5, link_gb_s=2.0)
    slow_by = {(r["recompute"], r["offload"]): r for r in slow["rows"]}
    assert slow_by[("none", "core_attn")]["cost_s"] > by[("none", "core_attn")]["cost_s"]
    assert slow_by[("selective/mlp", "none")]["cost_s"] == pytest.approx(by[("selective/mlp", "none")]["cost_s"])


def test_price_config_prices_a_point_as_it_ran(offload_fragments_as_allocation_does):
    """the planner prices a measured point the plan priced at another offload fraction
    with ``price_config``: the same numbers as the plan's row at the row's fraction, other ones at 1.0."""
    from recipes.analyze.plan import plan, price_config
    from recipes.config import compose_config

    base = ["model=standard_attn", "size=h200", UNFUSED, "recompute=selective/layernorm", "offload=attn_norm"]
    p = plan(compose_config(base), 21.5)
    (row,) = [r for r in p["rows"] if (r["recompute"], r["offload"]) == ("selective/layernorm", "attn_norm")]
    assert row["activation_offload_fraction"] == 0.5
    same = price_config(compose_config([*base, "offload.activation_offload_fraction=0.5"]), p["tflops"], p["host_link_gb_s"])
    for key in ("predicted_peak_gib", "recompute_s", "offload_overhead_s", "cost_s"):
        assert same[key] == pytest.approx(row[key])
    whole = price_config(compose_config(base), p["tflops"], p["host_link_gb_s"])
    assert whole["offload_overhead_s"] > same["offload_overhead_s"] and whole["predicted_peak_gib"] < same["predicted_peak_gib"]


def test_an_elementwise_replay_costs_its_bytes_regions_and_host_bound_launches():
    """A layernorm replay (no matmul) is priced above its FLOPs (none) and its bytes: two regions a
    layer at ``estimate.replay_region_ms``; a host-bound MoE step adds ``estimate.launch_us`` a kernel."""
    from recipes.analyze.plan import elementwise_bytes
    from recipes.config import compose_config
    from recipes.predict.cost import elementwise_replays, recompute_s

    def cost(overrides, **est):
        cfg = compose_config(overrides)
        cfg = {**cfg, "estimate": {**cfg["estimate"], **est}}
        return recompute_s(cfg, 376.0, 8, 4, elementwise_bytes(cfg), 3000.0), cfg

    dense = ["model=standard_attn", "size=h200", "recompute=selective/layernorm"]
    bytes_only, cfg = cost(dense, replay_region_ms=0.0, launch_us=0.0)
    assert elementwise_replays(cfg) == (2.0, 2.0)
    assert bytes_only == pytest.approx(2 * elementwise_bytes(cfg) * 4 / 3000e9) and bytes_only > 0
    assert cost(dense, replay_region_ms=0.1)[0] == pytest.approx(bytes_only + 4 * 8 * 2 * 0.1e-3)
    assert cost(dense, replay_region_ms=0.0, launch_us=50.0)[0] == pytest.approx(bytes_only)  # GPU-bound
    moe = ["model=moe", "size=h200", "recompute=selective/moe_act", "model.bias_activation_fusion=false"]
    base, cfg = cost(moe, replay_region_ms=0.0, launch_us=0.0)
    assert elementwise_replays(cfg) == (1.0, 5.0)
    assert cost(moe, replay_region_ms=0.0, launch_us=10.0)[0] == pytest.approx(base + 4 * 8 * 5 * 10e-6)
    auto = ["model=moe", "size=h200", "recompute=selective/moe_act"]  # null: megatron's fused SwiGLU on a GPU
    assert elementwise_replays(compose_config(auto)) == (1.0, 1.0)


def test_predicted_advice_prints_the_plan_runner_up_and_one_sweep_to_confirm_both(offload_fragments_as_allocation_does):
    advice = predicted.advise_before_running(["model=standard_attn", "size=h200", UNFUSED], 21.5)
    text = predicted.explain_prediction(advice)
    assert "choice:    recompute=none offload=core_attn" in text and "runner-up: " in text
    commands = [line.strip() for line in text.splitlines() if line.strip().startswith("python train.py -m")]
    # capped at the budget: a plan the allocator's fragmentation does not fit into stops as oom
    assert len(commands) == 2 and all(c.endswith("measure.memory_budget_gib=21.5 hydra.sweep.dir=multirun/confirm")
                                      for c in commands)
    assert "each runs capped at the budget" in text
    assert "recompute=none offload=core_attn offload.activation_offload_fraction=0.75" in commands[0]
    assert "recompute=full/block recompute.recompute_num_layers=1" in commands[1]
    assert "python -m recipes advise multirun/confirm --budget-gib 21.5" in text


def test_when_nothing_needs_buying_the_plan_confirms_none_alone_without_a_runner_up():
    """A budget that none fits with the slack: every other plan only adds step time, so there is no
    runner-up to confirm (before, the first plan not 'none plus more' was offered: one fully recomputed
    layer). The confirm sweep runs none under the cap; recompute alone names a real label next to it,
    not control (none with hooks)."""
    advice = predicted.advise_before_running(["model=standard_attn", "size=h200"], 100.0)
    p = advice["plan"]
    assert (p["choice"]["recompute"], p["choice"]["offload"]) == ("none", "none") and p["runner_up"] is None
    text = predicted.explain_prediction(advice)
    assert "runner-up: " not in text and "no recompute or offload is needed" in text
    commands = [line.strip() for line in text.splitlines() if line.strip().startswith("python train.py -m")]
    assert commands == ["python train.py -m model=standard_attn size=h200 recompute=none "
                        "measure.memory_budget_gib=100 hydra.sweep.dir=multirun/confirm"]
    assert "Recompute alone: recompute=none" in text and "runner-up recompute=control" not in text


def test_moe_plans_never_offload_inside_a_whole_moe_recompute():
    from recipes.analyze.plan import plan
    from recipes.config import compose_config

    p = plan(compose_config(["model=moe", "size=h200", UNFUSED]), 26.0)
    assert not [r for r in p["rows"] if "selective/moe" in (r["recompute"] + "-").replace("moe_act", "")
                and any(m in r["offload"] for m in ("expert_fc1", "moe_act"))]
    assert p["choice"]["recompute"] == "selective/moe_act"  # an elementwise replay: cheaper than any copy here


def test_an_offload_point_is_compared_with_the_no_offload_control(tmp_path):
    """A measured sweep with an offload point: the report gives it the plain control's deltas (it is
    never a control itself), and the advisor may choose it on measured time."""
    sweep = tmp_path / "sweep"
    for recompute, offload, measured in (("none", "none", (20.41, 20.9, 0.0882)),
                                         ("selective/mlp", "none", (15.41, 16.07, 0.1008)),
                                         ("none", "core_attn-attn_proj", (19.10, 19.6, 0.0898))):
        run_dir = sweep / f"recompute={recompute.replace('/', '.')}__offload={offload}"
        write_json_atomic(run_dir / "ranks" / "rank0.json", rank_result(0, measured))
        cfg = compose("size=h200", f"recompute={recompute}", f"offload={offload}")
        name = f"standard_attn sdpa {recompute}" + (f" offload={offload}" if offload != "none" else "")
        meta = {"name": name, "run_dir": str(run_dir), "config": cfg,
                "choices": {"model": "standard_attn", "attention": "sdpa", "recompute": recompute, "offload": offload}}
        write_json_atomic(run_dir / "result.json", merge_result(run_dir, meta, 1, None))
    rows = {r["point"]: r for r in report.rank_rows(find_results(sweep))}
    off = rows["standard_attn sdpa none offload=core_attn-attn_proj"]
    assert off["offload"] == "core_attn-attn_proj" and off["control"] == "standard_attn sdpa none"
    assert off["d_peak_gib"] == pytest.approx(19.10 - 20.41)
    assert rows["standard_attn sdpa selective/mlp"]["control"] == "standard_attn sdpa none"
    advice = advise.advise(candidates.measured_candidates(sweep), 20.0)
    assert advice["choice"]["offload"] == "core_attn-attn_proj"  # fits, and faster than mlp
    assert "2. Choice: activation offload (offload=core_attn-attn_proj" in explain.explain(advice, str(sweep))


def test_moe_offload_at_the_long_size_is_judged_with_the_device_it_filled():
    """At h200_long two MoE offload runners-up for 137 GiB (layernorm + moe_act at 0.75, then
    layernorm + expert_fc1-moe_act at 0.75) reserved 137.3 and 137.2 of the H200's 139.8 GiB with their
    allocators retrying every step, 15.2% and 19.6% over their predicted peaks, and ran 17% and 35% slower
    than the choice. With OFFLOAD_SLACK["moe"] neither fits; the choice stays moe_act and the runner-up is
    whole-moe recompute (measured: it fits, +453 ms)."""
    from recipes.analyze.plan import plan
    from recipes.config import compose_config
    from recipes.predict.estimate import predict
    from recipes.predict.fit import fits, slack_for

    for offload in ("moe_act", "expert_fc1-moe_act"):  # as measured: 113-118 GiB allocated, 137.2-137.3 reserved
        cfg = compose_config(["model=moe", "size=h200_long", "recompute=selective/layernorm", f"offload={offload}",
                              "offload.activation_offload_fraction=0.75"])
        assert not fits(predict(cfg, "cuda")["peak_bytes"] / 2**30, 137.0, slack_for(cfg)), offload
    p = plan(compose_config(["model=moe", "size=h200_long"]), 137.0)
    assert (p["choice"]["recompute"], p["choice"]["offload"]) == ("selective/moe_act", "none")
    assert (p["runner_up"]["recompute"], p["runner_up"]["offload"]) == ("selective/moe", "none")


def test_a_plan_the_sweep_ran_out_of_memory_on_is_not_chosen_again(tmp_path):
    """--predict's 19 GiB dense choice before OFFLOAD_SLACK (none + core_attn offload) ran out of memory
    under the budget's cap on the H200; advise on that confirm sweep must then choose among the others,
    not suggest it again, and name what did fit. (--predict now chooses what fitted: the test above.)"""
    sweep = tmp_path / "confirm"
    pick = predicted.advise_before_running(["model=standard_attn", "size=h200"], 19.0)["plan"]["choice"]
    assert (pick["recompute"], pick["offload"]) != ("none", "core_attn")
    for recompute, offload, measured in (("none", "core_attn", None),
                                         ("selective/layernorm", "attn_norm-mlp_norm", (17.48, 18.96, 0.3086))):
        run_dir = sweep / f"recompute={recompute.replace('/', '.')}__offload={offload}"
        write_json_atomic(run_dir / "ranks" / "rank0.json", rank_result(0, measured))
        cfg = compose("size=h200", f"recompute={recompute}", f"offload={offload}", "measure.memory_budget_gib=19")
        meta = {"name": f"standard_attn sdpa {recompute} offload={offload}", "run_dir": str(run_dir), "config": cfg,
                "choices": {"model": "standard_attn", "attention": "sdpa", "recompute": recompute, "offload": offload}}
        write_json_atomic(run_dir / "result.json", merge_result(run_dir, meta, 1, None))
    p = candidates.sweep_plan(sweep, 19.0)
    oom = next(r for r in p["rows"] if (r["recompute"], r["offload"]) == ("none", "core_attn"))
    assert oom["measured_oom"] and not oom["fits"]
    assert (p["choice"]["recompute"], p["choice"]["offload"]) != ("none", "core_attn")
    assert ["none", "core_attn"] in [list(m) for m in p["measured"]]
    advice = advise.advise(candidates.measured_candidates(sweep), 19.0)
    assert advice["choice"]["offload"] == "attn_norm-mlp_norm"
    advice["plan"] = p
    text = explain.explain(advice, str(sweep))
    assert "ran out of memory" in text and "choice:    recompute=none offload=core_attn:" not in text


def test_a_measured_gpu_sweep_gets_the_plan_for_what_it_did_not_run(tmp_path):
    sweep = make_sweep(tmp_path / "sweep", attentions=("sdpa",))
    p = candidates.sweep_plan(sweep, 20.0)
    assert p is not None and p["base"].startswith("model=standard_attn")
    assert ["none", "none"] in [list(m) for m in p["measured"]]
    advice = advise.advise(candidates.measured_candidates(sweep), 20.0)
    advice["plan"] = p
    assert "Predicted for the combinations this sweep did not run: plan over recompute x offload" in \
        explain.explain(advice, str(sweep))


def test_with_the_fused_swiglu_moe_act_frees_what_layernorm_does():
    """A GPU's default (fused SwiGLU) keeps the activation's input and the fc2 input only, so moe_act frees
    the fc2 input: 8 layers x 16384 rows x 2048 x 2 bytes = 0.5 GiB at the h200 MoE shape."""
    advice = predicted.advise_before_running(["model=moe", "size=h200"], 26.0)
    by_option = {r["recompute"]: r for r in advice["options"]}
    saved = by_option["none"]["predicted_peak_gib"] - by_option["selective/moe_act"]["predicted_peak_gib"]
    assert abs(saved - 0.5) < 0.01
    assert advice["choice"]["recompute"] == "selective/moe_act"  # as layernorm: the guide tries moe_act first


def test_a_sweep_whose_base_point_timed_its_modules_prices_the_replays_from_them(tmp_path):
    """``measure.module_times`` on the base point (no recompute): the plan for what the sweep did not
    run prices the mlp label's replay at the measured forward time of the MLP less FC2, 8 layers x 4
    micro-batches, not at its FLOPs, and says so."""
    from recipes.predict.cost import recompute_s

    sweep = make_sweep(tmp_path / "sweep", attentions=("sdpa",))
    point = sweep / "attention=sdpa__recompute=none"
    rank = json.loads((point / "ranks" / "rank0.json").read_text())
    rank["module_times"] = {"layers": list(range(1, 9)), "microbatches": 4, "replay_ms": {},
                            "forward_ms": {"mlp": [1.3] * 8, "mlp.linear_fc2": [0.3] * 8}}
    write_point(sweep, "sdpa", "none", [rank])
    p = candidates.sweep_plan(sweep, 20.0)
    assert p["module_times"]
    (row,) = [r for r in p["rows"] if (r["recompute"], r["offload"]) == ("selective/mlp", "none")]
    cfg = _config("sdpa", "none")
    assert row["recompute_s"] == pytest.approx(4 * 8 * 1.0e-3)
    flops = recompute_s({**cfg, "recompute": _config("sdpa", "selective/mlp")["recompute"]}, p["tflops"], 8, 4)
    assert row["recompute_s"] != pytest.approx(flops)
    assert "(replays at the base point's measured module times)" in "\n".join(explain_plan(p, p["base"]))
    # with the step's timeline (a GPU base point's marks) every option is priced on it, and it says so:
    # here the host leads by far, so the 32 MLP forwards (less FC2) cost their GPU time, 0.5 ms each
    names = ["start"] + [f"{n}:{m}:{k}" for n in range(1, 9) for m, k in (("mlp", "pre"), ("mlp.linear_fc2", "pre"),
                                                                          ("mlp.linear_fc2", "end"), ("mlp", "end"))]
    names = names[:1] + (names[1:] + [f"{n}:mlp:bwd" for n in range(8, 0, -1)]) * 4
    rank["module_times"]["marks"] = {"names": names, "host_ms": [0.001 * j for j in range(len(names))],
                                     "gpu_ms": [0.0] + [0.5] * (len(names) - 1), "gpu_clean": [True] * len(names)}
    write_point(sweep, "sdpa", "none", [rank])
    p = candidates.sweep_plan(sweep, 20.0)
    (row,) = [r for r in p["rows"] if (r["recompute"], r["offload"]) == ("selective/mlp", "none")]
    # pre to end: 3 intervals less FC2's 1, read at the stream pace (FC2's stream time 0.3 ms against the
    # GPU pass's 0.5: kept at PACE_RANGE's 0.9)
    assert p["timeline"] and row["recompute_s"] == pytest.approx(4 * 8 * 2 * 0.5e-3 * 0.9)
    assert "(replays on the base point's measured step timeline" in "\n".join(explain_plan(p, p["base"]))
    assert "host_wait_ms" not in p and "grad-norm read" not in "\n".join(explain_plan(p, p["base"]))
    # a base point that recorded its steps' wait at the grad-norm read: the plan says it; this replay's
    # host work (a few us) is far below even no wait at all, so its price is the timeline's
    rank["module_times"]["marks"]["step_host_wait_ms"] = 0.0
    write_point(sweep, "sdpa", "none", [rank])
    waited = candidates.sweep_plan(sweep, 20.0)
    (same,) = [r for r in waited["rows"] if (r["recompute"], r["offload"]) == ("selective/mlp", "none")]
    assert waited["host_wait_ms"] == 0.0 and same["recompute_s"] == pytest.approx(row["recompute_s"])
    assert "steps waited 0.0 ms for the GPU at the grad-norm read" in "\n".join(explain_plan(waited, waited["base"]))
    rank.pop("module_times")
    write_point(sweep, "sdpa", "none", [rank])
    assert not candidates.sweep_plan(sweep, 20.0)["module_times"]  # without them: FLOPs, as before


def test_a_base_point_run_in_several_processes_prices_replays_from_their_median_module_times(tmp_path):
    """``measure.repeat=0,1,2`` of the base point: one process's module-time pass is one forward and
    backward (an MoE layer's took 2.9-4.9 ms in three processes of one H200 point), so the plan prices
    the replays from the median of the processes' times, module by module and layer by layer, not from
    whichever process comes first."""
    sweep = make_sweep(tmp_path / "sweep", attentions=("sdpa",))
    base = json.loads((sweep / "attention=sdpa__recompute=none" / "ranks" / "rank0.json").read_text())
    for repeat, mlp_ms in enumerate((2.3, 1.3, 1.5)):  # the first process slow
        run_dir = sweep / f"attention=sdpa__measure.repeat={repeat}__recompute=none"
        rank = {**base, "module_times": {"layers": list(range(1, 9)), "microbatches": 4, "replay_ms": {},
                                         "forward_ms": {"mlp": [mlp_ms] * 8, "mlp.linear_fc2": [0.3] * 8}}}
        write_json_atomic(run_dir / "ranks" / "rank0.json", rank)
        config = compose("attention=sdpa", "recompute=none", "size=h200", f"measure.repeat={repeat}")
        meta = {"name": "standard_attn sdpa none", "run_dir": str(run_dir), "config": config,
                "choices": {"model": "standard_attn", "attention": "sdpa", "recompute": "none"}}
        write_json_atomic(run_dir / "result.json", merge_result(run_dir, meta, 1, None))
    shutil.rmtree(sweep / "attention=sdpa__recompute=none")
    p = candidates.sweep_plan(sweep, 20.0)
    (row,) = [r for r in p["rows"] if (r["recompute"], r["offload"]) == ("selective/mlp", "none")]
    assert row["recompute_s"] == pytest.approx(4 * 8 * (1.5 - 0.3) * 1e-3)  # the median process's MLP less FC2
    names = [row["point"] for row in candidates.predicted_next_to_measured(sweep)]
    assert names.count("standard_attn sdpa none") == 1  # one row a point, not one a process
    merged = merge_module_times([{"layers": [1, 2], "forward_ms": {"": [3.0, 5.0]}},
                                        {"layers": [1, 2], "forward_ms": {"": [2.0, 4.0]}},
                                        {"layers": [1, 2], "forward_ms": {"": [9.0, 1.0]}}, None])
    assert merged["forward_ms"][""] == [3.0, 4.0] and merged["replay_ms"] == {}


def test_the_gpu_s_busy_time_merges_over_processes_and_resolves_what_the_wall_time_cannot():
    """measure.gpu_time: each process's profiled step's GPU busy time; repeats merge to its median and
    spread, the report shows it against the control, and the advisor quotes it where the step-time
    cost is within the noise floor. Without it the report's columns and CSV stay as they were."""
    def point(recompute: str, repeat: int, step_s: float, busy_s: float | None) -> dict:
        config = compose(f"recompute={recompute}", "model=moe", "size=h200", f"measure.repeat={repeat}")
        rank = {"rank": 0, "status": "ok", "device": "NVIDIA H200",
                "memory": {"peak_allocated_gib": 20.0, "peak_reserved_gib": 20.5},
                "timing": {"step_time_s": step_s, "step_time_min_s": step_s}, "ledger": {"total_bytes": 100}}
        if busy_s is not None:  # an old trace: span and idle only
            rank["trace"] = {"span_s": busy_s + 0.05, "gpu_idle_s": 0.05}
        return {"name": f"moe sdpa {recompute}", "status": "ok", "config": config, "choices": {"model": "moe"},
                "run_dir": f"{recompute}{repeat}", "ranks": [rank]}

    results = [point("none", 0, 0.260, 0.240), point("none", 1, 0.300, 0.242),
               point("selective/moe_act", 0, 0.290, 0.252), point("selective/moe_act", 1, 0.262, 0.253)]
    rows = report.rank_rows(results)
    none, act = (next(r for r in rows if r["recompute"] == k) for k in ("none", "selective/moe_act"))
    assert none["gpu_ms"] == pytest.approx(241.0) and none["gpu_spread"] == pytest.approx(0.242 / 0.240 - 1)
    assert act["d_gpu_pct"] == pytest.approx((252.5 / 241.0 - 1) * 100)
    md = report.format_markdown(rows)
    assert "GPU busy ms" in md and "GPU busy vs control" in md
    assert report.csv_keys(rows)[-3:] == ["gpu_ms", "gpu_spread", "d_gpu_pct"]
    assert "GPU busy" not in report.format_markdown(report.rank_rows([
        {**r, "ranks": [{k: v for k, v in r["ranks"][0].items() if k != "trace"}]} for r in results]))
    points = [{"source": "measured", "key": "k", "family_key": "f", "ranks": [], "point": r["point"],
                   "model": "moe", "attention": "sdpa", "offload": "none", "status": "ok",
                   "peak_allocated_gib": 20.0, "peak_reserved_gib": 20.5, "ledger_bytes": 100,
                   **{k: r.get(k) for k in ("recompute", "step_ms", "step_spread", "control", "d_time_pct",
                                            "gpu_ms", "gpu_spread", "d_gpu_pct") if r.get(k) is not None}}
                  for r in rows]
    text = explain.explain(advise.advise([c for c in points if c["recompute"] != "none"], 100.0), "s")
    assert "the GPU's busy time" in text and f"{act['d_gpu_pct']:+.1f}%" in text, text


def test_a_point_s_console_line_shows_its_gpu_busy_time(capsys):
    from recipes.run.console import print_run

    rank = {"rank": 0, "status": "ok", "timing": {"step_time_s": 0.29}, "trace": {"gpu_busy_s": 0.2379}}
    print_run({"name": "moe sdpa selective/moe_act", "status": "ok", "config": {}, "choices": {}, "ranks": [rank]})
    assert "step 290.0 ms | GPU busy 237.9 ms" in capsys.readouterr().out
    # and, on a GPU, how long the host waited for it at the grad-norm read (near 0: host-bound)
    for device, shown in (("NVIDIA H200", True), ("cpu", False)):
        waited = {**rank, "device": device, "timing": {**rank["timing"], "host_wait_s": 0.0271}}
        print_run({"name": "moe", "status": "ok", "config": {}, "choices": {}, "ranks": [waited]})
        assert ("GPU busy 237.9 ms | host waited 27.1 ms" in capsys.readouterr().out) == shown


def test_offload_points_show_their_host_copies_and_reload_waits(capsys):
    """A sweep with activation offload: the report, its CSV, the console line and the W&B summary show
    what a micro-batch copied to the host, what a step moved and (GPU) the seconds compute waited for
    reloads, the median over repeated processes; a failed wait measurement is left blank. A sweep
    without offload keeps its columns as they were."""
    from recipes.analyze.logger import run_metrics
    from recipes.run.console import print_run

    def point(offload: str, repeat: int, wait_s) -> dict:
        config = compose(f"offload={offload}", "model=standard_attn", "size=h200", f"measure.repeat={repeat}")
        rank = {"rank": 0, "status": "ok", "device": "NVIDIA H200",
                "memory": {"peak_allocated_gib": 18.0, "peak_reserved_gib": 19.0},
                "timing": {"step_time_s": 0.30 + wait_s * (offload != "none") if isinstance(wait_s, float) else 0.3},
                "ledger": {"total_bytes": 100 * MIB}}
        if offload != "none":
            rank["ledger"]["host_total_bytes"] = 896 * MIB
            rank["offload"] = {"moved_per_step": {"d2h_bytes": 3584 * MIB}, "reload_wait_s": wait_s}
        return {"name": f"standard_attn sdpa none offload={offload}", "status": "ok", "config": config,
                "choices": {"model": "standard_attn"}, "run_dir": f"{offload}{repeat}", "ranks": [rank]}

    results = [point("none", 0, 0.0), point("core_attn", 0, 0.004), point("core_attn", 1, 0.002),
               point("core_attn", 2, 0.003)]
    rows = report.rank_rows(merge_repeats(results))
    off = next(r for r in rows if r["offload"] == "core_attn")
    assert off["host_mib"] == 896 and off["moved_mib_per_step"] == 3584
    assert off["reload_wait_ms"] == pytest.approx(3.0)  # the median of the three processes
    md = report.format_markdown(rows)
    assert "| host MiB |" in md and "| reload wait ms |" in md and "| 896.00 |" in md
    keys = report.csv_keys(rows)
    assert keys[keys.index("recompute") + 1] == "offload"
    assert keys[-3:] == ["host_mib", "moved_mib_per_step", "reload_wait_ms"]
    plain = report.rank_rows([results[0]])
    assert "host MiB" not in report.format_markdown(plain) and "offload" not in report.csv_keys(plain)
    print_run(results[1])
    assert "ledger 100.00 MiB | host 896.00 MiB | step 304.0 ms | reload waits 4.0 ms" in capsys.readouterr().out
    metrics = run_metrics(results[1])
    assert metrics["offload/host_bytes"] == 896 * MIB and metrics["offload/moved_bytes_per_step"] == 3584 * MIB
    assert metrics["offload/reload_wait_s"] == 0.004
    failed = point("core_attn", 0, {"error": "OutOfMemoryError"})
    assert "offload/reload_wait_s" not in run_metrics(failed)
    assert "offload/host_bytes" not in run_metrics(results[0])


def test_ties_in_replayed_work_follow_the_guide_s_order_for_the_family():
    """Grouped MoE: moe_act and layernorm both replay no matmul (0% of a layer's forward by FLOPs);
    the guide tries moe_act first, so recompute alone picks it and names layernorm the runner-up
    (before, the alphabet picked layernorm)."""
    from recipes.recompute import guide_order

    advice = predicted.advise_before_running(["model=moe", "size=h200"], 26.0)
    assert advice["choice"]["recompute"] == "selective/moe_act"
    assert "Recompute alone: recompute=selective/moe_act" in predicted.explain_prediction(advice)
    assert "runner-up recompute=selective/layernorm" in predicted.explain_prediction(advice)
    assert guide_order("none", "moe") < guide_order("selective/moe_act", "moe") < guide_order("selective/layernorm", "moe")
    assert guide_order("selective/layernorm", "moe") < guide_order("full", "moe")
    assert guide_order("selective/mla_up_proj", "mla_moe") < guide_order("selective/layernorm", "mla_moe")


def test_a_sweep_whose_first_point_offloads_predicts_its_unmeasured_labels_without_offload(tmp_path):
    """The options a GPU sweep did not run are predicted from one of its points' config; when that point
    offloaded (here the only one), its offload was predicted into every recompute row while their
    commands ran without it, and full recompute, which megatron-core refuses with offload, was left
    out. The rows are now the plain options, as their commands run them."""
    from recipes.predict.estimate import predict
    from recipes.predict.fit import with_slack

    run_dir = tmp_path / "offload=core_attn-attn_proj"
    write_json_atomic(run_dir / "ranks" / "rank0.json", rank_result(0, (17.1, 19.8, 0.314)))
    config = compose("attention=sdpa", "size=h200", "offload=core_attn-attn_proj")
    meta = {"name": "standard_attn sdpa none offload=core_attn-attn_proj", "run_dir": str(run_dir),
            "choices": {"model": "standard_attn", "attention": "sdpa", "recompute": "none",
                        "offload": "core_attn-attn_proj"}, "config": config}
    write_json_atomic(run_dir / "result.json", merge_result(run_dir, meta, 1, None))
    rows = {r["recompute"]: r for r in candidates.predicted_candidates(tmp_path)}
    assert "full" in rows and "none" in rows  # none: measured only with offload
    plain = predict(compose("attention=sdpa", "size=h200", "recompute=control"), "cuda")
    assert rows["control"]["memory_gib"] == pytest.approx(with_slack(plain["peak_bytes"], plain["allocator_slack"]) / GIB)


def test_a_model_by_recompute_sweep_gets_one_answer_per_family(tmp_path, capsys):
    """`-m model=standard_attn,moe recompute=none,full`: the choice is per family, never one point
    picked across families (here none fits standard_attn, while moe needs full)."""
    measured = {("standard_attn", "none"): (10.0, 10.5, 0.10), ("standard_attn", "full"): (6.0, 6.5, 0.13),
                ("moe", "none"): (30.0, 31.0, 0.20), ("moe", "full"): (15.0, 16.0, 0.26)}
    for (model, recompute), numbers in measured.items():
        run_dir = tmp_path / f"recompute={recompute}__model={model}"
        write_json_atomic(run_dir / "ranks" / "rank0.json", rank_result(0, numbers))
        meta = {"name": f"{model} unfused {recompute}", "run_dir": str(run_dir),
                "choices": {"model": model, "attention": "unfused", "recompute": recompute},
                "config": compose(f"model={model}", "attention=unfused", f"recompute={recompute}", "size=h200")}
        write_json_atomic(run_dir / "result.json", merge_result(run_dir, meta, 1, None))
    assert advise.main([str(tmp_path), "--budget-gib", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    choices = {g["group"]: g["choice"]["point"] for g in out["groups"]}
    assert choices == {"model=standard_attn": "standard_attn unfused none", "model=moe": "moe unfused full"}
    assert advise.main([str(tmp_path), "--budget-gib", "20"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("This sweep holds 2 families (model=moe; model=standard_attn)") or \
        text.startswith("This sweep holds 2 families (model=standard_attn; model=moe)")
    assert f"Advice for {tmp_path} [model=moe]" in text and f"Advice for {tmp_path} [model=standard_attn]" in text
