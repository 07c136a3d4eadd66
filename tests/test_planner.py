"""The planner on the user's hardware: GPU profiles, the cluster, the micro-batch frontier, confirm."""

from __future__ import annotations

import json

import pytest

from recipes import hardware
from recipes.analyze import frontier as fr
from recipes.analyze.plan import confirm_commands, explain_plan, plan
from recipes.config import compose_config
from recipes.errors import ConfigError
from recipes.validate import offload as validate_offload


@pytest.fixture(autouse=True)
def no_local_gpu(monkeypatch):
    """The planner never reads this machine's GPU in these tests."""
    monkeypatch.setattr(hardware, "local_gpu_name", lambda: None)


def test_spec_profiles_load_validate_and_name_their_budget():
    names = hardware.spec_profiles()
    assert {"h100_sxm", "h200", "b200", "gb200"} <= set(names)
    for name in names:
        p = hardware.load_profile(name)
        assert 0 < p.cuda_reserved_gib < p.memory_gib and p.host_link_gb_s > 0 and p.source == "spec sheet"
    h100, h200 = hardware.load_profile("h100_sxm"), hardware.load_profile("h200")
    assert h100.budget_gib == 77.0 and h200.budget_gib == pytest.approx(137.4)
    assert "NVIDIA H100" in h100.describe() and "spec sheet" in h100.describe() and "PCIe" in h100.describe()
    assert hardware.load_profile("gb200").host_link == "NVLink-C2C"
    assert hardware.match_profile("NVIDIA GB200") == "gb200" and hardware.match_profile("NVIDIA B200") == "b200"
    assert hardware.match_profile("NVIDIA H100 80GB HBM3") == "h100_sxm"


def test_a_bad_profile_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="no hardware profile") as err:
        hardware.load_profile("a100")
    assert "h100_sxm" in err.value.fix
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ngpu: X\n")
    with pytest.raises(ConfigError, match="lacks memory_gib"):
        hardware.load_profile(str(bad))
    good = hardware.load_profile("h200")
    data = {f: getattr(good, f) for f in hardware.REQUIRED}
    (tmp_path / "neg.yaml").write_text(json.dumps({**data, "cuda_reserved_gib": 500}))
    with pytest.raises(ConfigError, match="not below memory_gib"):
        hardware.load_profile(str(tmp_path / "neg.yaml"))


def test_efficiency_interpolates_a_measured_table_and_saturates_on_spec():
    p = hardware.load_profile("h100_sxm")
    assert p.efficiency(32768) == pytest.approx(1.0) and p.efficiency(4096) < p.efficiency(8192) < 1.0
    # hand: 4096 / (4096 + 1024) = 0.8 over 32768 / 33792
    assert p.efficiency(4096) == pytest.approx(0.8 / (32768 / 33792))
    p.matmul_tflops = {1000: 300.0, 3000: 600.0}
    assert p.efficiency(2000) == pytest.approx(0.75) and p.efficiency(500) == 0.5 and p.efficiency(9000) == 1.0


def test_the_profile_is_the_named_one_else_the_recipes_gpu_else_h200():
    cfg = compose_config(["model=standard_attn", "size=h200", "cluster.gpu=h100_sxm"])
    assert hardware.resolve_profile(cfg)[0].name == "h100_sxm"
    p, why = hardware.resolve_profile(compose_config(["model=standard_attn"]))
    assert p.name == "h200" and "no GPU here" in why and "cluster.gpu" in why


