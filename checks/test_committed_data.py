"""Checks of the committed H200 data (docs/h200/, 2026-11-29): what it holds, not what the code does.

    make check-data          # = .venv/bin/python -m pytest -q checks

These re-read the measurements and hold the docs' claims and the project's constants to them: every
(family, option) pair has a GPU row, full/block is linear in the layers it recomputes, layernorm
frees one hidden state per norm, the GDN table, the allocator slack covers every point. They also
keep the data itself in order: each sweep's points have short names (at most 64 characters,
``recipes.config.slug``) listed in the sweep's ``manifest.json`` with their overrides
(``checks/rename_points.py`` writes it), and every committed report regenerates byte for byte from
the committed results. The tests of the code that reads this data (estimator, advisor, MFU table)
are in tests/test_h200_results.py.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import rename_points  # noqa: E402  (checks/, after the repo is on sys.path)

from recipes.analyze.candidates import measured_candidates  # noqa: E402
from recipes.analyze.report import write_report  # noqa: E402
from recipes.config import MAX_DIRNAME  # noqa: E402
from recipes.offload import modules_of  # noqa: E402
from recipes.predict.fit import ALLOCATOR_SLACK, EP_MOE_SLACK, slack_for  # noqa: E402
from recipes.recompute import BASE_FAMILIES as FAMILIES  # noqa: E402  (the measured ones; mla_moe, gdn_moe: no H200 rows yet)
from recipes.recompute import LABELS, conf_options, selective_labels  # noqa: E402

H200 = REPO / "docs" / "h200"
H200X2 = REPO / "docs" / "h200x2"  # two H200s: per-rank tables (docs/h200x2-results.md)
RESULTS = sorted(H200.rglob("result.json"))
SWEEPS = rename_points.sweep_dirs(H200) + rename_points.sweep_dirs(H200X2)
REPORTS = [s for s in SWEEPS if (s / "report.md").exists()]
FUSED_ADAM = [p for p in RESULTS if json.loads(p.read_text())["config"]["train"].get("fused_adam")]


def _measured_pairs() -> dict[tuple[str, str], list[dict]]:
    """(model, recompute option) -> results at the h200 size (size=h200: 8 layers, h 2048, s 4096, b 2)."""
    pairs: dict[tuple[str, str], list[dict]] = {}
    for path in RESULTS:
        result = json.loads(path.read_text())
        choices = result["choices"]
        if choices["size"] == "h200":
            pairs.setdefault((choices["model"], choices["recompute"]), []).append(result)
    return pairs


def test_the_h200_results_are_there():
    assert len(RESULTS) >= 40 and all(json.loads(p.read_text())["ranks"] for p in RESULTS)


@pytest.mark.parametrize("sweep", SWEEPS, ids=lambda p: p.name)
def test_every_sweep_has_a_manifest_of_its_short_point_names(sweep):
    """Every point directory is at most MAX_DIRNAME characters, is the slug of the overrides its
    manifest entry lists, and agrees with its result.json on name and status; no entry is stale."""
    assert not rename_points.manifest_problems(sweep)
    assert all(len(p.name) <= MAX_DIRNAME == 64 for p in rename_points.point_dirs(sweep))


def test_no_console_logs_in_the_committed_data():
    """The committed data is results and reports; console logs stay out of the tree."""
    assert not sorted(H200.rglob("*.log")) + sorted(H200X2.rglob("*.log"))


@pytest.mark.parametrize("sweep", REPORTS, ids=lambda p: p.name)
def test_every_committed_report_regenerates_identically(sweep, tmp_path, monkeypatch):
    """``python -m recipes report docs/h200/<sweep>`` on a copy, from a directory where the copy has
    the same relative path (report.md's title holds it), writes the committed report.md and report.csv."""
    relative = sweep.relative_to(REPO)
    shutil.copytree(sweep, tmp_path / relative)
    monkeypatch.chdir(tmp_path)
    write_report(relative)
    for name in ("report.md", "report.csv"):
        made, committed = (tmp_path / relative / name).read_text(), (sweep / name).read_text()
        how = "the same rows in another order" if sorted(made.splitlines()) == sorted(committed.splitlines()) else ""
        assert made == committed, f"{relative}/{name} differs: {how or 'other rows or numbers'}"


def test_every_family_option_pair_that_applies_has_an_h200_row():
    """Issue 3's GPU table: every recompute option in conf/ whose labels all apply to a family
    (recipes.recompute's LABELS) ran on the H200 at size=h200 and finished; an option added
    without a GPU row fails."""
    measured = _measured_pairs()
    missing = [(family, option) for family in FAMILIES for option in conf_options()
               if all(family in LABELS[label].families for label in selective_labels(option) or ())
               and not any(r["status"] == "ok" for r in measured.get((family, option), []))]
    assert not missing, f"no H200 row for {missing}: run benchmarks/gpu_suite.sh labels:<family>"


def test_full_block_peak_is_linear_in_the_layers_recomputed():
    """Run E: 4 of 8 layers under full/block land on the midpoint of the control and full recompute."""
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
    """Run E: selective/layernorm's ledger saving is 2 norms x L layers x one [s, b, h] bf16 tensor,
    against the control of the same sweep (the norms' fp32 statistics add well under 1%)."""
    for family in FAMILIES:
        sweep = next(p.parent.parent for p in RESULTS if p.parent.parent.name.startswith(("sweep_", "labels_"))
                     and json.loads(p.read_text())["choices"]["recompute"] == "selective/layernorm"
                     and json.loads(p.read_text())["choices"]["model"] == family)
        ledger, cfg = {}, None
        for path in sweep.glob("*/result.json"):
            result = json.loads(path.read_text())
            ledger[result["choices"]["recompute"]] = result["ranks"][0]["ledger"]["total_bytes"]
            cfg = result["config"]
        m, t = cfg["model"], cfg["train"]
        norms = 2 * m["num_layers"] * t["seq_length"] * t["micro_batch_size"] * m["hidden_size"] * 2
        saved = ledger["control"] - ledger["selective/layernorm"]
        assert norms <= saved < norms * 1.01, (family, saved, norms)


def test_gdn_table_gdn_norm_out_saves_what_core_attn_does_not():
    """Issue 11's GPU table (fla kernels, Triton 3.7.1): gdn_norm_out lowers the ledger and the peak;
    core_attn under SDPA saves nothing."""
    rows = {c["recompute"]: c for c in measured_candidates(H200 / "sweep_gdn")}
    assert all(c["status"] == "ok" for c in rows.values()) and len(rows) == 6
    assert rows["selective/gdn_norm_out"]["d_peak_gib"] < -0.3 and rows["selective/gdn_norm_out"]["d_ledger_pct"] < -3
    assert abs(rows["selective/core_attn"]["d_peak_gib"]) < 0.01


def test_allocator_slack_covers_every_measured_row():
    """recipes.predict.fit.ALLOCATOR_SLACK (what a predicted peak needs on top to fit) covers reserved
    over allocated on every fused-Adam H200 point."""
    for path in FUSED_ADAM:
        for rank in json.loads(path.read_text())["ranks"]:
            if rank.get("status") == "ok":
                m = rank["memory"]
                assert m["peak_reserved_gib"] <= m["peak_allocated_gib"] * (1 + ALLOCATOR_SLACK), path.parent.name


def test_the_expert_parallel_slack_covers_every_ep_rank_on_two_h200s():
    """recipes.predict.fit.EP_MOE_SLACK covers reserved over allocated on every MoE rank under expert
    parallel measured on two H200s (docs/h200x2: up to 1.166x, ep2 none rank 0), which the 8.5% does not."""
    ratios = []
    for path in sorted(H200X2.rglob("rank*.json")) + sorted(H200X2.rglob("result.json")):
        data = json.loads(path.read_text())
        ranks = data["ranks"] if "ranks" in data else [data]
        config = data.get("config") or json.loads((path.parent.parent / "result.json").read_text())["config"]
        if slack_for(config) != EP_MOE_SLACK:
            continue
        ratios += [r["memory"]["peak_reserved_gib"] / r["memory"]["peak_allocated_gib"] for r in ranks
                   if r.get("status") == "ok" and r.get("memory")]
    assert len(ratios) >= 7 and max(ratios) <= 1 + EP_MOE_SLACK
    assert max(ratios) > 1 + ALLOCATOR_SLACK


OFFLOAD = REPO / "docs" / "offload-h200"
OFFLOAD_SWEEPS = [OFFLOAD / f"{m}_{s}" for s in ("h200", "h200_long") for m in ("standard_attn", "moe")]


def test_the_offload_slack_covers_every_measured_offload_point():
    """recipes.predict.fit.slack_for, on the estimator's predicted peak as the planner applies it, covers
    the reserved peak of every activation-offload point measured on one H200 (docs/offload-h200) without
    a memory cap (under a cap the allocator frees its cache to stay below it, so reserved measures the
    cap) and without allocator retries (``memory.alloc_retries``: the device itself was full, as at the
    h200_long size's MoE offload, 137.3 of 139.8 GiB reserved; the same plan fits under a 137 GiB cap,
    docs/offload-h200/fused_rope_h200_long/moe_capped); ALLOCATOR_SLACK alone does not."""
    from recipes.config import upgrade
    from recipes.predict.estimate import predict

    needed = []
    for path in sorted(OFFLOAD.rglob("result.json")):
        data = json.loads(path.read_text())
        cfg = upgrade(data["config"])
        if cfg["measure"]["memory_budget_gib"] is not None or cfg["measure"]["memory_fraction"] is not None:
            continue
        for rank in data["ranks"]:
            if rank.get("status") == "ok" and rank.get("memory") and modules_of(cfg) \
                    and not rank["memory"].get("alloc_retries"):
                predicted = predict(cfg, "cuda")["peak_bytes"] / 2**30
                needed.append(rank["memory"]["peak_reserved_gib"] / predicted - 1)
                assert needed[-1] <= slack_for(cfg), path.parent.name
    assert len(needed) >= 40 and max(needed) > ALLOCATOR_SLACK


def _offload_table(*args: str) -> str:
    import subprocess

    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "offload_table.py"), *args],
                          capture_output=True, text=True, timeout=300, check=True)
    return done.stdout


