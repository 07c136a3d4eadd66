"""A rank's result is typed (``recipes.results.RankResult``) and its file reads as it always has."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compose
from omegaconf import OmegaConf

from recipes.files import write_json_atomic
from recipes.results import RankResult, load_rank, rank_row

#: What the dict the worker filled before RankResult wrote for ``TINY`` (its keys, in their order):
#: captured from that version's rank0.json.
TINY = ("train.train_iters=4", "measure.start_step=2", "measure.steps=2", "measure.profile=none",
        "recompute=selective/core_attn")
TINY_KEYS = ["rank", "status", "host", "device", "timeline", "coords", "num_parameters", "optimizer", "precision",
             "memory_after_init", "labels", "checkpoint_notes", "first_step", "window", "phase", "setup_s", "ledger",
             "pipeline", "checkpoints", "timing", "loss", "grad_norm", "lr", "warnings"]
TINY_VALUES = {"status": "ok", "device": "cpu", "coords": {"rank": 0, "tp": 0, "pp": 0, "cp": 0, "ep": 0, "dp": 0},
               "num_parameters": 139584, "optimizer": "torch AdamW (CPU fallback)", "precision": "fp32",
               "memory_after_init": {}, "first_step": 1, "window": [2, 3], "phase": "after_window",
               "checkpoints": {"core_attn": {"forward": 2, "recompute": 2}}}
#: The keys of its sections that do not vary (their numbers are other tests' business).
TINY_SECTIONS = {"labels": ["core_attn"],
                 "ledger": ["bytes_by_kind", "total_bytes", "control_bytes_by_kind", "control_total_bytes",
                            "without_label_total_bytes"],
                 "pipeline": ["schedule", "num_microbatches", "num_model_chunks", "warmup_forwards", "in_flight_forwards",
                              "in_flight_microbatches", "chunk_order", "layers_per_chunk", "chunk_ledger_bytes",
                              "in_flight_ledger_bytes"]}


def test_a_run_writes_the_file_the_dict_wrote(megatron_world, tmp_path, monkeypatch):
    """worker.main, in this process, on the tiny model: the same keys in the same order, the same values
    where a run does not vary (times do)."""
    from recipes.run import worker
    from recipes.run.world import reseed

    OmegaConf.save(OmegaConf.create(compose(*TINY)), tmp_path / "config.yaml")
    monkeypatch.setattr(worker, "init_distributed", lambda cfg, marks=None: reseed(cfg))  # the session's world
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: None)  # later tests use it
    monkeypatch.delenv("RANK", raising=False)
    assert worker.main(str(tmp_path)) == 0
    rank = json.loads((tmp_path / "ranks" / "rank0.json").read_text())
    assert list(rank) == TINY_KEYS
    assert {k: rank[k] for k in TINY_VALUES} == TINY_VALUES
    assert {k: list(rank[k]) for k in TINY_SECTIONS} == TINY_SECTIONS
    assert list(rank["labels"]["core_attn"]) == ["wraps", "modules", "forward", "recompute", "saved_bytes",
                                                 "saved_fraction_of_control", "flagged"]
    assert len(rank["warnings"]) == 1 and rank["warnings"][0].startswith("core_attn: recomputed 2 region(s)")
    assert len(rank["loss"]) == len(rank["grad_norm"]) == len(rank["lr"]) == 4
    assert load_rank(tmp_path / "ranks" / "rank0.json").as_dict() == rank


def test_a_failed_rank_is_written_as_the_dict_was():
    """The fields in the order recorded, only those recorded; None is written once set (``window``)."""
    result = RankResult(rank=1, status="failed", host="node7", device="cpu", timeline={"main_start": 1.0})
    result.coords = {"rank": 1}
    result.window = None
    result.phase = "before_window"
    result.ledger_warnings = ["kept until the run's end"]
    result.status, result.error, result.traceback = "failed", "RuntimeError: boom", "Traceback ..."
    old = {"rank": 1, "status": "failed", "host": "node7", "device": "cpu", "timeline": {"main_start": 1.0},
           "coords": {"rank": 1}, "window": None, "phase": "before_window",
           "_ledger_warnings": ["kept until the run's end"], "error": "RuntimeError: boom", "traceback": "Traceback ..."}
    assert json.dumps(result.as_dict()) == json.dumps(old)
    assert result.pop("ledger_warnings") == ["kept until the run's end"] and "_ledger_warnings" not in result.as_dict()
    assert result.pop("control_abandoned", False) is False
    assert result["status"] == "failed" and result.get("timing") is None and "window" in result


def test_a_misspelled_field_raises():
    result = RankResult(rank=0)
    with pytest.raises(AttributeError, match="stop_reasn"):
        result.stop_reasn = "stopped"
    with pytest.raises(TypeError):
        result["stop_reason"] = "stopped"  # no dict writes
    with pytest.raises(AttributeError):
        result.pop("stop_reasn")
    assert result.as_dict() == {"rank": 0}


def test_an_older_rank_file_loads_and_reads_back_unchanged(tmp_path):
    """A file of another version, with a key no field holds: read, typed where it can be, written back as read."""
    old = {"rank": 0, "status": "oom", "host": "h", "device": "NVIDIA H200", "timeline": {"main_start": 1.0},
           "error": "CUDA out of memory. Tried to allocate 2.00 GiB",
           "memory_at_failure": {"peak_allocated_gib": 130.5, "peak_reserved_gib": 133.0},
           "offload_copies": {"d2h_bytes": 1}}
    write_json_atomic(tmp_path / "rank0.json", old)
    rank = load_rank(tmp_path / "rank0.json")
    assert rank.status == "oom" and rank.memory_at_failure["peak_allocated_gib"] == 130.5
    assert rank.extra == {"offload_copies": {"d2h_bytes": 1}} and rank["offload_copies"] == {"d2h_bytes": 1}
    assert json.dumps(rank.as_dict()) == json.dumps(old)
    assert rank_row({"name": "p", "status": "oom"}, rank.as_dict()).peak_allocated_gib == 130.5
