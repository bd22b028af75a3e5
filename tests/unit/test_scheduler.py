"""The node scheduler: EDF within priority, batch formation, the FIKIT block bound, admission."""

from __future__ import annotations

import random

import pytest

from nodes.scheduler import BatchPolicy, Scheduler, Work


def ms(model: str, rows: int) -> float:
    # a sublinear batch curve: 4 ms for one row, +1 ms per extra row; "bulk" is 3x slower
    base = 4.0 + (rows - 1) * 1.0
    return base * (3 if model == "bulk" else 1)


def work(
    name: str, priority: int = 0, deadline: float | None = None, rows: int = 1, at: float = 0.0, model: str = "m"
) -> Work:
    return Work(name, model, priority, deadline, rows, at)


def drain(s: Scheduler, now: float = 0.0) -> list[str]:
    order = []
    while True:
        d = s.next(now)
        if not d.batch:
            return order
        order += [w.handle for w in d.batch]


def test_priority_then_earliest_deadline_then_arrival() -> None:
    s = Scheduler("priority", ms)
    for w in [
        work("low-late", 0, 900),
        work("low-soon", 0, 500),
        work("high-late", 10, 800),
        work("high-soon", 10, 300),
        work("mid", 5, 100),
        work("low-nodeadline", 0, None),
        work("low-soon-2", 0, 500),
    ]:
        s.push(w)
    assert drain(s) == ["high-soon", "high-late", "mid", "low-soon", "low-soon-2", "low-late", "low-nodeadline"]


def test_fifo_ignores_priority() -> None:
    s = Scheduler("fifo", ms)
    for w in [work("a", 0), work("b", 10), work("c", 5)]:
        s.push(w)
    assert drain(s) == ["a", "b", "c"]


def test_batches_take_rows_up_to_max_batch_and_do_not_mix_classes() -> None:
    s = Scheduler("priority", ms, batching={"m": BatchPolicy(max_batch=4)}, max_block_ms=100)
    for w in [work("h1", 10), work("h2", 10, rows=2), work("h3", 10, rows=2), work("l1", 0), work("l2", 0)]:
        s.push(w)
    assert [w.handle for w in s.next(0).batch] == ["h1", "h2"]  # h3 would make 5 rows
    assert [w.handle for w in s.next(0).batch] == ["h3"]  # not mixed with the low ones
    assert [w.handle for w in s.next(0).batch] == ["l1", "l2"]
    assert s.queued == 0


def test_dynamic_batching_waits_for_more_low_priority_rows_but_never_for_high() -> None:
    s = Scheduler("priority", ms, batching={"m": BatchPolicy(max_batch=4, max_queue_delay_ms=5)}, max_block_ms=100)
    s.push(work("l1", 0, at=10.0))
    d = s.next(11.0)
    assert d.batch == [] and d.wake_at_ms == 15.0
    s.push(work("l2", 0, at=12.0))
    assert [w.handle for w in s.next(15.0).batch] == ["l1", "l2"]
    s.push(work("h", 10, at=20.0))
    assert [w.handle for w in s.next(20.0).batch] == ["h"]
    for i in range(4):
        s.push(work(f"f{i}", 0, at=30.0))
    assert len(s.next(30.0).batch) == 4, "a full batch goes at once"


def test_requests_that_cannot_meet_their_deadline_leave_before_running() -> None:
    s = Scheduler("priority", ms)
    s.push(work("hopeless", 10, deadline=103.0))  # needs 4 ms, only 3 left
    s.push(work("fine", 10, deadline=200.0))
    d = s.next(100.0)
    assert [w.handle for w in d.expired] == ["hopeless"]
    assert [w.handle for w in d.batch] == ["fine"]
    assert s.queued == 0


def test_queue_limits_per_priority_answer_429_or_503() -> None:
    s = Scheduler("priority", ms, max_queue=3, queue_limits={-10: 1, 0: 2, 5: 3})
    s.push(work("shed", -1))
    assert s.refuse(-1) == (429, "node queue for priority -1 is full (1 waiting, limit 1)")
    s.push(work("b1", 0))
    s.push(work("b2", 0))
    status, reason = s.refuse(0)  # type: ignore[misc]
    assert status == 429 and "limit 2" in reason
    assert s.refuse(10) is None
    for i in range(3):
        s.push(work(f"c{i}", 10))
    status, reason = s.refuse(10)  # type: ignore[misc]
    assert status == 503 and "priority 10" in reason


