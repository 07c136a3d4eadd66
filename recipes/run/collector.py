"""Megatron-LM's ``--manual-gc`` for this loop (``train.manual_gc``, ``train.manual_gc_interval``).

Python's automatic collector runs whenever enough objects were allocated, so a full collection (every
object the process holds: 0.27 s on a 2-core CPU after megatron-core's imports) lands inside
whichever step crosses the threshold; on many ranks, one rank's pause stalls the others at the next
collective. A training step here leaves no garbage that
only the collector can free (no reference cycles: ``tests/test_collector.py`` checks the families and
their recomputes), so with ``manual_gc`` the collector is off while training: the objects of the
build are frozen out of its reach once (``gc.freeze``), and it collects between steps every
``manual_gc_interval`` steps, outside the timed ones' clocks. The meter records any collection inside
the timed steps (``timing.gc``).
"""

from __future__ import annotations

import gc

from recipes.measure.collections import CollectionMeter


class ManualCollection:
    def __init__(self, train: dict) -> None:
        self.manual = bool(train["manual_gc"])
        self.interval = train["manual_gc_interval"]
        self.meter = CollectionMeter()
        self._was_enabled = gc.isenabled()

    def start(self) -> ManualCollection:
        self.meter.install()
        if self.manual:
            gc.collect()
            gc.freeze()  # what the build made lives for the run: later collections skip it
            gc.disable()
        return self

    def after_step(self, step: int) -> None:
        """Between steps (after a timed step's clock stopped)."""
        if self.manual and self.interval and step % self.interval == 0:
            gc.collect()

    def stop(self) -> None:
        self.meter.uninstall()
        if self.manual:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()
