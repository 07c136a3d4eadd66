"""benchmarks/bench_paired.py on a CPU (times mean nothing here): one option's paired steps run in one
process with the option on and off, its price comes from the same process's module times, a saved
process re-prices to the same figure with this code, and the table reads saved processes back."""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import json
import statistics

import pytest
from conftest import REPO, build_trainer, compose


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench():
    return _load("bench_paired")


def _steps():
    """benchmarks/paired_steps.py: a step timed, the option switched off, and the probes each way."""
    return _load("paired_steps")


def _tables():
    """benchmarks/paired_tables.py: the saved processes read back and tabled."""
    return _load("paired_tables")


def test_an_option_is_timed_against_itself_switched_off_and_priced_on_its_own_pass(megatron_world, tmp_path, capsys):
    bench, tables = _bench(), _tables()
    r = bench.measure_option(["model=moe", "size=tiny", "profile=none"], "selective/moe", rounds=2, passes=2)
    raw = r["raw"]
    assert len(raw["on_ms"]) == len(raw["off_ms"]) == 2 and len(raw["module_times"]) == 3  # 2 before, 1 after
    assert raw["settle_rounds"] == bench.SETTLE_ROUNDS == 2  # run untimed after the passes, before these
    # the host's own time and its wait at the grad-norm read, each step (the wait is the margin the
    # price gives a step's host where a GPU pass records the timeline)
    assert len(raw["on_wait_ms"]) == len(raw["off_wait_ms"]) == 2 and min(raw["off_wait_ms"]) >= 0
    assert all(h <= t for h, t in zip(raw["off_host_ms"], raw["off_ms"]))
    assert r["added_ms"] == statistics.median(a - b for a, b in zip(raw["on_ms"], raw["off_ms"]))
    assert r["priced_on"] == "module times" and r["priced_ms"] > 0  # a CPU records no timeline
    assert tables.reprice(r)["priced_ms"] == r["priced_ms"]  # the saved pass prices the same with this code
    saved = tmp_path / "run"
    saved.mkdir()
    with gzip.open(saved / "process-0.json.gz", "wt") as f:
        json.dump([r], f)
    (saved / "process-0").mkdir()  # where --keep-traces puts the process's traces: not a process
    (saved / "process-0" / "trace-option-0.json.gz").write_bytes(b"")
    tables.table([str(saved)])
    out = capsys.readouterr().out
    assert "| 0 | selective/moe |" in out and "| moe | selective/moe | 1 |" in out
    # --summary: the same saved process twice (two machines' runs of an option), pooled, no process rows
    tables.table([str(saved), str(saved)], summary_only=True)
    out = capsys.readouterr().out
    assert out.startswith("| model | option | processes |") and "| 0 | selective/moe |" not in out
    assert f"| moe | selective/moe | 2 | {r['added_ms']:+.1f}, {r['added_ms']:+.1f} |" in out


def test_options_together_each_run_only_their_own_labels_beside_their_own_off_steps(megatron_world):
    """``--together``: one model built with every option's labels; each option's on steps open and
    replay checkpoints of its labels alone (the others switched off), each is paired with its own off
    steps (which replay none) and priced as itself on the one shared pass."""
    bench, tables = _bench(), _tables()
    options = ["selective/moe_act", "selective/layernorm", "selective/moe_act-layernorm"]
    results = bench.measure_together(["model=moe", "size=tiny", "profile=none"], options, rounds=2, passes=2)
    assert [r["option"] for r in results] == options
    passes = [[{k: v for k, v in m.items() if k != "marks"} for m in r["raw"]["module_times"]] for r in results]
    assert passes[0] == passes[1] == passes[2] and len(passes[0]) == 3  # one shared pass each way
    for r in results:
        raw, labels = r["raw"], set(r["option"].split("/")[1].split("-"))
        assert raw["together"]["built"] == ["layernorm", "moe_act"] and raw["settle_rounds"] == bench.SETTLE_ROUNDS
        assert set(raw["cfg"]["recompute"]["recompute_modules"]) == labels  # priced as itself
        regions = raw["together"]["checkpoints"]
        assert {k for k, n in regions["forward"].items() if n} == labels, regions
        assert {k for k, n in regions["recompute"].items() if n} == labels, regions
        assert len(raw["on_ms"]) == len(raw["off_ms"]) == 2
        assert r["added_ms"] == statistics.median(a - b for a, b in zip(raw["on_ms"], raw["off_ms"]))
        assert tables.reprice(r)["priced_ms"] == r["priced_ms"]
    # each label regions' counts: the combined option's are the two options' alone, per step
    counts = [r["raw"]["together"]["checkpoints"]["forward"] for r in results]
    assert counts[2] == {**counts[0], **counts[1]}


