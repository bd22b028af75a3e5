"""The simulator's garbage-collection checkpoints: cycles freed, the collector's state restored."""

from __future__ import annotations

import gc
import weakref

import pytest

from scenarios.sim.engine import MAX_SKIPPED, few_collections


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


def test_after_a_collection_that_found_nothing_checkpoints_may_only_freeze_but_not_for_long() -> None:
    """A run that makes no cycles skips most collections (scanning its survivors costs as much); a
    cycle made meanwhile is kept (frozen) to the end, a collection comes within MAX_SKIPPED
    checkpoints, and one that finds garbage makes the next checkpoint collect again."""
    with few_collections() as checkpoint:
        for _ in range(10):  # (until what the test runner left is gone and a checkpoint skips)
            if checkpoint() is None:
                break
        obj = _Cyclic()
        ref = weakref.ref(obj)
        del obj
        assert (checkpoint() or 0) >= 1 and ref() is None, "after one skip, the next checkpoint collects"
        assert checkpoint() is not None, "that collection found garbage: this one collects too"
        obj = _Cyclic()
        skipped = weakref.ref(obj)
        del obj
        assert checkpoint() is None and skipped() is not None, "it found none: frozen, not collected"
        gaps = [checkpoint() is None for _ in range(2 * MAX_SKIPPED + 4)]
        assert not all(gaps[: MAX_SKIPPED + 1]), "a collection within MAX_SKIPPED checkpoints"
        assert gaps.count(True) >= MAX_SKIPPED, "while none finds garbage, the skips grow"
    gc.collect()
    assert skipped() is None, "the skipped cycle is collectable after the run"


def test_answers_give_back_what_was_put(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain request's answer, kept in arrays during the run, comes back as the same `Result` (made a
    chunk at a time from the end, each chunk's columns cut off after it)."""
    from types import SimpleNamespace

    from scenarios.sim import state
    from scenarios.sim.state import Answers
    from scenarios.spec.workload import Arrival, Result

    monkeypatch.setattr(state, "FILL_CHUNK", 2)  # (three answers: two chunks)
    answers = Answers(3)
    arrivals = [Arrival(0.001 * i, "edge-a", "m", 0, 100.0) for i in range(3)]
    served = SimpleNamespace(node=SimpleNamespace(spec=SimpleNamespace(id="n7")), exec_ms=1.25, queue_ms=0.1, rows=4)
    answers.put(0, 200, 3.141592653589793, "", served)  # type: ignore[arg-type]
    answers.put(2, 503, 0.5, "node queue full", None)
    results: list[Result | None] = [None, None, None]
    answers.fill(results, arrivals)
    assert results == [
        Result(arrivals[0], 200, 3.141592653589793, "n7", "", 1.25, 0.1, 4),
        None,  # nothing put: no answer here
        Result(arrivals[2], 503, 0.5, "none", "node queue full"),
    ]
    assert len(answers.status) == len(answers.node) == len(answers.rows) == 0  # emptied as it went
