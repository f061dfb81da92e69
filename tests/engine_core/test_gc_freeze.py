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
    before = _Node()  # alive at the freeze
    frozen_ref = weakref.ref(before)
    try:
        freeze_start_up_heap()
        assert gc.get_freeze_count() > 0  # the modules imported so far, for one
        garbage = _Node()
        alive = weakref.ref(garbage)
        del garbage, before
        gc.collect()
        assert alive() is None  # created after the freeze: collected as before
        # Frozen, the collector no longer walks it: not even as garbage. (The freeze count
        # itself is no measure: other threads' frozen objects may still be freed by refcount.)
        assert frozen_ref() is not None
    finally:
        gc.unfreeze()  # back to the test process's usual collector
        gc.collect()
    assert frozen_ref() is None  # unfrozen, it is garbage again
