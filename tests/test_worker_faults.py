"""A worker that runs out of memory or crashes leaves a complete, honest record (CPU-testable:
the failure is injected where the real one would surface, inside the measurement loop)."""

from __future__ import annotations

import json
import os

import torch
from conftest import compose
from omegaconf import OmegaConf

from recipes.config import typed
from recipes.results import merge_result
from recipes.run import worker, world
from recipes.run.trainer import use_fused_adam


def _run(tmp_path, monkeypatch, error: BaseException) -> tuple[int, dict]:
    OmegaConf.save(OmegaConf.create(compose()), tmp_path / "config.yaml")
    monkeypatch.setattr(worker, "init_distributed", lambda cfg, marks=None: None)
    monkeypatch.setattr(worker, "rank_coordinates", lambda: {"rank": 0, "tp": 0, "pp": 0, "cp": 0, "ep": 0, "dp": 0})

    def measure(cfg, result, run_dir=None, logger=None):
        result.phase = "steady"
        raise error

    monkeypatch.setattr(worker, "train_and_measure", measure)
    code = worker.main(str(tmp_path))
    return code, json.loads((tmp_path / "ranks" / "rank0.json").read_text())


def test_out_of_memory_is_recorded_as_oom(tmp_path, monkeypatch):
    msg = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.80 GiB"
    code, rank = _run(tmp_path, monkeypatch, torch.OutOfMemoryError(msg))
    assert code == 3 and rank["status"] == "oom" and rank["error"].startswith("CUDA out of memory")
    assert rank["phase"] == "steady" and "memory_at_failure" in rank
    result = merge_result(tmp_path, {"name": "p"}, 1, "workers exited with code 3")
    assert result["status"] == "oom"  # a complete result: the sweep records it and goes on


def test_crash_is_recorded_as_failed_with_the_error(tmp_path, monkeypatch):
    code, rank = _run(tmp_path, monkeypatch, RuntimeError("boom"))
    assert code == 1 and rank["status"] == "failed" and rank["error"] == "RuntimeError: boom"
    assert "Traceback" in rank["traceback"]
    assert merge_result(tmp_path, {"name": "p"}, 1, "exit 1")["status"] == "failed"


def test_no_rank_file_is_still_a_failed_result(tmp_path):
    result = merge_result(tmp_path, {"name": "p"}, 2, "workers exited with code -9")
    assert result["status"] == "failed" and "-9" in result["error"]


def test_an_allocation_failure_inside_nccl_is_recorded_as_oom(tmp_path, monkeypatch):
    # What the dense control printed at size=h200_long on the H200 (2026-11-29): NCCL could not
    # allocate 608 bytes because the activations had taken the GPU. It is an OOM, not a crash.
    msg = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, unhandled cuda error\n"
           "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nFailed to CUDA calloc async 608 bytes")
    code, rank = _run(tmp_path, monkeypatch, torch.distributed.DistBackendError(msg))
    assert code == 3 and rank["status"] == "oom" and "calloc" in rank["error"]
    other = torch.distributed.DistBackendError("NCCL error: remote process exited")
    assert not worker.is_oom(other)  # a lost peer stays a failure


def test_an_oom_in_the_in_run_control_ledger_keeps_the_measurements(megatron_world, monkeypatch):
    """The control pass (labels switched off) runs after the timed steps; when it does not fit
    (the reason the user recomputes), the run is still ok, with its timing and a warning."""
    from conftest import train_in_process

    from recipes.run.trainer import Trainer

    def ledger_pass(self, disabled_labels=()):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1024.00 MiB.")

    monkeypatch.setattr(Trainer, "ledger_pass", ledger_pass)
    rank = train_in_process(compose("size=tiny", "recompute=selective/mlp"))
    assert rank["status"] == "ok" and rank["timing"]["steps"] > 0
    assert rank["ledger"]["control_error"].startswith("oom") and "control_total_bytes" not in rank["ledger"]
    assert any("control ledger" in w and "out of memory" in w for w in rank["warnings"])
    assert rank["checkpoints"]["mlp"]["recompute"] > 0  # the option itself was measured


def test_the_control_ledger_runs_after_the_timed_steps(megatron_world, monkeypatch):
    """Order matters for the reserved peak: a control pass before the timed steps would leave its
    larger blocks cached in the allocator and the option's fragmentation would read the control's."""
    from conftest import train_in_process

    from recipes.run.trainer import Trainer

    seen = []
    step, ledger_pass = Trainer.step, Trainer.ledger_pass
    monkeypatch.setattr(Trainer, "step", lambda self, record_ledger=False: seen.append("step") or step(self, record_ledger))
    monkeypatch.setattr(Trainer, "ledger_pass", lambda self, d=(): seen.append("control") or ledger_pass(self, d))
    rank = train_in_process(compose("size=tiny", "recompute=selective/mlp", "train.train_iters=4",
                                    "measure.start_step=2"))
    assert seen[:4] == ["step"] * 4 and seen[-1] == "control" and seen.count("control") == 1  # (+ the profiled step)
    assert rank["ledger"]["control_total_bytes"] > rank["ledger"]["total_bytes"]


