"""The residency manager: LRU eviction order, pinned models, the budget never exceeded."""

from __future__ import annotations

import random

import pytest

from nodes.residency import NoRoom, Residency


def test_evicts_least_recently_used_first_and_skips_pinned_models() -> None:
    r = Residency(100)
    for name in ("a", "b", "c"):
        r.add(name, 30)
    r.touch("a")  # LRU order now b, c, a
    assert r.plan("d", 40) == ["b"], "10 free + b's 30"
    assert r.plan("d", 70) == ["b", "c"]
    r.pin("b")
    assert r.plan("d", 40) == ["c"] and r.plan("d", 70) == ["c", "a"], "b is in use: skipped"
    r.unpin("b")
    assert r.plan("d", 10) == [] and r.plan("a", 1000) == [], "fits already / already resident"


def test_too_big_is_permanent_and_pinned_memory_is_temporary() -> None:
    r = Residency(100)
    with pytest.raises(NoRoom) as big:
        r.plan("huge", 101)
    assert big.value.permanent
    r.add("a", 60)
    r.pin("a")
    with pytest.raises(NoRoom) as busy:
        r.plan("b", 50)
    assert not busy.value.permanent and "in progress" in busy.value.reason
    with pytest.raises(ValueError):
        r.remove("a")
    with pytest.raises(NoRoom):
        r.add("b", 50)


@pytest.mark.parametrize("seed", range(20))
def test_the_budget_is_never_exceeded(seed: int) -> None:
    rng = random.Random(seed)
    sizes = {f"m{i}": rng.randint(5, 60) for i in range(8)}
    r = Residency(100)
    for _ in range(300):
        name = rng.choice(list(sizes))
        op = rng.random()
        if op < 0.6:
            try:
                for victim in r.plan(name, sizes[name]):
                    r.remove(victim)
                r.add(name, sizes[name])
            except NoRoom:
                pass
        elif op < 0.8 and name in r:
            r.pin(name)
        elif r.pinned(name):
            r.unpin(name)
        assert r.used_bytes <= 100
        assert all(n in r for n in sizes if r.pinned(n) and n in r.resident)
