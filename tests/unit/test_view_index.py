"""A view's per-model index and partition set, kept from view to view as nodes join, change models or
move, equal what a view built afresh from the same nodes finds (the index's order is the order the
sampling policies draw from, so it must be exactly the same)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from scenarios.bench.decide import MODELS, SITES, node_load
from telemetry.cluster.view import ClusterView, NodeState


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), batches=st.integers(1, 12), read_every=st.integers(1, 3))
def test_an_index_kept_as_nodes_join_equals_one_built_afresh(seed: int, batches: int, read_every: int) -> None:
    rng = random.Random(seed)
    view = ClusterView()
    known: list[int] = []
    t = 0.0
    for b in range(batches):
        states = []
        for _ in range(rng.randrange(1, 30)):
            roll = rng.random()
            if roll < 0.6 or not known:  # a node joins
                i = len(known) + rng.randrange(0, 3)
                known.append(i)
                load = node_load(i, rng)
            else:  # a known node reports again, now and then with other models or another partition
                i = rng.choice(known)
                load = node_load(i, rng)
                if rng.random() < 0.2:
                    load = load.replace(partition=rng.choice([*SITES, "cloud", "elsewhere"]))
            t += 1.0
            states.append(NodeState.of(load.replace(seq=int(t), sent_at_ms=t), t))
        view = view.with_nodes(states, t)
        if b % read_every == 0:  # (read now and then: an index that exists is the one kept)
            view.serving(MODELS[0])
            view.has_partition("cloud")
        fresh = ClusterView().with_nodes(list(view), t)
        for model in [*MODELS, "absent"]:
            assert [n.node_id for n in view.serving(model)] == [n.node_id for n in fresh.serving(model)]
            assert view.serving_count(model) == fresh.serving_count(model)
        for part in [*SITES, "cloud", "elsewhere", "nowhere"]:
            assert view.has_partition(part) == fresh.has_partition(part)