def test_fused_adam_switches_the_torch_optimizer_and_matches_foreach():
    """train.fused_adam: torch's fused AdamW kernel, the same update as the foreach default."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32)) for _ in range(2)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fused, plain = torch.optim.AdamW(params, lr=1e-2), torch.optim.AdamW(twins, lr=1e-2)
    assert use_fused_adam(fused) == 1 and fused.param_groups[0]["fused"] is True
    for _ in range(3):
        for p, q in zip(params, twins):
            p.grad = q.grad = torch.randn_like(p)
        fused.step()
        plain.step()
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q)


def test_the_step_leaves_the_loss_on_the_device(megatron_world):
    """No host sync between backward and the optimizer: ``step`` returns the loss as a tensor (the
    worker reads it after the step's own synchronization), ``compute_gradients`` a float."""
    from conftest import build_trainer

    trainer = build_trainer(compose("size=tiny"))
    try:
        loss = trainer.step()
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and not loss.requires_grad
        assert isinstance(trainer.compute_gradients(), float)
    finally:
        trainer.close()


def test_the_time_breakdown_splits_the_distributed_init():
    """The H200 spent 8-14 s of each point in "init": the breakdown names its parts, in order."""
    from recipes.run.console import time_breakdown

    marks = {"main_start": 11.0, "megatron_imported": 13.0, "device_ready": 14.0, "process_group_ready": 17.0,
             "distributed_ready": 18.0, "built": 19.0, "warmed_up": 21.0, "steady_done": 22.0}
    phases = time_breakdown({"launched": 10.0, "wall_s": 13.0, "ranks": [{"timeline": marks}]})
    assert list(phases)[:5] == ["start+imports", "megatron imports", "device init", "process group", "parallel state"]
    assert phases["process group"] == 3.0 and phases["findings+exit"] == 1.0 and phases["wall"] == 13.0


def test_the_time_breakdown_follows_the_marks_order_where_module_times_move():
    """A point times its modules right after the window, an offloading one after its other measurements:
    each phase is the time since the mark before it in time, never negative."""
    from recipes.run.console import time_breakdown

    base = {"main_start": 11.0, "built": 12.0, "warmed_up": 13.0, "steady_done": 14.0}
    first = {**base, "modules_timed": 15.0, "profile_done": 17.0, "ledgers_done": 17.5}
    last = {**base, "profile_done": 16.0, "ledgers_done": 16.5, "modules_timed": 17.5}
    for marks, expected in ((first, ["module times", "profile", "control ledgers"]),
                            (last, ["profile", "control ledgers", "module times"])):
        phases = time_breakdown({"launched": 10.0, "wall_s": 8.0, "ranks": [{"timeline": marks}]})
        assert [k for k in phases if k in expected] == expected and min(phases.values()) >= 0
        assert sum(v for k, v in phases.items() if k != "wall") == 8.0


def test_a_one_process_worker_that_exits_next_leaves_its_group_to_the_exit(tmp_path, monkeypatch):
    """serve() ends the process right after main: a one-rank group is not torn down (NCCL's teardown
    took 1.5 s of each sweep point's exit on the H200); with other ranks, or when the caller goes on,
    it is destroyed after the last barrier, as before."""
    OmegaConf.save(OmegaConf.create(compose()), tmp_path / "config.yaml")
    monkeypatch.setattr(worker, "init_distributed", lambda cfg, marks=None: None)
    monkeypatch.setattr(worker, "rank_coordinates", lambda: {"rank": 0})
    monkeypatch.setattr(worker, "train_and_measure", lambda cfg, result, run_dir=None, logger=None: None)
    calls, group = [], {"size": 1}
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: group["size"])
    monkeypatch.setattr(torch.distributed, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: calls.append("destroy"))
    assert worker.main(str(tmp_path), exiting=True) == 0 and calls == ["barrier"]
    calls.clear()
    assert worker.main(str(tmp_path)) == 0 and calls == ["barrier", "destroy"]
    calls.clear()
    group["size"] = 2
    assert worker.main(str(tmp_path), exiting=True) == 0 and calls == ["barrier", "destroy"]


def test_a_one_rank_world_takes_a_port_of_its_own(monkeypatch):
    """init_one_rank (the benchmarks' world): torchrun's variables for rank 0 of 1, and never an
    inherited MASTER_PORT, which may be a parent's live rendezvous."""
    for name, value in (("MASTER_ADDR", "gpu01"), ("MASTER_PORT", "1"), ("RANK", "3"), ("WORLD_SIZE", "8"),
                        ("LOCAL_RANK", "3")):
        monkeypatch.setenv(name, value)  # restored after the test
    seen = []
    monkeypatch.setattr(world, "init_distributed", lambda cfg, marks=None: seen.append(cfg))
    cfg = compose()
    world.init_one_rank(cfg)
    assert seen == [typed(cfg)]  # the typed run config
    env = {k: os.environ[k] for k in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    assert env == {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    assert os.environ["MASTER_PORT"] != "1"
