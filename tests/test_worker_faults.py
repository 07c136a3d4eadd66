"""A worker that runs out of memory or crashes leaves a complete, honest record (CPU-testable:
the failure is injected where the real one would surface, inside the measurement loop)."""

from __future__ import annotations

import json

import torch
from omegaconf import OmegaConf

from conftest import compose
from recipes import worker
from recipes.results import merge_result


def _run(tmp_path, monkeypatch, error: BaseException) -> tuple[int, dict]:
    OmegaConf.save(OmegaConf.create(compose()), tmp_path / "config.yaml")
    monkeypatch.setattr(worker, "init_distributed", lambda cfg: None)
    monkeypatch.setattr(worker, "rank_coordinates", lambda: {"rank": 0, "tp": 0, "pp": 0, "cp": 0, "ep": 0, "dp": 0})

    def measure(cfg, result, run_dir=None):
        result["phase"] = "steady"
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