def test_the_first_rounds_after_the_passes_are_left_out_where_they_were_timed_and_tabled_by_round(tmp_path):
    """``settled``: a saved option's figures from its rounds after the first N after its passes; rounds it
    ran untimed count (``settle_rounds``), so a process that settled measures from its first round.
    ``by_round`` shows each round's difference less its option's median, where the first rounds stand
    apart, and marks the rounds a process ran untimed."""
    tables = _tables()
    on = [300.0, 320.0, 281.0, 282.0, 281.0, 283.0]  # two slow rounds after the passes, then +1..+3
    off = [280.0] * 6
    raw = {"cfg": {"model": {"family": "standard_attn"}}, "on_ms": on, "off_ms": off, "on_host_ms": on,
           "off_host_ms": off}
    r = {"option": "selective/layernorm", "added_ms": 2.5, "raw": raw}
    assert tables.settled(r, 0) is r
    assert tables.settled(r, 2)["added_ms"] == 1.5 and tables.settled(r, 2)["on_ms"] == 281.5
    late = {**r, "raw": {**raw, "settle_rounds": 2}}  # a process that ran its two rounds untimed
    assert tables.settled(late, 2) is late and tables.settled(late, 3)["added_ms"] == 2.0
    for name, rs in (("before", [r]), ("after", [late])):
        (tmp_path / name).mkdir()
        with gzip.open(tmp_path / name / "process-0.json.gz", "wt") as f:
            json.dump(rs, f)
    rows = tables.by_round([str(tmp_path / "before")])
    assert rows[2].startswith("| one after another, recompute, dense | 1 | +17.5 | +37.5 | -1.5 | -0.5 |")
    rows = tables.by_round([str(tmp_path / "after")])
    assert rows[2].startswith("| one after another, recompute, dense | 1 | untimed | untimed | +17.5 | +37.5 |")


def test_the_pooled_summary_says_where_the_spread_between_processes_cannot_show_a_miss():
    """``--summary``'s interval: the priced median's error over the processes resampled. Processes that
    agree give a narrow interval, so a 50% miss is a miss; processes spread from +5 to +40 ms give one
    that reaches inside 20%; one or two processes give none. The count names the option either way."""
    tables = _tables()

    def option(name: str, added: list[float], priced: float) -> tuple[tuple[str, str], list[dict]]:
        return ("moe", name), [{"option": name, "added_ms": a, "priced_ms": priced} for a in added]

    rows = dict([option("tight", [10.0, 10.2, 9.8, 10.1, 9.9], 15.0), option("spread", [5.0, 40.0, 8.0, 30.0, 12.0], 18.0),
                 option("on target", [10.0, 11.0, 9.0], 10.5), option("two", [10.0, 30.0], 40.0)])
    low, high = tables.error_bounds(rows[("moe", "tight")])
    assert 0.45 < low <= 0.5 <= high < 0.55
    low, high = tables.error_bounds(rows[("moe", "spread")])
    assert low < -0.2 and high > 0.2
    assert tables.error_bounds(rows[("moe", "two")]) is None
    assert tables.error_bounds(rows[("moe", "tight")]) == tables.error_bounds(rows[("moe", "tight")])  # seeded
    lines = tables.summary(rows, interval=True)
    assert lines[0].endswith("| vs added, 90% of resamples |") and lines[5].endswith("| +100% | - |")
    assert lines[-1] == ("Priced within 20% of the added median: 1 of 4 options. Outside it, with a spread between "
                         "processes that reaches inside it: moe spread.")
    assert "resamples" not in tables.summary(rows)[0]  # a run's own table keeps its columns


def test_together_refuses_what_is_not_a_set_of_selective_labels_naming_the_fix():
    bench = _bench()
    for option in ("full", "offload=core_attn", "recompute=selective/moe_act offload=moe_act", "none"):
        with pytest.raises(SystemExit, match="measure it without --together"):
            bench.together_labels(["selective/moe_act", option])
    assert bench.together_labels(["selective/moe_act-layernorm"]) == [frozenset({"moe_act", "layernorm"})]