def test_the_offload_table_regenerates_identically():
    """docs/offload-h200/table.md is benchmarks/offload_table.py over the committed sweeps, with today's
    time model: a change to the model or its rates rewrites it (and the numbers in docs/offload.md and docs/offload-log.md)."""
    assert _offload_table(*map(str, OFFLOAD_SWEEPS)) == (OFFLOAD / "table.md").read_text()


def test_the_mla_offload_sweep_is_predicted_and_regenerates_identically():
    """docs/offload-h200/mla_h200 (one H200, 2026-12-05): MLA's offload points, each a fresh process, as
    benchmarks/gpu_offload.sh ran them; every point's peak predicted within 1% and each offload point's
    host bytes exactly (MLA's qkv_linear copies its input once for each down-projection, and RoPE's
    cos and sin stay, each below offload.min_offloaded_tensor_size); table_mla_2026-12-05.md is
    offload_table.py over the sweep."""
    from recipes.config import upgrade
    from recipes.predict.estimate import predict

    sweep = OFFLOAD / "mla_h200"
    points = sorted(sweep.glob("*/result.json"))
    assert len(points) == 8
    for path in points:
        data = json.loads(path.read_text())
        cfg, rank = upgrade(data["config"]), data["ranks"][0]
        p = predict(cfg, "cuda")
        assert abs(p["peak_bytes"] / 2**30 / rank["memory"]["peak_allocated_gib"] - 1) < 0.01, path.parent.name
        if modules_of(cfg):
            assert p["host_bytes"] == rank["ledger"]["host_total_bytes"], path.parent.name
    assert _offload_table(str(sweep)) == (OFFLOAD / "table_mla_2026-12-05.md").read_text()


