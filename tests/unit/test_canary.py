"""The canary's rule (router.lifecycle.canary), as the router and the simulator both follow it: arms
drawn by hash, a worse candidate rolled back early with confidence, a sound one promoted once shown not
worse, no verdict before the figures allow one; and the shipped policy-canary scenario simulated."""

from __future__ import annotations

import random
from typing import Any

from router.lifecycle.canary import CANDIDATE, CONTROL, Canary, CanarySpec, ModelCanarySpec
from scenarios.replay.simulated import replay_sim
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


def _model_spec(**kw: object) -> ModelCanarySpec:
    shadow = {"share": 1.0, "min_compared": 40, "min_agreement": 0.95}
    return ModelCanarySpec.model_validate(
        {"model": "classifier", "version": "2", "share": 0.2, "guard": GUARD, "shadow": shadow, **kw}
    )


def _feed_shadow(c: Canary, agree_share: float, seconds: float) -> str | None:
    """Both arms answer well; the candidate's mirrored copies agree `agree_share` of the time."""
    rng = random.Random(4)
    t = 0.0
    while t < seconds * 1000:
        t += 10.0
        arm = c.arm(str(rng.random()))
        c.observe(arm, 200, 10.0, 50.0)
        if arm == CONTROL:
            c.compared(rng.random() < agree_share)
        verdict = c.judge(t)
        if verdict is not None:
            return f"{verdict.action}@{t / 1000:.1f}: {verdict.why}"
    return None


def test_a_version_whose_mirrored_answers_disagree_is_rolled_back_and_a_faithful_one_promoted() -> None:
    unfaithful = _feed_shadow(Canary(_model_spec(), 0.0), 0.1, 60)
    assert unfaithful is not None and unfaithful.startswith("rollback@") and "agree" in unfaithful
    assert float(unfaithful.split("@")[1].split(":")[0]) < 5  # (50 copies at 80 a second: within a second or two)
    faithful = _feed_shadow(Canary(_model_spec(), 0.0), 1.0, 60)
    assert faithful is not None and faithful.startswith("promote@"), faithful
    # without copies compared a shadowed canary is not promoted (agreement not shown): none reach it
    silent = Canary(_model_spec(), 0.0)
    assert _feed(silent, {CONTROL: 0.99, CANDIDATE: 0.995}, 60) is None


def test_a_model_canary_spec_names_its_version_and_refuses_nonsense() -> None:
    import pytest
    from pydantic import ValidationError

    assert _model_spec().describe() == {"model": "classifier", "version": "2", "shadow": True}
    for bad in ({"version": "v2"}, {"model": "a/b"}, {"shadow": {"share": 0}}, {"shadow": {"max_in_flight": 0}}):
        with pytest.raises(ValidationError):
            _model_spec(**bad)


def test_route_model_sends_the_candidate_arm_to_its_version_and_a_promotion_pins_it() -> None:
    from router.canary import CanaryHolder

    class _Router:  # what the holder reads of a router: its clock and id (audits)
        router_id = "r1"
        now = 0.0

        def clock(self) -> float:
            return self.now

    router: Any = _Router()
    holder = CanaryHolder()
    holder.start_model(router, _model_spec(shadow=None, share=0.5, by="client"), "test")
    seen = {holder.route_model("classifier", lambda by, i=i: f"client-{i}")[1:] for i in range(200)}
    assert seen == {(CONTROL, ""), (CANDIDATE, "2")}
    assert holder.route_model("other", lambda by: "x") == (None, None, "")
    run = holder.models["classifier"]
    for i in range(400):  # both arms as good: promoted once the guard allows
        arm = run.canary.arm(f"k{i}")
        holder.observe_model(run, arm, 200, 5.0, 50.0)
    router.now = 60_000.0
    holder.judge(router)
    assert "classifier" not in holder.models and holder.pinned == {"classifier": "2"}
    assert holder.route_model("classifier", lambda by: "anyone") == (None, None, "2")
    assert holder.stop_model(router, "classifier", "by hand") and holder.pinned == {}
    assert [e["step"] for e in holder.log] == ["start", "promote", "unpin"]


def test_shadow_compares_top_classes_of_every_output_both_answers_carry() -> None:
    import json

    from router.dispatch import Outcome
    from router.shadow import agree, top_classes

    def answer(rows: list[list[float]], status: int = 200) -> Outcome:
        doc = {"outputs": [{"name": "probs", "datatype": "FP32", "shape": [len(rows), len(rows[0])],
                            "data": [x for r in rows for x in r]}]}  # fmt: skip
        return Outcome(status, json.dumps(doc).encode(), {"Content-Type": "application/json"})

    a = top_classes(answer([[0.1, 0.9], [0.8, 0.2]]))
    assert a == {"probs": [1, 0]}
    assert agree(a, {"probs": [1, 0]}) is True and agree(a, {"probs": [1, 1]}) is False
    assert agree(a, {"other": [0]}) is None
    assert top_classes(answer([[0.1, 0.9]], status=503)) is None
    assert top_classes(Outcome(200, b"not json", {})) is None