def test_switched_off_pauses_offload_for_the_step_and_it_moves_again_after(megatron_world):
    """An offload option's "off" step (``switched_off``) moves nothing and its gradients are the run's
    without offload, bit for bit; the steps around it, before and after, move the same bytes."""
    import torch

    bench = _bench()
    base = ["model=standard_attn", "profile=none"]

    def steps(cfg, off_at=None):
        trainer, out = build_trainer(cfg), []
        try:
            for i in range(3):
                before = trainer.offload_meter.snapshot() if trainer.offload_meter else None
                with _steps().switched_off(trainer) if i == off_at else contextlib.nullcontext():
                    trainer.compute_gradients()
                grads = {n: p.grad.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()
                         if p.grad is not None}
                out.append((grads, trainer.offload_meter.since(before)["d2h_bytes"] if before else 0))
                trainer.optimizer.step()
        finally:
            trainer.close()
        return out

    plain = steps(compose(*base))
    paired = steps(compose(*base, *bench.option_overrides("offload=core_attn-attn_proj"),
                           "offload.emulate_on_cpu=true", "offload.min_offloaded_tensor_size=0"), off_at=1)
    moved = [m for _, m in paired]
    assert moved[0] > 0 and moved[1] == 0 and moved[2] > 0, moved
    for (g, _), (h, _) in zip(plain, paired):
        assert all(torch.equal(g[n], h[n]) for n in g), "offload or its pause changed a gradient"


def test_an_option_is_recompute_or_overrides():
    bench = _bench()
    assert bench.option_overrides("selective/moe") == ["recompute=selective/moe"]
    assert bench.option_overrides("recompute=full offload=core_attn") == ["recompute=full", "offload=core_attn"]


def test_an_offload_option_is_priced_with_its_copies_and_listed_apart(megatron_world, capsys):
    bench, tables = _bench(), _tables()
    option = "offload=core_attn-attn_proj offload.emulate_on_cpu=true offload.min_offloaded_tensor_size=0"
    r = bench.measure_option(["model=standard_attn", "size=tiny", "profile=none"], option, rounds=1)
    assert r["priced_copy_ms"] > 0 and r["priced_ms"] == pytest.approx(
        r["priced_recompute_ms"] + r["priced_stall_ms"] + r["priced_overhead_ms"])
    assert r["exposed_ms"] is None and r["link_gb_s"] is None  # a CPU profiles no copy stream, has no link
    # one more step counted each moved group's wait for its reload, each micro-batch; untimed on a CPU
    from recipes.predict.estimate import num_microbatches, predict

    cfg = r["raw"]["cfg"]
    moved = sum(predict(cfg, "cpu")["host_groups_per_layer"]) * num_microbatches(cfg)
    assert r["reload_waits"] == moved > 0 and r["reload_wait_ms"] is None
    # the manager timed method by method: on, every moved group's copy out and reload; paused, none; the
    # synthetic groups the planner prices from, timed the same way (3 of their 4 moved)
    calls = r["manager_calls"]
    on, off, synthetic = (calls[k]["methods"] for k in ("on", "off", "synthetic"))
    for group_call in ("ChunkOffloadHandler.bulk_offload_group", "ChunkOffloadHandler.bulk_reload_group"):
        assert on[group_call][0] == moved and group_call not in off and synthetic[group_call][0] == 3
    assert calls["on"]["total_ms"] > calls["off"]["total_ms"] >= 0
    assert all(n > 0 and 0 <= own <= inclusive for n, own, inclusive in on.values())
    assert calls["on"]["total_ms"] == pytest.approx(sum(v[1] for v in on.values()), abs=1e-3)
    row = tables.calls_rows([(0, r)])[1]
    assert row.startswith(f"| 0 | {option} | {moved} | {on['ChunkOffloadHandler.tensor_push'][0]} |")
    assert tables.reprice(r)["priced_ms"] == r["priced_ms"]
    lines = tables.copy_rows([(0, r)])
    assert lines[0] == tables.COPY_HEADER and lines[1].startswith(f"| 0 | {option} | - |")
    # the host side profiled each way: the group marks' autograd functions run for every group (moved
    # or kept) on, never switched off; the copies out and back are copy ops the paused step does not run
    ops = r["host_ops"]
    called = {name: (calls_on, calls_off) for name, calls_on, calls_off, _, _ in ops["calls_changed"]}
    marks, copies = called["FineGrainedOffloadingGroupCommitFunction"], called["aten::copy_"]
    assert marks[0] >= moved and marks[1] == 0 and copies[0] >= copies[1] + 2 * moved, called
    assert "aten::addmm" not in called and "aten::mm" not in called  # the model's own ops, as many each way
    assert len(ops["top"]) == _steps().TOP_OPS and ops["on"]["self_ms"] > 0 and ops["off"]["self_ms"] > 0
    lines = tables.ops_rows([(0, r)])
    assert lines[0] == tables.OPS_HEADER and lines[1].startswith(f"| 0 | {option} | {r['host_added_ms']:+.1f} / ")