def test_the_offload_repeats_table_regenerates_identically():
    """docs/offload-h200/repeats.md: the 2026-12-02 re-measurement (several processes a point)."""
    sweeps = [OFFLOAD / "standard_attn_h200_layernorm_repeats", OFFLOAD / "moe_h200_pinned_repeats"]
    assert _offload_table(*map(str, sweeps)) == (OFFLOAD / "repeats.md").read_text()


def test_the_offload_plans_table_regenerates_identically():
    """docs/offload-h200/plans.md: the --predict picks and their runners-up, measured 2026-12-02."""
    sweeps = [OFFLOAD / "plans_standard_attn_h200", OFFLOAD / "plans_moe_h200"]
    assert _offload_table(*map(str, sweeps)) == (OFFLOAD / "plans.md").read_text()


def test_the_recompute_time_table_at_the_defaults_regenerates_identically():
    """docs/offload-h200/recompute_defaults.md: the label sweeps at the speed defaults (docs/speed.md)
    priced by today's time model."""
    sweeps = [REPO / "docs" / "speed-h200" / f"defaults_{m}" for m in ("standard_attn", "mla", "moe")]
    assert _offload_table(*map(str, sweeps)) == (OFFLOAD / "recompute_defaults.md").read_text()


def test_the_module_time_table_regenerates_identically():
    """docs/offload-h200/moduletimes.md: the label sweeps of 2026-12-03 whose points timed their modules,
    priced from them (docs/offload-log.md)."""
    sweeps = [OFFLOAD / f"moduletimes_{m}" for m in ("standard_attn", "mla", "moe")]
    sweeps += [OFFLOAD / f"moduletimes_{m}_h200_long" for m in ("standard_attn", "moe")]
    table = _offload_table(*map(str, sweeps))
    assert table == (OFFLOAD / "moduletimes.md").read_text()
    assert "| +199.4 | +197.5 |" in table and "| +453.3 | +483.4 |" in table  # the h200_long decisions


