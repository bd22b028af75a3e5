"""The simulator's garbage-collection checkpoints: cycles freed, the collector's state restored."""

from __future__ import annotations

import gc
import weakref

from scenarios.sim.engine import few_collections


class _Cyclic:
    def __init__(self) -> None:
        self.me = self


def test_collector_is_off_inside_and_restored_after() -> None:
    before = gc.isenabled()
    frozen = gc.get_freeze_count()
    with few_collections():
        assert not gc.isenabled()
    assert gc.isenabled() == before
    assert gc.get_freeze_count() <= frozen  # the run's freezes are handed back


def test_restores_a_disabled_collector() -> None:
    gc.disable()
    try:
        with few_collections():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_checkpoint_frees_cycles_made_since_the_last_one() -> None:
    with few_collections() as checkpoint:
        obj = _Cyclic()
        ref = weakref.ref(obj)
        del obj
        assert ref() is not None  # the automatic collector is off: the cycle waits
        checkpoint()
        assert ref() is None


def test_survivors_frozen_at_a_checkpoint_are_collectable_after_the_run() -> None:
    with few_collections() as checkpoint:
        obj = _Cyclic()
        ref = weakref.ref(obj)
        checkpoint()  # alive here: frozen
        del obj
        checkpoint()
        assert ref() is not None  # frozen objects are not scanned during the run
    gc.collect()
    assert ref() is None
