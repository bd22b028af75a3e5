"""The delay timer's tuner on holds made by hand: what each wait would have won."""

from __future__ import annotations

import pytest

from policies.delay_tuner import HoldBook

GRID = [0.5, 1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 40.0]


def _book(*holds: tuple[int, float, bool, bool, float], others: int = 0) -> HoldBook:
    """`holds`: (how many, waited ms, found, in time, trip ms); every request's deadline 150 ms.
    `others`: answers of the site's requests that did not wait."""
    book = HoldBook(pool=4096)
    n = 0
    for count, waited, found, in_time, trip in holds:
        for _ in range(count):
            book.resolved(f"r{n}", waited, found)
            book.answered(f"r{n}", waited + trip, in_time, 150.0)
            n += 1
    for _ in range(others):
        book.answered("", 30.0, True, 150.0)
    return book


def test_too_little_evidence_judges_nothing() -> None:
    assert _book((10, 12.0, True, True, 20.0), (5, 1.0, False, True, 45.0)).judge(GRID, 0.99) is None
    # no spill seen: a spill is taken to be in time, and a wait that wins nothing is not kept
    assert _book((40, 30.0, True, False, 130.0)).judge(GRID, 0.99)[0] == 0.5  # type: ignore[index]


def test_the_wait_that_catches_the_slots_and_no_longer() -> None:
    # holds that waited 1 ms ran out; the probes among them found the slot at 12 ms
    book = _book((70, 1.0, False, True, 45.0), (10, 12.0, True, True, 20.0), (20, 40.0, False, True, 45.0))
    judged = book.judge(GRID, 0.99)
    assert judged is not None
    pick, table = judged
    assert pick == 12.0, table
    assert table[12.0][0] > table[8.0][0] and table[40.0][0] == pytest.approx(table[12.0][0], abs=0.5)


def test_misses_a_longer_wait_adds_keep_it_short_and_misses_the_cloud_has_anyway_do_not() -> None:
    # slots at 12 ms make their deadline; those found at 30 ms came too late to (the node refused them)
    caused = _book((40, 1.0, False, True, 45.0), (40, 12.0, True, True, 20.0), (20, 30.0, True, False, 130.0))
    pick, table = caused.judge(GRID, 0.99) or (None, {})
    assert pick == 12.0 and table[32.0][1] > table[12.0][1], table
    # the same, but a third of the spills miss whatever the wait (a jittery WAN): waiting is judged on
    # what it adds, not on the misses it finds
    remote = _book(
        (27, 1.0, False, True, 45.0), (13, 1.0, False, False, 200.0), (40, 12.0, True, True, 20.0), others=400
    )
    pick, table = remote.judge(GRID, 0.99) or (None, {})
    assert table[0.5][1] >= 13 and pick == 12.0, table