def test_the_module_timed_offload_table_regenerates_identically():
    """docs/offload-h200/moduletimes_offload.md (the dense and MoE offload sweeps) and moduletimes_moe_again.md
    (MoE's labels), whose points timed their modules, priced from them (docs/offload-log.md, the later
    section of 2026-12-03)."""
    table = _offload_table(str(OFFLOAD / "moduletimes_offload_standard_attn"), str(OFFLOAD / "moduletimes_offload_moe"))
    assert table == (OFFLOAD / "moduletimes_offload.md").read_text()
    assert "| +28.2 | +21.0 |" in table and "| +13.4 | +15.2 |" in table
    labels = _offload_table(str(OFFLOAD / "moduletimes_moe_again"))
    assert labels == (OFFLOAD / "moduletimes_moe_again.md").read_text() and "| +78.8 | +88.1 |" in labels


def test_the_timeline_sweeps_of_2026_12_04_regenerate_identically():
    """docs/offload-h200/timeline_2026-12-04{,_first,_1545}.md: the label sweeps whose base points
    recorded their timeline (``module_times.marks``), priced on it at the stream pass's pace
    (recipes.predict.replay; docs/offload-log.md); _1551, _1947 (its base points measured their checkpoint
    regions' host cost) and interleaved_2026-12-04 are MoE alone."""
    for name, moe_full in (("timeline_2026-12-04", "| +92.3 | +86.0 |"), ("timeline_2026-12-04_first", "| +87.1 | +101.2 |"),
                           ("timeline_2026-12-04_1545", "| +62.3 | +117.8 |")):
        table = _offload_table(*(str(OFFLOAD / f"{name}_{m}") for m in ("standard_attn", "mla", "moe")))
        assert table == (OFFLOAD / f"{name}.md").read_text() and moe_full in table, name
    for name, sweep, moe_full in (("timeline_2026-12-04_1551", "timeline_2026-12-04_1551_moe", "| +105.0 | +69.4 |"),
                                  ("interleaved_2026-12-04", "interleaved_2026-12-04_moe", "| +122.9 | +144.0 |"),
                                  ("timeline_2026-12-04_1947", "timeline_2026-12-04_1947_moe", "| +27.4 | +40.0 |")):
        table = _offload_table(str(OFFLOAD / sweep))
        assert table == (OFFLOAD / f"{name}.md").read_text() and moe_full in table, name


