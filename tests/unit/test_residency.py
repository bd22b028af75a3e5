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


def test_a_small_old_model_is_spared_when_the_large_eviction_alone_makes_room() -> None:
    r = Residency(2048)
    for name, size in (("detector", 300), ("sensor", 100), ("cls-a", 700), ("cls-b", 700)):
        r.add(name, size)
    r.touch("cls-b")  # LRU order: detector, sensor, cls-a, cls-b
    assert r.plan("cls-c", 700) == ["cls-a"], "248 free + cls-a's 700 is enough: detector and sensor stay"
    assert r.plan("big", 1100) == ["detector", "cls-a"], "sensor's 100 is not needed once both are out"
    assert r.plan("huge", 1700) == ["detector", "cls-a", "cls-b"], "248 + 300 + 1400 = 1948 >= 1700: sensor stays"


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
