"""The engine-core process freezes what start-up left alive, so that a full garbage collection
walks only what the steps allocate (run_engine_core calls freeze_start_up_heap)."""

from __future__ import annotations

import gc
import weakref

from shoal.engine_core.process import freeze_start_up_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_frozen_objects_leave_the_collector_and_new_garbage_is_still_collected() -> None:
    try:
        freeze_start_up_heap()
        frozen = gc.get_freeze_count()
        assert frozen > 0  # the modules imported so far, for one
        garbage = _Node()
        alive = weakref.ref(garbage)
        del garbage
        gc.collect()
        assert alive() is None  # created after the freeze: collected as before
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()  # back to the test process's usual collector