def test_the_offload_overhead_rates_are_the_fit_of_the_paired_dense_runs():
    """estimate.offload_ms_per_group and offload_ms_per_gib are what benchmarks/bench_paired.py --fit
    finds in the dense offload options paired against themselves on 2026-12-05 (two machines, three
    processes each); docs/offload-h200/offload_fit_2026-12-05.md is that fit's output, every paired
    option of that day priced at it (docs/offload-log.md)."""
    import subprocess

    from recipes.config import EstimateConfig

    runs = OFFLOAD / "paired_offload_2026-12-05"
    dirs = [str((runs / d).relative_to(REPO)) for d in ("0235_standard_attn", "0408_standard_attn", "0239_moe",
                                                        "0251_moe_again", "0510_moe", "0506_mla")]
    out = subprocess.run([sys.executable, "benchmarks/bench_paired.py", "--fit", *dirs], cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    default = EstimateConfig()
    assert out.startswith(f"estimate.offload_ms_per_group={default.offload_ms_per_group:.3f} "
                          f"estimate.offload_ms_per_gib={default.offload_ms_per_gib:.2f} ")
    assert out == (OFFLOAD / "offload_fit_2026-12-05.md").read_text()


def test_where_the_offload_managers_host_work_shows_regenerates_identically():
    """docs/offload-h200/offload_host_2026-12-05.md (benchmarks/offload_host.py over the paired offload
    runs that measured the manager's host cost): MoE steps with a margin under 40 ms paid most of the
    host work the option added, the dense ones a third; the step's host work is about twice what the
    pass's synthetic measure prices (docs/offload-log.md)."""
    import subprocess

    for name, runs, row in (
            ("offload_host_2026-12-05", ("paired_offload_2026-12-04/2117_moe", "paired_offload_2026-12-04/2119_standard_attn",
                                         *(f"paired_offload_2026-12-05/{d}" for d in (
                                             "0235_standard_attn", "0408_standard_attn", "0239_moe", "0251_moe_again",
                                             "0510_moe", "0506_mla"))),
             "| moe | under 40 ms | 16 | 0.91 (0.44-1.08) | 1.88 |"),
            # 12:35's runs, which also recorded each step's wait at the grad-norm read
            ("offload_host_2026-12-05_1235", ("paired_offload_2026-12-05/1235_moe",
                                              "paired_offload_2026-12-05/1239_standard_attn"), "| 15.3 |")):
        dirs = [str((OFFLOAD / d).relative_to(REPO)) for d in runs]
        out = subprocess.run([sys.executable, "benchmarks/offload_host.py", *dirs], cwd=REPO,
                             capture_output=True, text=True, timeout=300, check=True).stdout
        assert out == (OFFLOAD / f"{name}.md").read_text() and row in out, name


def test_the_label_sweeps_of_2026_12_04_regenerate_identically():
    """docs/speed-h200/labels_2026-12-04.md: the label sweeps at the defaults of 2026-12-04 (fused RoPE),
    priced from their base points' module times, MoE's the median of its three processes' (docs/offload-log.md)."""
    sweeps = [REPO / "docs" / "speed-h200" / f"labels_2026-12-04_{m}" for m in ("standard_attn", "mla", "moe")]
    table = _offload_table(*map(str, sweeps))
    assert table == (REPO / "docs" / "speed-h200" / "labels_2026-12-04.md").read_text()
    assert "| +70.5 | +108.2 |" in table and "| +34.1 | +61.9 |" in table  # MoE full and moe


def test_the_paired_offload_runs_of_2026_12_04_regenerate_identically():
    """docs/offload-h200/paired_offload_2026-12-04{,_2117}.md: offload options timed against themselves
    paused in one process (benchmarks/bench_paired.py), priced with today's time model; the processes
    from 21:17 UTC measured the offload manager's host cost in their pass (docs/offload-log.md)."""
    import subprocess

    runs = REPO / "docs" / "offload-h200" / "paired_offload_2026-12-04"
    every = ("2050_standard_attn", "2056_moe", "2058_standard_attn_runs4", "2059_standard_attn_a",
             "2100_standard_attn_runs4_a", "2100_standard_attn_b", "2101_standard_attn_runs4_b", "2102_moe_runs4",
             "2105_standard_attn_runs4", "2106_moe_runs4", "2117_moe", "2119_standard_attn")
    for name, dirs, row in (("paired_offload_2026-12-04", every, "| standard_attn | offload=core_attn-attn_proj | 9 |"),
                            ("paired_offload_2026-12-04_2117", ("2119_standard_attn", "2117_moe"),
                             "| moe | offload=expert_fc1-moe_act | 1 |")):
        done = subprocess.run([sys.executable, "benchmarks/bench_paired.py", "--table",
                               *(str((runs / d).relative_to(REPO)) for d in dirs)],
                              cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
        assert done.stdout == (OFFLOAD / f"{name}.md").read_text() and row in done.stdout, name


def test_the_paired_runs_of_2026_12_05_regenerate_identically():
    """docs/offload-h200/paired_offload_2026-12-05.md: each family's offload options timed against
    themselves paused, three processes an option (benchmarks/gpu_suite.sh paired_offload), MoE's
    moe_act and 25 GiB pick three more on a second machine, with the reload waits measured;
    paired_2026-12-05.md, MoE's moe_act-layernorm recompute; paired_offload_2026-12-05_0408.md, the
    dense options with their copies on the step's clock; _0506.md, MLA's offload and MoE's 25 GiB pick
    beside its offload alone; _1235.md, MoE's moe_act-layernorm, 25 GiB pick and its offload alone, dense
    layernorm and qkv_linear, with the manager's calls and the GPU's work; _1351.md, dense layernorm and
    core_attn with each region's forward part measured, MoE's moe_act-layernorm, moe_act offload and 25
    GiB pick; paired_2026-12-05_2147.md, MoE's and dense's labels measured together on one model, then
    MoE's moe_act and expert_fc1 offload in seven and three processes of that machine, the first with
    untimed rounds after their passes; priced with today's time model (docs/offload-log.md)."""
    import subprocess

    h200 = REPO / "docs" / "offload-h200"
    for name, folder, dirs, row in (
            ("paired_offload_2026-12-05", "paired_offload_2026-12-05", ("0235_standard_attn", "0239_moe",
                                                                        "0251_moe_again"),
             "| moe | offload=moe_act | 6 | +36.7, +16.7, +38.9, +8.4, +8.5, +10.8 |"),
            ("paired_2026-12-05", "paired_2026-12-05", ("0254_moe",), "| moe | selective/moe_act-layernorm | 3 |"),
            ("paired_offload_2026-12-05_0408", "paired_offload_2026-12-05", ("0408_standard_attn",),
             "| standard_attn | offload=qkv_linear | 3 | +3.9, +3.4, +6.5 |"),
            ("paired_offload_2026-12-05_0506", "paired_offload_2026-12-05", ("0506_mla", "0510_moe"),
             "| mla | offload=qkv_linear | 2 | +12.4, +5.8 |"),
            ("paired_offload_2026-12-05_1235", "paired_offload_2026-12-05", ("1235_moe", "1239_standard_attn"),
             "| moe | offload=core_attn offload.activation_offload_fraction=0.75 | 3 | +34.5, +16.5, +34.4 |"),
            ("paired_offload_2026-12-05_1351", "paired_offload_2026-12-05", ("1351_standard_attn", "1355_moe"),
             "| standard_attn | selective/layernorm | 3 | +3.3, +0.9, +4.2 | +3.3 | +4.9 |"),
            ("paired_2026-12-05_2147", "paired_2026-12-05", ("2147_moe_together", "2154_standard_attn_together",
                                                             "2200_moe", "2205_moe"),
             "| moe | offload=moe_act | 7 | +34.3, +10.1, +4.3, +5.6, +0.7, +12.1, +26.6 | +10.1 |")):
        done = subprocess.run([sys.executable, "benchmarks/bench_paired.py", "--table",
                               *(str((h200 / folder / d).relative_to(REPO)) for d in dirs)],
                              cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
        assert done.stdout == (OFFLOAD / f"{name}.md").read_text() and row in done.stdout, name


def test_the_h100_paired_runs_regenerate_identically():
    """docs/offload-h100/paired_2026-12-05_1520.md: the same paired measurement on an H100 (80 GB), its
    host side profiled each way (``host_ops``): a second GPU's view of the options priced worst on the
    H200; _1758.md: MoE's moe_act-layernorm beside its two labels alone (each option's price reads its
    own pass: the host's pace moved between the options of one process); paired_together_2026-12-05.md:
    MoE's and dense's labels measured together on one model (``--together``), at one machine state.
    Kept apart from the H200's scoreboard."""
    import subprocess

    h100 = REPO / "docs" / "offload-h100"
    for name, dirs, rows in (
            ("paired_2026-12-05_1520", ("1520_moe", "1526_standard_attn"),
             ("| moe | offload=moe_act | 3 | +39.1, +40.5, +34.6 | +39.1 | +26.9 | -31% |",
              "| process | option | host added ms: paired steps / profiled |")),
            ("paired_2026-12-05_1758", ("1758_moe",),
             ("| moe | selective/moe_act-layernorm | 3 | +40.3, +9.7, +5.1 | +9.7 | +4.8 | -50% |",)),
            ("paired_together_2026-12-05", ("1910_moe_together", "1915_standard_attn_together", "1920_moe_together",
                                            "1925_standard_attn_together"),
             ("(4 processes, the options together on one model)",
              "| moe | selective/moe_act-layernorm | 8 | +3.7, +3.9, +5.3, +4.6, +4.0, +4.6, +5.0, +4.1 | +4.3 | +3.6 |",
              "| standard_attn | selective/layernorm | 6 | +1.7, +1.5, +1.5, +2.2, +1.8, +2.0 | +1.7 | +1.5 | -11% |"))):
        done = subprocess.run([sys.executable, "benchmarks/bench_paired.py", "--table",
                               *(str((h100 / "paired_2026-12-05" / d).relative_to(REPO)) for d in dirs)],
                              cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
        assert done.stdout == (h100 / f"{name}.md").read_text(), name
        assert all(row in done.stdout for row in rows), name


#: Every paired process recorded with the pass's host-cost measurements (a checkpoint region's from
#: 2026-12-04 19:25 UTC, the offload manager's from 21:17): the 20% target's scoreboard.
PAIRED_EVERY = ("paired_2026-12-04/19[23]*_*", "paired_offload_2026-12-04/211[79]_*", "paired_2026-12-05/[0-9]*_*",
                "paired_offload_2026-12-05/[0-9]*_*")


def test_every_paired_process_pooled_regenerates_identically():
    """docs/offload-h200/paired_every.md: bench_paired.py --summary over every paired process that
    recorded the host-cost measurements today's price reads, on every machine, priced with today's
    time model (docs/offload.md's standing against the 20% target), with how far the processes' spread
    lets each error lie (a bootstrap over processes, seeded) and the count against the target."""
    import subprocess

    dirs = [str(p.relative_to(REPO)) for pattern in PAIRED_EVERY for p in sorted(OFFLOAD.glob(pattern))]
    out = subprocess.run([sys.executable, "benchmarks/bench_paired.py", "--summary", *dirs], cwd=REPO,
                         capture_output=True, text=True, timeout=600, check=True).stdout
    assert out == (OFFLOAD / "paired_every.md").read_text()
    assert "| moe | selective/moe_act | 9 | +8.0, +23.0, +13.0, +18.4, +13.9, +13.7, +12.9, +6.8, +11.6 |" in out
    assert "Priced within 20% of the added median: 22 of 25 options." in out


def test_the_rounds_after_the_passes_by_index_regenerate_identically():
    """docs/offload-h200/by_round.md and docs/offload-h100/by_round.md: each round's on-minus-off ms less
    its option's median, by round, over the scoreboard's processes and the H100's: the first rounds
    after the module-time passes stand apart in processes that timed options one after another
    (bench_paired.SETTLE_ROUNDS runs them untimed from 2026-12-05 20:30 UTC)."""
    import subprocess

    h200 = [str(p.relative_to(REPO)) for pattern in PAIRED_EVERY for p in sorted(OFFLOAD.glob(pattern))]
    h100 = [str(p.relative_to(REPO)) for p in sorted((REPO / "docs" / "offload-h100" / "paired_2026-12-05").glob("1*"))]
    for dirs, doc, row in ((h200, OFFLOAD / "by_round.md", "| one after another, offload, MoE | 64 | +27.1 | -0.9 |"),
                           (h100, REPO / "docs" / "offload-h100" / "by_round.md",
                            "| together, recompute, MoE | 24 | +1.6 | -0.1 |")):
        out = subprocess.run([sys.executable, "benchmarks/bench_paired.py", "--by-round", *dirs], cwd=REPO,
                             capture_output=True, text=True, timeout=600, check=True).stdout
        assert out == doc.read_text() and row in out, doc


def test_the_paired_runs_of_2026_12_04_regenerate_identically():
    """docs/offload-h200/paired_2026-12-04{,_1713,_1925}.md: benchmarks/bench_paired.py's saved processes
    (each option timed against itself switched off in one process) priced with today's time model; the
    first with the no-grad forward pass recorded, _1713 from before it, _1925 with the checkpoint
    regions' host cost measured too (docs/offload-log.md)."""
    import subprocess

    runs = REPO / "docs" / "offload-h200" / "paired_2026-12-04"
    for name, dirs, moe in (("paired_2026-12-04", ("1722_moe", "1729_moe", "1737_moe", "1731_standard_attn",
                                                   "1915_standard_attn", "1732_mla", "1916_mla"),
                             "| moe | selective/moe | 7 |"),
                            ("paired_2026-12-04_1925", ("1925_moe", "1931_moe", "1933_moe", "1928_standard_attn",
                                                        "1930_mla"),
                             "| moe | selective/moe_act | 5 |"),
                            ("paired_2026-12-04_1713", ("1713_moe", "1719_standard_attn", "1720_mla"),
                             "| moe | selective/moe | 3 |")):
        done = subprocess.run([sys.executable, "benchmarks/bench_paired.py", "--table",
                               *(str((runs / d).relative_to(REPO)) for d in dirs)],
                              cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
        assert done.stdout == (OFFLOAD / f"{name}.md").read_text() and moe in done.stdout, name