def test_the_local_gpu_picks_its_spec_profile(monkeypatch):
    monkeypatch.setattr(hardware, "local_gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    p, why = hardware.resolve_profile(compose_config(["model=standard_attn"]))
    assert p.name == "h100_sxm" and "H100" in why


def test_a_budget_above_the_gpus_capacity_is_refused():
    with pytest.raises(ConfigError, match="above the NVIDIA H100 80GB HBM3's capacity") as err:
        hardware.check_budget(90.0, hardware.load_profile("h100_sxm"))
    assert "77" in err.value.fix
    hardware.check_budget(77.0, hardware.load_profile("h100_sxm"))


def test_a_cluster_the_layout_does_not_divide_is_refused():
    cfg = compose_config(["model=standard_attn", "size=h200", "parallel=tp2"])
    with pytest.raises(ConfigError, match="does not divide") as err:
        hardware.check_cluster(cfg, {"nodes": 1, "gpus_per_node": 3})
    assert "multiple of 2" in err.value.fix
    hardware.check_cluster(cfg, {"nodes": 2, "gpus_per_node": 8})


def test_the_clusters_host_memory_is_used_not_this_machines(monkeypatch):
    """This machine has almost no free RAM; offload plans are still weighed against the cluster's nodes."""
    monkeypatch.setattr(validate_offload, "host_memory_available", lambda: 1024**2)
    cfg = compose_config(["model=standard_attn", "size=h200", "cluster.gpu=h100_sxm",
                          "cluster.host_memory_gib=2000", "cluster.gpus_per_node=1"])
    p = plan(cfg, 19.0)
    assert not p["over_host"] and any(r["offload"] != "none" for r in p["rows"])
    assert p["cluster"]["host_memory_gib"] == 2000 and p["cluster"]["host_memory_from"] == "cluster.host_memory_gib"
    text = "\n".join(explain_plan(p, "model=standard_attn size=h200"))
    assert "h100_sxm" in text and "NVIDIA H100" in text and "2000 GiB host memory a node" in text
    # a figure below what the plans copy sets them aside, with the fix
    small = plan(compose_config(["model=standard_attn", "size=h200", "cluster.host_memory_gib=0.5"]), 19.0)
    assert small["over_host"] and "offload fewer modules" in small["over_host"][0]["fix"]


def test_estimate_weighs_offload_copies_against_the_clusters_host_memory_and_refuses_its_bad_layout(capsys):
    from recipes.predict import estimate_command

    run = ["model=standard_attn", "size=h200", "offload=core_attn", "cluster.gpu=h100_sxm", "--budget-gib", "70"]
    assert estimate_command.main([*run, "cluster.host_memory_gib=0.01"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("host memory:"))
    assert "of 0.01 GiB (cluster.host_memory_gib): does NOT fit" in line and "offload fewer modules" in line
    assert estimate_command.main([*run, "cluster.host_memory_gib=2000"]) == 0
    assert "of 2000 GiB (cluster.host_memory_gib): fits" in capsys.readouterr().out
    assert estimate_command.main([*run, "parallel=tp2", "cluster.gpus_per_node=3"]) == 2
    err = capsys.readouterr().err
    assert "error: cluster.gpus_per_node:" in err and "multiple of 2" in err


def test_offload_confirm_commands_set_expandable_segments():
    rows = [{"recompute": "none", "offload": "core_attn"}, {"recompute": "full"}]
    off, rc, _ = confirm_commands("model=standard_attn", rows, 19.0)
    assert "measure.expandable_segments=true" in off and "expandable" not in rc


def test_micro_batch_sizes_divide_the_global_batch():
    cfg = compose_config(["model=standard_attn", "size=h200"])
    assert fr.micro_batch_sizes(cfg) == [1, 2, 4, 8]
    assert fr.micro_batch_sizes(compose_config(["model=standard_attn", "size=h200", "train.global_batch_size=12"])) \
        == [1, 2, 3, 4, 6, 12]


def _row(mb, rc, off, peak, step, fits=True, copy=0.0):
    return {"micro_batch_size": mb, "recompute": rc, "offload": off, "predicted_peak_gib": peak, "step_s": step,
            "fits": fits, "cost_s": step, "uncertainty_s": fr.OFFLOAD_UNCERTAINTY * copy}


def test_frontier_order_and_the_offload_uncertainty_by_hand():
    pts = [_row(2, "none", "none", 90, 1.00, fits=False), _row(1, "none", "none", 60, 1.10),
           _row(1, "full", "none", 40, 1.30), _row(2, "full", "none", 50, 1.20), _row(1, "none", "core_attn", 55, 1.05,
                                                                                    copy=0.5)]
    # frontier: each point beats every faster one on memory; (1, none) is beaten by the faster, smaller offload
    assert [(r["micro_batch_size"], r["recompute"], r["offload"]) for r in fr.pareto(pts)] == [
        (2, "none", "none"), (1, "none", "core_attn"), (2, "full", "none"), (1, "full", "none")]
    # the offload point leads by 50 ms, within 25% of its 500 ms of copies: recompute-only first
    ranked = fr.rank_points(pts, "standard_attn")
    assert (ranked[0]["recompute"], ranked[0]["offload"]) == ("none", "none") and ranked[0]["preferred_over"]
    assert ranked[1]["offload"] == "core_attn"
    # with a lead beyond its uncertainty it stays first
    pts[-1]["step_s"] = 0.90
    assert fr.rank_points(pts, "standard_attn")[0]["offload"] == "core_attn"


def test_a_larger_micro_batch_runs_its_gemms_faster():
    h100 = hardware.load_profile("h100_sxm")
    cfg = {**compose_config(["model=standard_attn", "size=h200"])}
    times = {}
    for mb in (1, 2, 4, 8):
        c = {**cfg, "train": {**cfg["train"], "micro_batch_size": mb, "global_batch_size": 8}}
        times[mb] = fr.bare_step_s(c, h100)
    assert times[1] > times[2] > times[4] > times[8]


@pytest.mark.parametrize("budget", [0.0, -1.0, float("nan"), float("inf")])
def test_a_budget_that_is_not_a_positive_number_is_refused(budget):
    with pytest.raises(ConfigError, match="is not a positive number of GiB") as err:
        hardware.check_budget(budget, hardware.load_profile("h100_sxm"))
    assert err.value.option == "--budget-gib" and "--budget-gib 77" in err.value.fix


@pytest.mark.parametrize("args", [["--budget-gib", "-1"], ["--budget-gib", "nan"], ["--budget-gib", "0"],
                                  ["--dir", "FILE"]])
def test_plan_and_estimate_refuse_a_bad_budget_or_directory_with_exit_2(tmp_path, monkeypatch, capsys, args):
    from recipes.predict import estimate_command

    (tmp_path / "FILE").write_text("x")
    monkeypatch.chdir(tmp_path)
    assert fr.main(["size=h200", "cluster.gpu=h100_sxm", *args]) == 2
    err = capsys.readouterr().err
    assert f"error: {args[0]}:" in err and "fix:" in err and "Traceback" not in err, err
    if args[0] == "--budget-gib":
        assert estimate_command.main(["size=tiny", *args]) == 2
        assert "is not a positive number of GiB" in capsys.readouterr().err


def test_the_frontier_names_its_gpu_and_profile_and_writes_one_sweep_for_the_top_three(tmp_path):
    cfg = compose_config(["model=standard_attn", "size=h200", "cluster.gpu=h100_sxm", "cluster.host_memory_gib=2000"])
    f = fr.frontier(cfg, 19.0)
    assert f["profile"] == "h100_sxm" and f["micro_batch_sizes"] == [1, 2, 4, 8]
    assert len(f["top"]) == 3 and all(r["fits"] for r in f["top"])
    steps = [r["step_s"] for r in f["ranked"]]
    assert steps[0] <= min(steps[1:]) or "preferred_over" in f["ranked"][0]
    command = fr.write_confirm(f, ["model=standard_attn", "size=h200"], tmp_path)
    assert "+point=p1,p2,p3" in command and f"--config-dir {tmp_path / 'points'}" in command
    assert "measure.memory_budget_gib=19" in command
    for i, r in enumerate(f["top"]):
        text = (tmp_path / "points" / "point" / f"p{i + 1}.yaml").read_text()
        assert f"override /recompute: {r['recompute']}" in text and f"micro_batch_size: {r['micro_batch_size']}" in text
        assert ("expandable_segments: true" in text) == (r["offload"] != "none")
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["profile"] == "h100_sxm" and [p["point"] for p in saved["top"]] == ["p1", "p2", "p3"]
    text = fr.explain_frontier(f, command)
    assert "h100_sxm (NVIDIA H100 80GB HBM3, spec sheet)" in text and "2000 GiB host memory a node" in text
    fr.plot(f, tmp_path / "plan.png")
    assert (tmp_path / "plan.png").stat().st_size > 0


def test_predicted_advice_names_the_profiles_gpu_not_the_h200():
    from recipes.analyze import predicted

    advice = predicted.advise_before_running(["model=standard_attn", "size=h200", "cluster.gpu=h100_sxm"], 19.0)
    text = predicted.explain_prediction(advice)
    assert "2.2 GiB on the NVIDIA H100 80GB HBM3" in text and "2.4 GiB on the H200" not in text
    with pytest.raises(ConfigError, match="capacity"):
        predicted.advise_before_running(["model=standard_attn", "size=h200", "cluster.gpu=h100_sxm"], 100.0)


def _fake_sweep(tmp_path, device):
    from recipes.analyze.confirm import result_key  # noqa: F401

    plan_json = {"budget_gib": 19, "profile": "h100_sxm", "profile_text": "", "profile_gpu": "NVIDIA H100 80GB HBM3",
                 "cluster": {}, "note": None,
                 "top": [{"point": "p1", "recompute": "none", "offload": "none", "micro_batch_size": 2,
                          "predicted_peak_gib": 18.0, "step_s": 0.30, "fits": True},
                         {"point": "p2", "recompute": "full", "offload": "none", "micro_batch_size": 2,
                          "predicted_peak_gib": 14.0, "step_s": 0.35, "fits": True}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan_json))
    return plan_json


def test_confirm_compares_the_orders_and_refuses_another_gpu(tmp_path, monkeypatch):
    from recipes.analyze import confirm

    _fake_sweep(tmp_path, "NVIDIA H100 80GB HBM3")
    base = compose_config(["model=standard_attn", "size=h200"])

    def result(rc, step, peak, device, status="ok"):
        cfg = compose_config(["model=standard_attn", "size=h200", f"recompute={rc}"])
        return {"config": cfg, "status": status, "device": device, "name": rc,
                "ranks": [{"rank": 0, "device": device, "memory": {"peak_allocated_gib": peak, "peak_reserved_gib": peak + 1},
                           "step_time_s": step}]}

    assert base["train"]["micro_batch_size"] == 2
    results = [result("none", 0.40, 18.1, "NVIDIA H100 80GB HBM3"), result("full", 0.36, 14.2, "NVIDIA H100 80GB HBM3")]
    monkeypatch.setattr(confirm, "find_results", lambda d: results)
    monkeypatch.setattr(confirm, "merge_repeats", lambda rs: rs)
    monkeypatch.setattr(confirm, "worst_row", lambda r: type("W", (), {
        "peak_allocated_gib": r["ranks"][0]["memory"]["peak_allocated_gib"],
        "peak_reserved_gib": r["ranks"][0]["memory"]["peak_reserved_gib"], "step_time_s": r["ranks"][0]["step_time_s"]}))
    c = confirm.compare(tmp_path)
    assert c["order_matched"] is False and c["measured_order"] == ["p2", "p1"]
    text = "\n".join(confirm.explain_confirm(c))
    assert "NOT as predicted" in text and "+33%" in text and "nothing refitted" in text and "+0.10" in text
    results[:] = [result("none", 0.40, 18.1, "NVIDIA H200")]
    with pytest.raises(ConfigError, match="ran on NVIDIA H200") as err:
        confirm.compare(tmp_path)
    assert "calibrate" in err.value.fix


def test_calibrate_refuses_on_a_cpu_in_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    from recipes.measure import calibrate

    assert calibrate.main(["--out", "/nonexistent/x.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "profiles are for GPUs" in err and "Traceback" not in err


def test_calibrate_times_the_matmuls_of_the_model_its_overrides_name():
    """The shapes calibrate times come from the typed config (a plain dict here broke it on the GPU)."""
    from recipes.measure.calibrate import model_shapes

    assert model_shapes([]) == (2048, 8192, 16384)  # the h200_long size: hidden 2048, FFN 8192, 16k tokens
    assert model_shapes(["size=h200"]) == (2048, 8192, 4096)


def test_an_offload_runner_up_goes_behind_a_recompute_point_within_its_uncertainty():
    """The H100's MLA question: the offload plan ranked ahead of a recompute plan it led by less than its
    copies' uncertainty ran 9% slower than it; such a plan now ranks behind it, wherever it stands."""
    pts = [_row(1, "selective/mlp", "none", 58, 6.33), _row(2, "selective/mlp", "qkv_linear-core_attn-attn_proj", 55,
                                                            6.78, copy=5.78), _row(1, "full", "none", 64, 6.98)]
    ranked = fr.rank_points(pts, "mla")
    assert [r["offload"] for r in ranked] == ["none", "none", "qkv_linear-core_attn-attn_proj"]
    assert "preferred_over" in ranked[1] and "within its offload price's uncertainty" in fr._note(ranked)


def test_a_calibrated_profile_is_named_by_its_path_and_its_gpu_confirms_its_sweeps(tmp_path):
    from recipes.analyze.confirm import same_gpu

    spec = hardware.load_profile("h100_sxm")
    measured = {f: getattr(spec, f) for f in hardware.REQUIRED}
    measured.update(name="measured_h100_sxm", source="measured on NVIDIA H100 80GB HBM3 2026-12-06",
                    host_link_gb_s=41.5, matmul_tflops={4096: 520.0, 16384: 700.0, 32768: 720.0}, match=["H100"])
    path = tmp_path / "gpu.yaml"
    path.write_text(json.dumps(measured))
    cfg = compose_config(["model=standard_attn", "size=h200", f"cluster.gpu={path}"])
    p, why = hardware.resolve_profile(cfg)
    assert p.measured and "measured on" in p.describe() and "41.5 GB/s" in p.describe() and why == "named by cluster.gpu"
    assert p.efficiency(16384) == pytest.approx(700 / 720)
    assert plan(cfg, 19.0)["host_link_gb_s"] == 41.5  # the planner prices copies at the measured link
    assert same_gpu("NVIDIA H100 80GB HBM3", p.gpu) and not same_gpu("NVIDIA H200", p.gpu)


def test_advise_compares_a_plan_whose_top_three_differ_in_micro_batch(tmp_path, capsys):
    """The H200's dense_short sweep: its three points are three micro-batch sizes, which advise answers
    as three families; the plan's comparison must still follow them (it was dropped before)."""
    from recipes.analyze import advise
    from tools.evidence import load

    ev = load("planner-h200")
    root = ev.unpack(tmp_path)
    sweep = root / "dense_short"
    (sweep / "plan.json").write_text((root / "dense_short.plan.json").read_text())
    assert advise.main([str(sweep), "--budget-gib", "30"]) == 0
    out = capsys.readouterr().out
    assert "This sweep holds 3 families" in out and "Against the plan" in out
    assert "measured order p1 < p2 < p3: as predicted" in out


def test_each_moe_layer_adds_host_work_a_micro_batch(monkeypatch):
    """8 MoE layers at the h200 size, global batch 8: a micro-batch of 1 pays 8 micro-batches x 8 layers
    x 1 ms more than its FLOPs, a micro-batch of 4 pays 2 x 8 x 1 ms; a pipeline stage pays for its own
    layers; a dense model pays nothing more."""
    h200 = hardware.load_profile("h200")

    def extra(*overrides):
        cfg = compose_config(["size=h200", "train.global_batch_size=8", *overrides])
        with_term = fr.bare_step_s(cfg, h200)
        monkeypatch.setattr(fr, "MOE_LAYER_MICROBATCH_S", 0.0)
        without = fr.bare_step_s(cfg, h200)
        monkeypatch.undo()
        return with_term - without

    assert extra("model=moe", "train.micro_batch_size=1") == pytest.approx(0.064)
    assert extra("model=moe", "train.micro_batch_size=4") == pytest.approx(0.016)
    assert extra("model=moe", "train.micro_batch_size=1", "parallel=pp2") == pytest.approx(0.032)
    assert extra("model=standard_attn", "train.micro_batch_size=1") == 0