def test_removed_work_is_skipped() -> None:
    s = Scheduler("priority", ms)
    a, b = work("a", 10), work("b", 10)
    s.push(a)
    s.push(b)
    assert s.remove(a) and not s.remove(a)
    assert drain(s) == ["b"]


def test_expected_wait_counts_only_work_ahead() -> None:
    s = Scheduler("priority", ms)
    s.push(work("l", 0))
    s.push(work("h", 10))
    assert s.expected_wait_ms(10, running_left_ms=[2.0], slots=1) == pytest.approx(2.0 + 4.0)
    assert s.expected_wait_ms(0, running_left_ms=[2.0], slots=1) == pytest.approx(2.0 + 8.0)
    assert s.expected_wait_ms(10, running_left_ms=[], slots=2) == pytest.approx(2.0)


def test_low_priority_wait_stretches_by_the_recent_share_of_high_priority_work() -> None:
    s = Scheduler("priority", ms)
    s.push(work("l", 0))
    base = s.expected_wait_ms(0, running_left_ms=[], slots=1)
    for t in range(0, 1001, 10):  # 4 ms of high-priority work every 10 ms: 40% of the slot
        s.ran(10, 4.0, float(t), slots=1)
    assert s.high_share == pytest.approx(0.5 * 0.404, abs=0.01), "smoothed over one-second windows"
    assert s.expected_wait_ms(0, running_left_ms=[], slots=1) == pytest.approx(base / (1 - s.high_share))
    assert s.expected_wait_ms(10, running_left_ms=[], slots=1) == pytest.approx(0.0), "high priority: no stretch"
    fifo = Scheduler("fifo", ms)
    fifo.push(work("l", 0))
    fifo.ran(10, 900.0, 0.0, 1)
    fifo.ran(10, 900.0, 1000.0, 1)
    assert fifo.expected_wait_ms(0, running_left_ms=[], slots=1) == pytest.approx(4.0), "FIFO: nothing overtakes"


def test_admission_by_deadline_refuses_on_arrival_what_cannot_finish_in_time() -> None:
    s = Scheduler("fifo", ms, admit_by_deadline=True)
    for i in range(3):
        s.push(work(f"w{i}", 0))
    # 3 x 4 ms queued + 2 ms left on the running one + 4 ms own execution = 18 ms
    assert s.refuse_late("m", 1, 0, 20.0, [2.0], 1) is None
    refusal = s.refuse_late("m", 1, 0, 17.0, [2.0], 1)
    assert refusal is not None and refusal[0] == 503 and "predicted 18 ms" in refusal[1]
    assert s.refuse_late("m", 1, 0, None, [2.0], 1) is None, "no deadline, no refusal"
    assert Scheduler("fifo", ms).refuse_late("m", 1, 0, 1.0, [2.0], 1) is None, "off by default"


@pytest.mark.parametrize("seed", range(25))
def test_max_block_bound_holds_over_seeded_runs(seed: int) -> None:
    """One slot, bursts of bulk low-priority work and sparse high-priority work: a high-priority
    request never waits longer than max_block_ms behind running low-priority work."""
    rng = random.Random(seed)
    max_block = 15.0
    s = Scheduler("priority", ms, batching={"bulk": BatchPolicy(max_batch=8)}, max_block_ms=max_block)
    arrivals = []
    t = 0.0
    for i in range(400):
        t += rng.expovariate(0.12)
        high = rng.random() < 0.15
        arrivals.append(
            (
                t,
                work(
                    f"{'h' if high else 'l'}{i}",
                    10 if high else 0,
                    at=t,
                    model="m" if high else "bulk",
                    rows=rng.choice([1, 1, 2]),
                ),
            )
        )
    now, busy_until, running_low = 0.0, 0.0, False
    worst = 0.0
    pending = list(arrivals)
    waiting_high: dict[str, float] = {}
    while pending or s.queued:
        next_arrival = pending[0][0] if pending else float("inf")
        if busy_until <= next_arrival and s.queued:
            now = max(now, busy_until)
            d = s.next(now)
            if not d.batch:
                now = d.wake_at_ms or next_arrival
                continue
            for w in d.batch:
                if w.priority >= 10:
                    worst = max(worst, now - waiting_high.pop(w.handle) if running_low else 0.0)
            rows = sum(w.rows for w in d.batch)
            if d.batch[0].priority < 10:
                assert ms("bulk", rows) <= max_block or len(d.batch) == 1
            running_low = d.batch[0].priority < 10
            busy_until = now + ms(d.batch[0].model, rows)
        else:
            now, w = pending.pop(0)
            s.push(w)
            if w.priority >= 10:
                waiting_high[w.handle] = now
    assert worst <= max_block + 1e-9


