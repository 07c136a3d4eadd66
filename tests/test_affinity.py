"""launcher.cpu_cores_per_rank: each local rank pinned to cores of its own, its GPU's first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, compose

from launch.affinity import parse_cpulist, rank_cores


def test_cpulist_format():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("5") == [5]


def test_each_rank_gets_its_own_block_the_gpus_cores_first():
    allowed = list(range(16))
    near = list(range(8, 16))  # the GPU's NUMA node
    assert rank_cores(4, 0, allowed, near) == [8, 9, 10, 11]
    assert rank_cores(4, 1, allowed, near) == [12, 13, 14, 15]
    assert rank_cores(4, 2, allowed, near) == [0, 1, 2, 3]  # then the other node's
    assert rank_cores(2, 0, [0, 1, 2, 3], []) == [0, 1]
    assert rank_cores(2, 0, [2, 3], [0, 1, 2]) == [2, 3]  # only cores this process may use
    with pytest.raises(ValueError, match="need 6 cores"):
        rank_cores(3, 1, [0, 1, 2, 3], [])


def test_more_cores_than_this_machine_lets_us_use_is_refused_with_the_fix():
    from recipes.errors import ConfigError
    from recipes.validate import validate
    from recipes.validate.parallel import validate_cores

    usable = len(os.sched_getaffinity(0))
    with pytest.raises(ConfigError) as err:
        validate_cores(compose(f"launcher.cpu_cores_per_rank={usable + 1}"), usable)
    assert "launcher.cpu_cores_per_rank" in str(err.value) and f"<={usable}" in str(err.value)
    with pytest.raises(ConfigError, match="launcher.cpu_cores_per_rank"):
        validate(compose("launcher.cpu_cores_per_rank=0"))
    validate_cores(compose("launcher.cpu_cores_per_rank=1"), usable)
    validate(compose(f"launcher.cpu_cores_per_rank={usable + 1}"))  # a plan for another machine: not refused


def test_a_pinned_worker_runs_on_its_cores_and_records_them(tmp_path, monkeypatch):
    """The worker process itself is pinned (what its threads inherit), and its rank file says where."""
    from recipes.run import worker

    seen = {}
    monkeypatch.setattr(worker, "train_and_measure",
                        lambda cfg, result, run, logger=None: seen.update(cores=os.sched_getaffinity(0)))
    from omegaconf import OmegaConf

    OmegaConf.save(compose("launcher.cpu_cores_per_rank=1"), tmp_path / "config.yaml")
    import torch

    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    monkeypatch.setattr(worker, "init_distributed", lambda cfg, marks=None: None)
    monkeypatch.setattr(worker, "rank_coordinates", lambda: {})
    # main tears down a live group at its end: the session's world (megatron_world) belongs to later tests
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: None)
    try:
        assert worker.main(str(tmp_path)) == 0
        assert torch.get_num_threads() == 1  # no more CPU threads than its one core
    finally:  # this test's process runs other tests next
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)
    rank = json.loads((tmp_path / "ranks" / "rank0.json").read_text())
    assert len(rank["cpu_cores"]) == 1 and seen["cores"] == set(rank["cpu_cores"])
    assert rank["cpu_cores"][0] in before


def test_train_py_refuses_too_many_cores_before_launch(tmp_path):
    usable = len(os.sched_getaffinity(0))
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), f"launcher.cpu_cores_per_rank={usable + 1}",
                           f"output_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, WANDB_MODE="disabled"))
    assert proc.returncode == 2 and "launcher.cpu_cores_per_rank" in proc.stderr and f"<={usable}" in proc.stderr
    assert not (tmp_path / "result.json").exists() and not (tmp_path / "worker.log").exists()