def test_the_copies_on_the_steps_clock_are_tabled_where_a_gpu_timed_them():
    """step_copy_rows: the rate each direction ran at inside the step, the waits and the three longest,
    numbered in the order compute met them; a process without a clock (a CPU) has no row."""
    tables = _tables()
    spans = [["out", "core_attn", 2 * 10**9, 0.0, 40.0], ["back", "core_attn", 2 * 10**9, 50.0, 90.0],
             ["wait", "core_attn", 0, 60.0, 61.5], ["wait", "attn_proj", 0, 70.0, 70.2],
             ["wait", "core_attn", 0, 80.0, 83.0], ["wait", "attn_proj", 0, 95.0, 95.1]]
    r = {"option": "offload=core_attn", "link_gb_s": 55.2, "reload_wait_ms": 4.8,
         "copies": {"d2h_gb_s": 50.0, "h2d_gb_s": 50.0}, "raw": {"copy_timeline": spans}}
    lines = tables.step_copy_rows([(1, r)])
    assert lines[0] == tables.STEP_COPY_HEADER
    assert lines[1] == ("| 1 | offload=core_attn | 55.2 | 50.0 | 50.0 | 4.8 "
                        "| core_attn #2 3.0, core_attn #0 1.5, attn_proj #1 0.2 | - |")
    assert tables.step_copy_rows([(1, {**r, "strided_out": {"core_attn": 5, "attn_proj": 0}})])[1].endswith(
        "| core_attn 5, attn_proj 0 |")
    assert tables.step_copy_rows([(1, {**r, "copies": None})]) == []


def test_the_fit_recovers_the_overhead_rates_the_added_times_were_made_with(megatron_world, tmp_path):
    """--fit: where each saved offload option's added ms is its price at a ms a group and b ms a GiB,
    the fit gives back a and b (from the defaults as a start), and its summary prices each option at
    them; an option with recompute is left out of the fit but listed."""
    import gzip
    import json

    from recipes.config import EstimateConfig

    bench, tables = _bench(), _tables()
    base = ["model=standard_attn", "size=tiny", "profile=none"]
    emulated = "offload.emulate_on_cpu=true offload.min_offloaded_tensor_size=0"
    rows = [bench.measure_option(base, f"offload={o} {emulated}", rounds=1)
            for o in ("qkv_linear", "core_attn-attn_proj")]
    rows.append(bench.measure_option(base, f"recompute=selective/layernorm offload=attn_norm {emulated}", rounds=1))
    a, b = 0.5, 7.0
    assert (a, b) != (EstimateConfig().offload_ms_per_group, EstimateConfig().offload_ms_per_gib)
    for r in rows:
        r["added_ms"] = tables.reprice(tables.at_rates(r, a, b))["priced_ms"] + (3.0 if "recompute=" in r["option"] else 0)
    with gzip.open(tmp_path / "process-0.json.gz", "wt") as f:
        json.dump(rows, f)
    out = tables.fit([str(tmp_path)])
    assert out[0] == f"estimate.offload_ms_per_group={a:.3f} estimate.offload_ms_per_gib={b:.2f} " \
                     "(least squares over 2 processes' options)"
    assert out[2] == tables.summary({})[0] and len(out) == 7
    for line in out[4:6]:  # each offload option priced at the fitted rates is what it measured
        cells = [c.strip() for c in line.split("|")]
        assert cells[7] in ("+0%", "-0%") and cells[9] in ("+0%", "-0%"), line


