"""``train.manual_gc`` (Megatron-LM's --manual-gc): Python's collector stays out of the training steps,
which is safe only because a step leaves no garbage that needs it."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose, train_in_process

from recipes.errors import ConfigError
from recipes.measure.collections import CollectionMeter
from recipes.validate import validate

TINY = ("size=tiny", "attention=unfused", "profile=none", "train.train_iters=3", "measure.start_step=2")


#: Run in a fresh process, as a run's worker is: a model compiled earlier in the same process (the
#: model.compile tests) leaves torch's compiled-function machinery building graphs in every eager step
#: after it (seen on CPU, torch 2.14), garbage no training process of this project makes. One process
#: checks every case in turn (a trainer each, closed before the next): the start and imports once.
CYCLE_CHECK = """
import gc, sys
sys.path.insert(0, {tests!r})
from conftest import build_trainer, compose
from recipes.run.world import init_one_rank
init_one_rank(compose())
for case, overrides in {cases!r}:
    trainer = build_trainer(compose(*overrides))
    trainer.train_step()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    trainer.train_step()
    trainer.train_step()
    found = gc.collect()
    print("FOUND", case, found, sorted({{type(o).__name__ for o in gc.garbage}})[:20], flush=True)
    gc.set_debug(0)
    gc.garbage.clear()
    gc.enable()
    trainer.close()
"""

CYCLE_CASES = [("standard_attn", "none"), ("standard_attn", "full"), ("moe", "selective/moe_act"),
               ("mla", "selective/mla_up_proj")]


@pytest.fixture(scope="session")  # not module: pytest-xdist may run other modules' tests between the cases
def cycle_check() -> tuple[dict, str]:
    """({"model/recompute": its FOUND line}, stderr) of one fresh process that checked every case."""
    cases = [(f"{model}/{recompute}", (*TINY, f"model={model}", f"recompute={recompute}"))
             for model, recompute in CYCLE_CASES]
    code = CYCLE_CHECK.format(tests=str(Path(__file__).parent), cases=cases)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    lines = [x.split(" ", 2) for x in done.stdout.splitlines() if x.startswith("FOUND ")]
    return {case: rest for _, case, rest in lines}, done.stderr[-2000:]


@pytest.mark.xdist_group("cycle-check")  # one worker makes the fresh process for every case (19 CPU-s)
@pytest.mark.parametrize("model,recompute", CYCLE_CASES)
def test_a_training_step_leaves_no_reference_cycles(cycle_check, model, recompute):
    """What makes the collector safe to turn off: after two more steps with it off, a collection finds
    nothing unreachable (no tensor held in a cycle that only it would free). Fails once a change to
    the step (ours or megatron's) builds cycles: manual_gc would then hold their memory until the next
    collection."""
    found, stderr = cycle_check
    line = found.get(f"{model}/{recompute}")
    assert line is not None, stderr
    assert line.startswith("0 "), line


def test_manual_gc_keeps_the_collector_out_of_the_timed_steps_and_restores_it(megatron_world):
    """With the collector at a hair trigger (a collection every allocation), the timed steps record
    collections unless manual_gc is on; either way the process's collector is as before afterwards."""
    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        auto = train_in_process(compose(*TINY, "train.manual_gc=false"))["timing"]["gc"]
        assert gc.isenabled()
        manual = train_in_process(compose(*TINY, "train.manual_gc=true"))["timing"]["gc"]
        assert gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.set_threshold(*threshold)
    assert not auto["manual"] and auto["collections"][0] > 0 and auto["pause_ms"] > 0
    assert manual == {"manual": True, "collections": [0, 0, 0], "pause_ms": 0.0, "max_step_pause_ms": 0.0}


def test_a_collection_that_paused_the_timed_steps_is_a_warning_naming_the_fix():
    from recipes.measure.collections import collection_findings

    timing = {"steps": 4, "step_time_s": 0.3, "gc": {"manual": False, "collections": [40, 3, 1],
                                                     "pause_ms": 120.0, "max_step_pause_ms": 110.0}}
    (warning,) = collection_findings(timing)
    assert "44 time(s)" in warning and "120.0 ms" in warning and "train.manual_gc=true" in warning
    timing["gc"]["pause_ms"] = 5.0  # under 1% of 4 x 300 ms
    assert collection_findings(timing) == [] and collection_findings({}) == []


def test_the_meter_counts_collections_by_generation():
    meter = CollectionMeter().install()
    try:
        before = meter.snapshot()
        gc.collect(0)
        gc.collect(2)
        counts, pause = meter.since(before)
    finally:
        meter.uninstall()
    assert counts == [1, 0, 1] and pause > 0
    assert meter._callback not in gc.callbacks


def test_a_negative_interval_is_refused_naming_the_option():
    with pytest.raises(ConfigError) as err:
        validate(compose("size=tiny", "train.manual_gc_interval=-1"))
    assert "train.manual_gc_interval" in str(err.value) and "100" in str(err.value)


def test_the_meter_counts_the_collectors_runs_on_any_thread():
    """A collection on another thread (autograd's backward runs on one) pauses the host too: counted;
    once uninstalled, nothing more is."""
    import threading

    gc.disable()  # no collection of the allocator's own in between: the two called for, counted
    try:
        meter = CollectionMeter().install()
        gc.collect()
        worker = threading.Thread(target=gc.collect)
        worker.start()
        worker.join()
        meter.uninstall()
        assert sum(meter.collections) == 2 and meter.pause_s > 0
        gc.collect()  # after: not counted, the callback removed
        assert sum(meter.collections) == 2 and meter._callback not in gc.callbacks
    finally:
        gc.enable()
