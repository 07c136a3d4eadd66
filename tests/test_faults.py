"""Faults and bad inputs: every one gets a clear answer, and nothing completed is lost.

Injected faults (real ``train.py`` processes of the tiny model on a CPU, marked slow): kill -9 of the
controller mid-sweep, kill -9 of one worker rank, Ctrl-C, two identical sweeps at once. Bad files: a
corrupt result.json, a truncated dataset. Bad inputs: ``output_dir`` in a sweep, 40 overrides, and a
table of bad overrides counted as the issue counts them (``python tests/test_faults.py`` prints it).
Each asserts what the user sees, the exit code, and that completed results survive.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, subprocess_env
from conftest import start_train as start
from test_sweep import wait_for, worker_pid

from recipes.files import write_json_atomic
from recipes.results import load_result

TINY = ["size=tiny", "train.train_iters=2", "measure.start_step=2", "measure.profile=none"]


def train(args: list[str], cwd: Path, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env=env or subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return False


def rank_pid(run_dir: Path, rank: int) -> int | None:
    """The worker process of ``rank`` for ``run_dir`` (torchrun sets RANK in each worker's environment)."""
    pid = None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"recipes.run.worker" in cmdline and str(run_dir).encode() in cmdline and f"RANK={rank}".encode() in environ:
            pid = int(proc.name)
    return pid


def dry_sweep(tmp_path: Path, *extra: str, base: list[str] = TINY) -> tuple[Path, list[Path]]:
    """A two-point sweep written without running (dry_run): its directory and point directories."""
    sweep = tmp_path / "sweep"
    done = train(["-m", "recompute=none,full", *base, f"hydra.sweep.dir={sweep}", "dry_run=true", *extra], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    points = {yaml.safe_load(p.read_text())["recompute"]["recompute_granularity"]: p.parent
              for p in sweep.glob("*/config.yaml")}  # names end in a hash: tell points apart by config
    return sweep, [points["full"], points[None]]


def fake_complete(point: Path) -> Path:
    """A complete result for ``point``, as if measured with its config: a resumed sweep must keep it."""
    config = yaml.safe_load((point / "config.yaml").read_text())
    path = point / "result.json"
    write_json_atomic(path, {"name": point.name, "status": "ok", "config": config, "ranks": [],
                             "overrides": [f"recompute={config['recompute']['recompute_granularity'] or 'none'}"]})
    return path


# --- bad inputs, refused before any point runs ----------------------------------------------------

@pytest.mark.slow
def test_output_dir_in_a_sweep_is_refused_before_any_point(tmp_path):
    done = train(["-m", "recompute=none,full", *TINY, f"output_dir={tmp_path / 'one'}"], tmp_path)
    assert done.returncode == 2
    assert "error: output_dir:" in done.stderr and "hydra.sweep.dir" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "one").exists() and not list(tmp_path.rglob("config.yaml"))


@pytest.mark.slow
def test_a_single_run_never_overwrites_another_config_in_its_output_dir(tmp_path):
    run = tmp_path / "run"
    first = train([*TINY, f"output_dir={run}", "dry_run=true"], tmp_path)
    assert first.returncode == 0, first.stderr
    stored = (run / "config.yaml").read_text()
    other = train([*TINY, f"output_dir={run}", "train.seed=7", "dry_run=true"], tmp_path)
    assert other.returncode == 2 and "output_dir" in other.stderr and "rerun=true" in other.stderr
    assert "train.seed 1234 -> 7" in other.stderr  # what differs, by name
    assert (run / "config.yaml").read_text() == stored  # untouched
    again = train([*TINY, f"output_dir={run}", "train.seed=7", "dry_run=true", "rerun=true"], tmp_path)
    assert again.returncode == 0 and "seed: 7" in (run / "config.yaml").read_text()


@pytest.mark.slow
def test_a_refused_single_run_exits_2_with_one_message(tmp_path):
    done = train([*TINY, "model.num_attention_heads=0"], tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "model.num_attention_heads" in done.stderr and "fix:" in done.stderr


@pytest.mark.slow
def test_a_refused_point_refuses_the_sweep_before_any_point_runs(tmp_path):
    """A local sweep checks every point first (as a Slurm one does): an invalid point costs no finished one."""
    sweep = tmp_path / "sweep"
    done = train(["-m", "recompute=none,selective/moe_act", *TINY, f"hydra.sweep.dir={sweep}", "dry_run=true"],
                 tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: recompute=selective/moe_act:" in done.stderr and "fix:" in done.stderr
    assert "no point was run" in done.stderr and "[dry-run]" not in done.stdout
    assert not list(sweep.rglob("config.yaml"))


#: Forty overrides of one point: a sweep of them must get a short directory and complete.
FORTY = {
    "model.num_layers": 2, "model.hidden_size": 64, "model.ffn_hidden_size": 128, "model.num_attention_heads": 4,
    "model.num_query_groups": 2, "model.vocab_size": 512, "model.normalization": "RMSNorm",
    "model.gated_linear_unit": "true", "model.activation": "silu", "model.add_bias_linear": "false",
    "model.position_embedding_type": "rope", "model.rotary_base": 10000, "model.hidden_dropout": 0.0,
    "model.attention_dropout": 0.0, "model.attention_softmax_in_fp32": "false", "model.init_method_std": 0.02,
    "model.untie_embeddings_and_output_weights": "true", "model.qk_layernorm": "false",
    "model.bias_activation_fusion": "false", "model.q_lora_rank": 32, "model.kv_lora_rank": 32,
    "model.qk_head_dim": 16, "model.qk_pos_emb_head_dim": 8, "model.v_head_dim": 16, "model.moe_router_topk": 2,
    "model.moe_ffn_hidden_size": 64, "model.moe_aux_loss_coeff": 0.0, "train.seed": 1234, "train.train_iters": 2,
    "measure.start_step": 2, "train.micro_batch_size": 2, "train.seq_length": 64, "train.lr": 0.0001,
    "train.weight_decay": 0.01, "train.clip_grad": 1.0, "train.precision": "fp32", "train.optimizer": "auto",
    "train.fused_adam": "true", "measure.ledger": "true", "measure.profile": "none",
}


def two_forty_override_sweeps(shared_runs) -> tuple[Path, list[dict]]:
    """The same one-point sweep of forty overrides started twice at once in one directory (made once a
    session: each start costs a fork server's imports), and each process's exit code and output. Two
    tests read it: the sweep with forty overrides, and two identical sweeps at once."""
    import json

    def make(path: Path) -> None:
        args = ["-m", "size=tiny", *(f"{k}={v}" for k, v in FORTY.items())]
        procs = [start(args, path), start(args, path)]
        outs = [p.communicate(timeout=300) for p in procs]
        (path / "outs.json").write_text(json.dumps([{"returncode": p.returncode, "stdout": out, "stderr": err}
                                                    for p, (out, err) in zip(procs, outs)]))

    path = shared_runs.get("two-forty-override-sweeps", make)
    return path, json.loads((path / "outs.json").read_text())


@pytest.mark.slow
def test_forty_overrides_make_a_short_directory_and_the_sweep_completes_and_reports(shared_runs):
    assert len(FORTY) == 40
    cwd, outs = two_forty_override_sweeps(shared_runs)
    assert all(o["returncode"] == 0 for o in outs), [o["stdout"][-3000:] + o["stderr"][-3000:] for o in outs]
    results = list(cwd.glob("multirun/adhoc/*/*/result.json"))
    assert len(results) == 1 and load_result(results[0])["status"] == "ok"
    assert all(len(p.name) <= 64 for p in results[0].parents[:2])  # short, whatever the overrides
    assert len(load_result(results[0])["overrides"]) == 41  # the full overrides are kept
    assert (results[0].parents[1] / "report.md").exists() and (results[0].parents[1] / "manifest.json").exists()


# --- corrupt and truncated files ------------------------------------------------------------------

@pytest.mark.slow
def test_a_corrupt_result_is_named_rerun_on_resume_and_skipped_by_report_and_advise(tmp_path, capsys):
    sweep, (full, none) = dry_sweep(tmp_path)
    kept = fake_complete(none)
    stamp = kept.stat().st_mtime_ns
    (full / "result.json").write_text('{"status": "ok", "ranks": [')  # truncated by a kill mid-write
    done = train(["-m", "recompute=none,full", *TINY, f"hydra.sweep.dir={sweep}", "dry_run=true"], tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr
    assert f"{full / 'result.json'}: not JSON, truncated" in done.stderr and "runs again" in done.stderr
    assert "[skip]" in done.stdout and "[dry-run] standard_attn sdpa full" in done.stdout
    assert kept.stat().st_mtime_ns == stamp  # the complete point is untouched
    from recipes.analyze import advise, report

    assert report.main([str(sweep), "--no-wandb"]) == 0
    assert advise.main([str(sweep), "--budget-gib", "1"]) == 0
    err = capsys.readouterr().err
    assert err.count(f"skipped {full / 'result.json'}: not JSON, truncated") == 1  # named once, not per read


@pytest.mark.slow
def test_a_truncated_dataset_is_refused_before_launch(tmp_path):
    from recipes.data.preprocess import preprocess

    (tmp_path / "a.txt").write_text("some text for a dataset. " * 200)
    (tmp_path / "b.txt").write_text("more text. " * 200)
    preprocess([tmp_path / "a.txt", tmp_path / "b.txt"], str(tmp_path / "d"), append_eod=True, progress_interval=-1)
    prefix = tmp_path / "d_text_document"
    with open(f"{prefix}.bin", "r+b") as f:
        f.truncate(1000)
    run = tmp_path / "run"
    done = train([*TINY, "data=indexed", f"data.paths=[{prefix}]", "data.split='100,0,0'", f"output_dir={run}"],
                 tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"{prefix}.bin has 1000 bytes" in done.stderr and "truncated" in done.stderr
    assert not (run / "worker.log").exists()  # no worker started


# --- processes: kill -9, Ctrl-C, two sweeps at once ----------------------------------------------

@pytest.mark.slow
def test_kill_9_of_the_controller_takes_its_worker_along(tmp_path, own_processes):
    """The worker and the fork server it was forked from (a sweep point's default) die with it."""
    from test_forkserver import fork_servers_of

    sweep = tmp_path / "sweep"
    proc = start(["-m", "recompute=none,full", *TINY[:1], "train.train_iters=30", *TINY[2:],
                  f"hydra.sweep.dir={sweep}"], tmp_path)
    pid = wait_for(lambda: next((worker_pid(p) for p in sweep.glob("*") if worker_pid(p)), None), proc)
    servers = fork_servers_of(proc.pid)
    assert len(servers) == 1
    os.kill(proc.pid, signal.SIGKILL)  # the controller alone, as the OOM killer or a lost login would
    proc.wait()
    assert gone_within(pid, 10), "the worker outlived its controller"
    assert gone_within(servers[0], 10), "the fork server outlived its controller"
    assert not list(sweep.glob("*/result.json"))  # nothing had completed; nothing half-written counts


@pytest.mark.slow
def test_kill_9_of_one_worker_rank_fails_the_run_with_a_record(tmp_path, own_processes):
    run = tmp_path / "run"
    proc = start([*TINY, "parallel=dp2", "train.train_iters=30", f"output_dir={run}"], tmp_path)
    pid = wait_for(lambda: rank_pid(run, 1), proc, timeout=120)
    time.sleep(1.0)
    os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, out + err  # a failed single run exits non-zero
    result = load_result(run)
    assert result["status"] == "failed" and "exited with code" in (result.get("error") or "") + str(result)
    assert "[failed]" in out and "Traceback" not in err
    assert rank_pid(run, 0) is None  # no rank left behind


@pytest.mark.slow
def test_ctrl_c_ends_the_sweep_in_one_line_keeps_results_and_resumes(tmp_path):
    # a point that outlasts the Ctrl-C: a forked worker of 2 steps can finish before the signal lands
    long = [*TINY[:1], "train.train_iters=100000", *TINY[2:]]
    sweep, (full, none) = dry_sweep(tmp_path, base=long)
    kept = fake_complete(none)
    stamp = kept.stat().st_mtime_ns
    proc = start(["-m", "recompute=none,full", *long, f"hydra.sweep.dir={sweep}"], tmp_path)
    pid = wait_for(lambda: worker_pid(full), proc)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends to the foreground group
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "Traceback" not in err and err.strip().count("\n") == 0 and "interrupted" in err
    assert gone_within(pid, 10) and not (full / "result.json").exists()
    assert kept.stat().st_mtime_ns == stamp
    again = train(["-m", "recompute=none,full", *long, f"hydra.sweep.dir={sweep}", "dry_run=true"], tmp_path)
    assert again.returncode == 0 and "[skip]" in again.stdout and "[dry-run] standard_attn sdpa full" in again.stdout


@pytest.mark.slow
def test_sigterm_ends_the_sweep_after_recording_its_point_and_the_rest_resume(tmp_path):
    """SIGTERM to the controller (`timeout`, `kill`, a scheduler without submitit) stops the point that
    runs, records it, and starts no further point: before, the sweep went on to the next one."""
    long = [*TINY[:1], "train.train_iters=100000", *TINY[2:]]
    sweep, (full, none) = dry_sweep(tmp_path, base=long)
    for point in (full, none):
        (point / "config.yaml").unlink()  # nothing stored: the sweep runs none first, then full
    proc = start(["-m", "recompute=none,full", *long, f"hydra.sweep.dir={sweep}"], tmp_path)
    wait_for(lambda: worker_pid(none), proc)
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGTERM)  # the controller alone; it forwards it to the worker
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    assert load_result(none)["status"] == "preempted"
    assert not (full / "result.json").exists() and not (full / "worker.log").exists()
    assert "not started, the sweep received SIGTERM" in out
    again = train(["-m", "recompute=none,full", *long, f"hydra.sweep.dir={sweep}", "dry_run=true"], tmp_path)
    assert again.returncode == 0 and "[dry-run] standard_attn sdpa full" in again.stdout


@pytest.mark.slow
def test_a_point_another_sweep_holds_is_waited_for_then_skipped_and_said(tmp_path):
    from recipes.config import slug

    sweep = tmp_path / "sweep"
    none = sweep / slug("measure.profile=none,measure.start_step=2,recompute=none,size=tiny,train.train_iters=2")
    none.mkdir(parents=True)
    with open(none / ".lock", "a+") as held:  # another sweep is running this point
        fcntl.flock(held, fcntl.LOCK_EX)
        held.truncate(0)
        held.write("4242\n")
        held.flush()
        done = train(["-m", "recompute=none,full", *TINY, f"hydra.sweep.dir={sweep}", "dry_run=true",
                      "lock_wait_s=1"], tmp_path)
    assert done.returncode == 4, done.stdout + done.stderr
    assert "[wait] standard_attn sdpa none: another run (pid 4242)" in done.stdout
    assert "[busy] standard_attn sdpa none" in done.stdout and "[dry-run] standard_attn sdpa full" in done.stdout
    assert not (none / "config.yaml").exists()  # nothing of the holder's was touched


@pytest.mark.slow
def test_two_identical_sweeps_at_once_run_each_point_once(shared_runs):
    cwd, outs = two_forty_override_sweeps(shared_runs)
    assert all(o["returncode"] == 0 for o in outs), outs
    stdout = outs[0]["stdout"] + outs[1]["stdout"]
    # one ran the point, the other skipped it: after waiting on its lock if it came while the point ran
    # (test_a_point_another_sweep_holds_is_waited_for_then_skipped_and_said holds the lock to see that)
    assert stdout.count("[ok]") == 1 and stdout.count("[skip]") == 1 and stdout.count("[wait]") <= 1
    assert [load_result(p)["status"] for p in cwd.glob("multirun/*/*/*/result.json")] == ["ok"]  # one directory


# --- W&B: never costs a result or a report --------------------------------------------------------

def test_wandb_online_without_a_network_falls_back_offline_in_bounded_time(monkeypatch, capsys):
    from recipes.analyze import logger

    monkeypatch.setattr(logger, "_checked", {})
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://10.255.255.1:9")  # unroutable: a connect that never answers
    start_s = time.time()
    log = {"name": "wandb", "mode": "online", "project": "p"}
    assert logger.usable_logger(log)["mode"] == "offline" and logger.usable_logger(log)["mode"] == "offline"
    assert time.time() - start_s < logger.ONLINE_CHECK_S + 2
    assert capsys.readouterr().err.count("warning: W&B online") == 1  # one line for the whole sweep
    monkeypatch.setattr(logger, "_checked", {})
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("NETRC", "/nonexistent")
    monkeypatch.setenv("HOME", "/nonexistent")
    assert logger.online_problem().startswith("no W&B API key")


# --- exit codes and the bad-input tally -----------------------------------------------------------

def test_exit_codes_say_what_happened():
    from recipes.run.controller import exit_code

    assert exit_code([("ok", False)]) == 0 and exit_code([("oom", False)]) == 3
    assert exit_code([("failed", False)]) == 1 and exit_code([("dry_run", False)]) == 0
    assert exit_code([("ok", True), ("oom", True)]) == 0  # an oom point is a measurement in a sweep
    assert exit_code([("ok", True), ("failed", True)]) == 1
    assert exit_code([("failed", True), ("refused", True)]) == 2 and exit_code([("busy", True)]) == 4


#: Bad inputs a new user types (overrides of train.py, estimate and advise --predict): each must be
#: refused before launch, by a ConfigError that names the option and the fix.
BAD_INPUTS = [
    ["model.num_attention_heads=0"], ["model.num_layers=0"], ["model.hidden_size=-64"], ["model.vocab_size=0"],
    ["model.ffn_hidden_size=0"], ["train.lr=-1"], ["train.lr=0"], ["train.micro_batch_size=0"],
    ["train.seq_length=0"], ["train.train_iters=1"], ["measure.start_step=0"], ["measure.start_step=9"],
    ["train.global_batch_size=3"], ["train.weight_decay=-1"], ["train.clip_grad=-0.5"], ["train.seed=-1"],
    ["train.precision=fp8"], ["train.optimizer=sgd"], ["model.hidden_dropout=1.0"], ["model.attention_dropout=-0.1"],
    ["model.init_method_std=0"], ["model.num_query_groups=0"], ["model.num_query_groups=3"], ["model.kv_channels=0"],
    ["model.rotary_base=0"], ["model.position_embedding_type=alibi"], ["model.activation=relu"],
    ["model.normalization=BadNorm"], ["model.add_bias_linear=true"], ["model=moe", "model.num_moe_experts=0"],
    ["model=moe", "model.moe_router_topk=0"], ["model=moe", "model.moe_router_topk=9"],
    ["model=moe", "model.moe_ffn_hidden_size=0"], ["model=moe", "model.experts=fast"],
    ["model=mla", "model.kv_lora_rank=0"], ["model=mla", "model.q_lora_rank=0"], ["model=mla", "model.v_head_dim=0"],
    ["model=gdn", "model.linear_attention_freq=1"], ["model=gdn", "model.linear_num_value_heads=3"],
    ["model=gdn", "model.linear_conv_kernel_dim=0"], ["+model.foo=1"], ["+model.hiden_size=3"], ["+bar=1"],
    ["+train.learning_rate=1e-3"], ["model.hidden_sise=3"], ["model.num_layers=two"], ["recompute=selective/core_atn"],
    ["attention=flash"], ["attention=te"], ["recompute=full", "recompute.recompute_num_layers=0"],
    ["recompute=full", "recompute.recompute_num_layers=9"], ["recompute=none", "recompute.recompute_modules=[mlp]"],
    ["model=standard_attn", "recompute=selective/moe_act"], ["parallel=tp2", "model.num_attention_heads=3",
                                                             "model.num_query_groups=null", "model.kv_channels=16"],
    ["parallel=pp2", "model.num_layers=3"], ["parallel=cp2"], ["parallel.tensor_model_parallel_size=0"],
    ["launcher.nproc_per_node=0"], ["launcher.nnodes=2"], ["launcher.master_port=70000"],
    ["measure.memory_fraction=2"], ["measure.memory_budget_gib=0"],
    ["measure.memory_budget_gib=19", "measure.memory_fraction=0.5"], ["measure.memory_budget_gib=19"],
    ["measure.memory_fraction=0.5"], ["measure.repeat=-1"], ["measure.peak_tflops=0"], ["data.eval_interval=-1"],
    ["data=indexed", "data.paths=[]"], ["data=indexed", "data.paths=[no/such/prefix]"], ["logger.mode=sometimes"],
    ["data.num_workers=-1"], ["data.eval_interval=5", "data.eval_iters=0"],
    # each with the option its refusal must name
    (["checkpoint.interval=-1"], "checkpoint.interval"), (["checkpoint.keep_last=-1"], "checkpoint.keep_last"),
    (["train.log_interval=-1"], "train.log_interval"), (["train.exit_interval=0"], "train.exit_interval"),
    (["train.lr_warmup_iters=-5"], "train.lr_warmup_iters"), (["train.lr=nan"], "train.lr"),
    (["train.lr=inf"], "train.lr"), (["train.clip_grad=inf"], "train.clip_grad"), (["train.min_lr=-1"], "train.min_lr"),
    (["offload.host_memory_gib=-1"], "offload.host_memory_gib"), (["offload.host_memory_gib=0"], "offload.host_memory_gib"),
    (["offload.activation_offload_fraction=0"], "offload.activation_offload_fraction"),
    (["offload.min_offloaded_tensor_size=-1"], "offload.min_offloaded_tensor_size"),
    (["data.split=abc"], "data.split"), (["data.split='0,0,0'"], "data.split"), (["data.split='98,2'"], "data.split"),
    (["recompute=selective/mlp", "recompute.recompute_modules=[mlp,mlp]"], "recompute.recompute_modules"),
    (["measure.memory_fraction=0"], "measure.memory_fraction"), (["measure.memory_fraction=nan"], "measure.memory_fraction"),
    (["measure.memory_budget_gib=-1"], "measure.memory_budget_gib"), (["estimate.mfu=1.5"], "estimate.mfu"),
    (["estimate.moe_imbalance=0.5"], "estimate.moe_imbalance"), (["estimate.host_link_gb_s=0"], "estimate.host_link_gb_s"),
    (["lock_wait_s=-1"], "lock_wait_s"), (["lock_wait_s=nan"], "lock_wait_s"),
    (["model.vocab_size=256"], "model.vocab_size"), (["model.kv_channels=15"], "model.kv_channels"),
    (["model.hidden_size=66", "model.num_attention_heads=6", "model.num_query_groups=null"], "model.hidden_size"),
    (["model=mla", "model.qk_pos_emb_head_dim=7"], "model.qk_pos_emb_head_dim"),
    (["parallel=pp2", "parallel.num_layers_in_first_pipeline_stage=-1"], "parallel.num_layers_in_first_pipeline_stage"),
    (["parallel.pipeline_model_parallel_size=0"], "parallel.pipeline_model_parallel_size"),
    (["launcher.nnodes=0"], "launcher.nnodes"), (["train.seq_length=10000000"], "allow_over_memory"),
    (["model.num_layers=abc"], "model.num_layers"), (["train.lr=x"], "train.lr"), (["model=mooe"], "model=mooe"),
    (["recompute=selective/moe_ac"], "recompute=selective/moe_ac"), (["model.hiden_size=3"], "model.hiden_size"),
    (["parallel=pp3"], "parallel=pp3"), (["recipe=llama3_8b", "model=moe"], "model=moe"),
    (["recipe=llama3_8b", "model.num_layers=8"], "model.num_layers"),
    (["recipe=llama3_8b", "model.hidden_size=128"], "model.hidden_size"),
    # found by the audit of the user's path (its issue's closing note): the planner's cluster, megatron's router
    (["cluster.host_memory_gib=-1"], "cluster.host_memory_gib"), (["cluster.gpus_per_node=0"], "cluster.gpus_per_node"),
    (["cluster.nodes=-1"], "cluster.nodes"), (["cluster.gpu=nosuch"], "cluster.gpu"),
    (["model=moe", "model.moe_router_load_balancing_type=foo"], "model.moe_router_load_balancing_type"),
    (["parallel=pp2", "parallel.num_layers_in_last_pipeline_stage=5"], "parallel.num_layers_in_last_pipeline_stage"),
]


def tally(inputs: list = BAD_INPUTS) -> dict:
    """Each bad input through what the controller runs before launch (compose, a recipe's depth, ``check_point``: the
    rules, the estimator's memory checks, the data checks; on a machine without a GPU), counted: refused
    clearly (a ConfigError naming an option, the one given with the input where given, with a fix), a
    traceback (any other exception), or silent (accepted). train.py exits 2 on each of them."""
    from recipes.errors import ConfigError
    from recipes.recipe import compose_recipe
    from recipes.run.controller import check_point

    counts = {"tried": len(inputs), "refused clearly": 0, "tracebacks": 0, "silent": 0}
    failures = []
    for item in inputs:
        overrides, option = item if isinstance(item, tuple) else (item, None)
        try:
            cfg, _ = compose_recipe(overrides, on_gpu=False)  # recipe=: as the controller applies it
            check_point(cfg, num_gpus=0)
        except ConfigError as err:
            clear = bool(err.option) and "\n  fix: " in str(err) and bool(err.fix) and option in (None, err.option)
            counts["refused clearly" if clear else "tracebacks"] += 1
            if not clear:
                failures.append((overrides, f"unclear or another option: {err}"))
            continue
        except Exception as err:  # what a user would see as a raw traceback
            counts["tracebacks"] += 1
            failures.append((overrides, f"{type(err).__name__}: {err}"))
            continue
        counts["silent"] += 1
        failures.append((overrides, "accepted"))
    counts["failures"] = failures
    return counts


def test_every_bad_input_is_refused_clearly():
    counts = tally()
    assert counts["failures"] == [] and counts["refused clearly"] == counts["tried"] >= 110, counts


if __name__ == "__main__":
    result = tally()
    print("| bad inputs tried | refused clearly | tracebacks | silent |\n|---|---|---|---|\n"
          f"| {result['tried']} | {result['refused clearly']} | {result['tracebacks']} | {result['silent']} |")
    for overrides, what in result["failures"]:
        print(f"  {' '.join(overrides)}: {what}")


def test_memory_budget_caps_the_allocator_at_that_many_gib(monkeypatch):
    """``measure.memory_budget_gib``: the allocator's cap is the budget's share of this GPU's memory;
    a budget above the GPU is refused, naming the option and this GPU's size."""
    import torch

    from recipes.errors import ConfigError
    from recipes.files import GIB
    from recipes.run.worker import cap_allocator

    caps = []

    class Props:
        total_memory = 139.8 * GIB

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: Props)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", caps.append)
    cap_allocator({"memory_fraction": None, "memory_budget_gib": 19})
    assert caps == [pytest.approx(19 / 139.8)]
    with pytest.raises(ConfigError, match=r"measure.memory_budget_gib.*139.8 GiB"):
        cap_allocator({"memory_fraction": None, "memory_budget_gib": 200})
    cap_allocator({"memory_fraction": 0.5, "memory_budget_gib": None})
    assert caps[-1] == 0.5
