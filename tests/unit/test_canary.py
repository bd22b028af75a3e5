"""The canary's rule (router.lifecycle.canary), as the router and the simulator both follow it: arms
drawn by hash, a worse candidate rolled back early with confidence, a sound one promoted once shown not
worse, no verdict before the figures allow one; and the shipped policy-canary scenario simulated."""

from __future__ import annotations

import random

from router.lifecycle.canary import CANDIDATE, CONTROL, Canary, CanarySpec
from scenarios.replay.run import replay_sim
from scenarios.spec.schema import load_scenario

GUARD = {"interval_s": 1, "min_requests": 100, "min_rollback": 30, "promote_after_s": 10, "margin": 0.02}


def _spec(**kw: object) -> CanarySpec:
    return CanarySpec.model_validate({"candidate": {"preset": "p2c"}, "share": 0.2, "guard": GUARD, **kw})


def test_arms_are_a_stable_share_of_keys_and_the_salt_moves_them() -> None:
    c = Canary(_spec(), 0.0)
    arms = [c.arm(f"client-{i}") for i in range(20_000)]
    assert 0.18 < arms.count(CANDIDATE) / len(arms) < 0.22
    assert arms == [c.arm(f"client-{i}") for i in range(20_000)]  # the same key, the same arm
    other = Canary(_spec(salt="router-group-2"), 0.0)
    assert sum(a != other.arm(f"client-{i}") for i, a in enumerate(arms)) > 1000


def _feed(c: Canary, good: dict[str, float], seconds: float, rate: float = 100.0) -> str | None:
    rng = random.Random(3)
    t = 0.0
    while t < seconds * 1000:
        t += 1000.0 / rate
        arm = c.arm(str(rng.random()))
        ok = rng.random() < good[arm]
        c.observe(arm, 200 if ok else 503, 10.0, 50.0)
        verdict = c.judge(t)
        if verdict is not None:
            return f"{verdict.action}@{t / 1000:.1f}"
    return None


def test_a_worse_candidate_is_rolled_back_early_and_a_sound_one_promoted_after_its_time() -> None:
    rolled = _feed(Canary(_spec(), 0.0), {CONTROL: 0.99, CANDIDATE: 0.7}, 60)
    assert rolled is not None and rolled.startswith("rollback@") and float(rolled.split("@")[1]) < 5
    promoted = _feed(Canary(_spec(), 0.0), {CONTROL: 0.99, CANDIDATE: 0.995}, 60)
    assert promoted is not None and promoted.startswith("promote@") and float(promoted.split("@")[1]) >= 10
    # a candidate about as good as the margin: neither shown worse nor shown not worse, for a while
    assert _feed(Canary(_spec(), 0.0), {CONTROL: 0.99, CANDIDATE: 0.965}, 8) is None


def test_late_answers_count_as_not_in_time() -> None:
    c = Canary(_spec(), 0.0)
    c.observe(CONTROL, 200, 80.0, 50.0)
    c.observe(CONTROL, 200, 20.0, 50.0)
    c.observe(CONTROL, 500, 20.0, 50.0)
    assert c.arms[CONTROL].in_time == 1 and c.arms[CONTROL].errors == 1 and c.arms[CONTROL].answers == 3


def test_the_policy_canary_scenario_rolls_back_the_worse_and_promotes_the_better() -> None:
    scenario = load_scenario("policy-canary")
    report = replay_sim(scenario, list(scenario.policies))
    worse = [d for d in report["policies"]["worse"]["canary"]["decisions"] if d["step"] != "start"]
    better = [d for d in report["policies"]["better"]["canary"]["decisions"] if d["step"] != "start"]
    assert [d["step"] for d in worse] == ["rollback"] and worse[0]["at_s"] < 30
    assert [d["step"] for d in better] == ["promote"]
    assert report["policies"]["worse"]["lost"] == 0 and report["policies"]["better"]["lost"] == 0
