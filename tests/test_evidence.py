"""tools/evidence.py: a folder of sweep directories packs into one evidence file that loads, unpacks and
renders back, byte-stably; a table that no longer matches its evidence is reported stale."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
import evidence  # noqa: E402  (tools/evidence.py)


def _point(sweep_dir, name: str, recompute: str, peak: float, overrides: list[str] | None) -> None:
    result = {"schema_version": 1, "name": f"standard_attn sdpa {recompute}", "status": "ok",
              "choices": {"model": "standard_attn", "recompute": recompute, "size": "h200"},
              "run_dir": str(sweep_dir / name), "config": None, "worst_rank": 0,
              "ranks": [{"rank": 0, "status": "ok", "device": "NVIDIA H200",
                         "memory": {"peak_allocated_gib": peak, "peak_reserved_gib": peak + 0.5}}]}
    if overrides:
        result["overrides"] = overrides
    (sweep_dir / name).mkdir(parents=True)
    (sweep_dir / name / "result.json").write_text(json.dumps(result))
    (sweep_dir / name / "config.yaml").write_text("left: out\n")  # a run directory's copy: not packed


@pytest.fixture
def packed(tmp_path, monkeypatch):
    monkeypatch.setattr(evidence, "EVIDENCE", tmp_path / "evidence")
    monkeypatch.setattr(evidence, "_CACHE", {})
    monkeypatch.setattr(evidence, "render", lambda ev: f"# {ev.name}: {len(ev.points())} points\n")
    results = tmp_path / "results"
    _point(results / "sweep_a", "p1", "none", 10.0, ["recompute=none"])
    _point(results / "sweep_a", "p2", "full", 6.0, None)
    (results / "sweep_a" / "manifest.json").write_text(json.dumps({"p2": {"overrides": ["recompute=full"]}}))
    _point(results / "other", "p3", "none", 9.0, ["recompute=none"])
    (results / "console.txt").write_text("a console line\n")
    header = {"commands": ["bash run.sh"], "date": "2026-12-06", "gpu": "NVIDIA H200", "versions": ""}
    path = evidence.pack("demo", results, ["sweep_a"], header, [results / "console.txt"])
    return path, results, header


def test_pack_keeps_the_points_their_overrides_and_the_quoted_files_only(packed):
    path, _, _ = packed
    ev = evidence.load("demo")
    assert ev.header["points"] == 2 and ev.header["gpu"] == "NVIDIA H200"
    assert ev.sweeps() == ["sweep_a"]  # only the sweeps named
    assert {p["point"]: p["overrides"] for p in ev.points()} == {"p1": ["recompute=none"], "p2": ["recompute=full"]}
    assert ev.file("console.txt")["text"] == "a console line\n"
    assert "config.yaml" not in path.read_bytes().decode("latin-1")


def test_pack_is_byte_stable_and_unpack_gives_the_results_back(packed, tmp_path):
    path, results, header = packed
    first = path.read_bytes()
    evidence.pack("demo", results, ["sweep_a"], header, [results / "console.txt"])
    assert path.read_bytes() == first  # no time stamp in the gzip header: a re-pack is not a change
    out = evidence.load("demo").unpack(tmp_path / "unpacked")
    for name in ("p1", "p2"):
        assert json.loads((out / "sweep_a" / name / "result.json").read_text()) == json.loads(
            (results / "sweep_a" / name / "result.json").read_text())
    assert not (out / "sweep_a" / "p1" / "config.yaml").exists()


def test_tables_check_reports_a_stale_table(packed):
    said = []
    assert evidence.tables(check=True, out=said.append) == 1 and "demo.md" in said[0]  # not written yet
    assert evidence.tables(check=False, out=said.append) == 0
    assert evidence.tables(check=True, out=said.append) == 0
    (evidence.EVIDENCE / "demo.md").write_text("# edited by hand\n")
    assert evidence.tables(check=True, out=said.append) == 1