def test_batch_curve_interpolates_between_measured_sizes() -> None:
    from nodes.estimates import batch_curve_ms

    curve = {1: 2.0, 2: 3.0, 4: 5.0, 8: 9.0}
    assert [batch_curve_ms(curve, r) for r in (1, 3, 6, 16)] == [2.0, 4.0, 7.0, 18.0]
    assert batch_curve_ms({2: 4.0}, 1) == 2.0


@pytest.mark.parametrize("seed", range(5))
def test_run_now_decides_an_arrival_on_an_empty_queue_as_push_then_next_would(seed: int) -> None:
    """The node's fast path for an arrival to an idle node must not be a second set of rules: over
    generated arrivals (modes, priorities, deadlines, batch policies, rows), `run_now` runs, expires
    or declines exactly where `push` then `next` on a twin scheduler runs, expires or waits."""
    rng = random.Random(seed)
    for _ in range(400):
        mode = rng.choice(["fifo", "priority"])
        policy = BatchPolicy(
            max_batch=rng.choice([1, 4, 8]),
            max_queue_delay_ms=rng.choice([0.0, 0.0, 5.0]),
            preferred=rng.choice([(), (4,), (2, 8)]),
        )
        now = rng.uniform(0, 100)
        deadline = rng.choice([None, now + rng.uniform(0.0, 10.0)])
        arrival = dict(priority=rng.choice([0, 1, 5]), deadline=deadline, rows=rng.choice([1, 2, 4, 8]), at=now)
        fast, slow = (Scheduler(mode, ms, batching={"m": policy}) for _ in range(2))
        fast_work, slow_work = work("a", **arrival), work("a", **arrival)  # type: ignore[arg-type]
        decided = fast.run_now(fast_work, now)
        slow.push(slow_work)
        queued = slow.next(now)
        if decided is None:
            assert not queued.batch and not queued.expired and queued.wake_at_ms is not None
            assert fast.queued == 0 and not fast_work.done, "declined: the caller pushes it"
        else:
            assert [w.handle for w in decided.batch] == [w.handle for w in queued.batch]
            assert [w.handle for w in decided.expired] == [w.handle for w in queued.expired]
            assert fast.queued == 0 and fast_work.done
    busy = Scheduler("fifo", ms)
    busy.push(work("queued"))
    assert busy.run_now(work("b"), 0.0) is None, "with work queued, an arrival goes behind it"


@pytest.mark.parametrize("mode", ["fifo", "priority"])
def test_the_wait_ahead_is_the_sum_over_what_is_queued(mode: str) -> None:
    """expected_wait_ms sums the queued work by kind (model, priority, rows); it must equal the walk
    over every queued request, whatever comes and goes (pushed, taken in batches, cancelled)."""
    rng = random.Random(5)
    exec_ms = {"a": 2.0, "b": 7.5}

    def predict(model: str, rows: int) -> float:
        return exec_ms[model] * (1 + 0.5 * (rows - 1))

    s = Scheduler(mode, predict, batching={"a": BatchPolicy(max_batch=4)})
    queued: list[Work] = []
    now = 0.0
    for step in range(3000):
        now += 1.0
        if rng.random() < 0.55 or not queued:
            w = Work(None, rng.choice("ab"), rng.choice([-5, 0, 0, 3, 10]), None, rng.choice([1, 1, 2, 8]), now)
            s.push(w)
            queued.append(w)
        elif rng.random() < 0.5:
            s.remove(queued.pop(rng.randrange(len(queued))))
        else:
            s.next(now, idle=True)
        queued = [w for w in queued if not w.done]
        if step % 7 == 0:
            exec_ms["a"] = rng.uniform(1, 5)  # estimates move: the sum is taken at the time of asking
        for priority in (-5, 0, 10):
            want = sum(predict(w.model, w.rows) for w in queued if mode == "fifo" or w.priority >= priority)
            got = s.expected_wait_ms(priority, [], 1)
            if mode == "priority" and priority < s.high_priority_min:
                got *= 1.0 - min(0.9, s.high_share)
            assert got == pytest.approx(want), (step, priority)
    assert len(s._queued_kinds) <= 2 * 5 * 4  # kinds, not requests