def test_offload_host_reads_where_the_managers_host_work_showed_from_saved_processes(tmp_path):
    """benchmarks/offload_host.py: per saved offload option, the off steps' margin (step less the host's
    own time) and recorded wait, the share of the added host work the step paid, and the pass's price of
    that host work (its group and tensor costs times what the option moves); the shares by margin; the
    in-step cost a group and a tensor by least squares. Options with recompute, or whose pass did not
    measure the manager, are left out."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("offload_host", REPO / "benchmarks" / "offload_host.py")
        host = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(host)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    cost = {"group": 0.5, "tensor": 0.1}

    def saved(option: str, added: float, host_added: float, step: float, marks: dict | None = None) -> dict:
        cfg = compose("model=moe", "size=tiny", "offload.min_offloaded_tensor_size=0", *(option.split()))
        return {"option": option, "added_ms": added, "host_added_ms": host_added,
                "raw": {"cfg": cfg, "off_ms": [step, step], "off_host_ms": [90.0, 90.0], "off_wait_ms": [3.0, 5.0],
                        "module_times": [{"marks": {"offload_ms": cost} if marks is None else marks}]}}

    rows = [saved("offload=core_attn", 18.0, 20.0, 100.0), saved("offload=expert_fc1", 5.0, 10.0, 150.0),
            saved("recompute=selective/moe_act offload=core_attn", 30.0, 30.0, 100.0),  # not offload alone
            saved("offload=moe_act", 5.0, 10.0, 100.0, marks={})]  # the pass did not measure the manager
    (tmp_path / "run").mkdir()
    with gzip.open(tmp_path / "run" / "process-0.json.gz", "wt") as f:
        json.dump(rows, f)
    read = host.rows([str(tmp_path / "run")])
    assert [r["option"] for r in read] == ["offload=core_attn", "offload=expert_fc1"]
    core, fc1 = read
    groups, tensors = host.moved(rows[0]["raw"]["cfg"])
    assert groups > 0 and tensors > groups  # core attention moves several tensors a group
    assert core["margin_ms"] == 10.0 and core["wait_ms"] == 4.0 and fc1["margin_ms"] == 60.0
    assert core["pass_ms"] == pytest.approx(groups * 0.5 + tensors * 0.1)
    assert core["lead_ms"] is None  # no timeline in this pass; a timeline's: its GPU's lag at the last mark
    assert host.lead({"names": ["a", "b"], "host_ms": [0.0, 1.0], "gpu_ms": [0.0, 5.0]}) == pytest.approx(4.0)
    out = "\n".join(host.report([str(tmp_path / "run")]))
    assert "| moe | under 40 ms | 1 | 0.90 (0.90-0.90) |" in out and "| moe | 40 ms or more | 1 | 0.50 (0.50-0.50) |" in out
    assert "least squares over 2 rows" in out and "| run | 0 | moe | offload=core_attn | 10.0 | 4.0 | - | +20.0 | +18.0 | 0.90 |" in out


def test_the_gpu_side_of_an_option_is_tabled_beside_its_added_time():
    """gpu_rows: the kernels' busy time on and off and what they added, the GPU's idle time, and the
    kernels that grew; a process that profiled nothing (a CPU) has no row."""
    tables = _tables()
    kernels = lambda norm: [{"name": "rms_norm", "ms": norm, "calls": 64}, {"name": "gemm", "ms": 200.0, "calls": 9}]  # noqa: E731
    r = {"option": "selective/layernorm", "added_ms": 4.7,
         "gpu_work": {"on": {"kernel_busy_ms": 252.0, "gpu_busy_ms": 253.0, "gpu_idle_ms": 20.0, "kernels": kernels(3.4)},
                      "off": {"kernel_busy_ms": 250.0, "gpu_busy_ms": 251.0, "gpu_idle_ms": 17.5, "kernels": kernels(1.7)}}}
    lines = tables.gpu_rows([(2, r), (3, {"option": "full", "added_ms": 1.0})])
    assert lines[0] == tables.GPU_HEADER and len(lines) == 3
    assert lines[1] == "| 2 | selective/layernorm | +4.7 | 252.0 / 250.0 | +2.0 | 20.0 / 17.5 | rms_norm +1.7 |"
