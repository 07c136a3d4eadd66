"""benchmarks/bench_paired.py on a CPU (times mean nothing here): one option's paired steps run in one
process with the option on and off, its price comes from the same process's module times, a saved
process re-prices to the same figure with this code, and the table reads saved processes back."""

from __future__ import annotations

import gzip
import importlib.util
import json
import statistics

from conftest import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("bench_paired", REPO / "benchmarks" / "bench_paired.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_an_option_is_timed_against_itself_switched_off_and_priced_on_its_own_pass(megatron_world, tmp_path, capsys):
    bench = _bench()
    r = bench.measure_option(["model=moe", "size=tiny", "profile=none"], "selective/moe", rounds=2, passes=2)
    raw = r["raw"]
    assert len(raw["on_ms"]) == len(raw["off_ms"]) == 2 and len(raw["module_times"]) == 3  # 2 before, 1 after
    assert r["added_ms"] == statistics.median(a - b for a, b in zip(raw["on_ms"], raw["off_ms"]))
    assert r["priced_on"] == "module times" and r["priced_ms"] > 0  # a CPU records no timeline
    assert bench.reprice(r)["priced_ms"] == r["priced_ms"]  # the saved pass prices the same with this code
    saved = tmp_path / "run"
    saved.mkdir()
    with gzip.open(saved / "process-0.json.gz", "wt") as f:
        json.dump([r], f)
    bench.table([str(saved)])
    out = capsys.readouterr().out
    assert "| 0 | selective/moe |" in out and "| moe | selective/moe | 1 |" in out
