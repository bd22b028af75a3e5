"""Re-routing on a live stack: requests queued behind a slowed node are taken back and answered by
another node, each executed exactly once; the settings swap live through the admin API."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from scenarios.spec.schema import Scenario
from scenarios.stack.broker import EmbeddedBroker
from scenarios.stack.launcher import Stack
from tests.integration.http import call, infer_body

QUEUEING = {"admit_by_deadline": False, "queue_target_ms": 0}


def test_requests_queued_at_a_slow_node_move_and_run_exactly_once(broker: EmbeddedBroker, tmp_path: Path) -> None:
    scenario = Scenario.model_validate(
        {
            "name": "it-reroute",
            "topology": {
                "partitions": ["site"],
                "nodes": [
                    # a node that queues rather than refuses (admission would send the work to b
                    # at once): what moving queued work is for
                    {"id": "a", "partition": "site", "speed": 0.001, "models": ["sensor_mlp"], **QUEUEING},
                    {"id": "b", "partition": "site", "models": ["sensor_mlp"]},
                ],
            },
            "workload": {"sites": [{"site": "site", "rate_rps": 1, "models": {"sensor_mlp": 1}}]},
            "router": {"policy": {"preset": "round_robin"}, "reroute": {"enabled": True, "margin_ms": 20}},
            "policies": ["round_robin"],
        }
    )
    stack = Stack(scenario, kafka=broker.bootstrap, log_dir=tmp_path, topic=f"edgeroute.telemetry.rr.{time.time_ns()}")
    try:
        stack.start()
        node_a, node_b = stack.nodes["a"].url, stack.nodes["b"].url
        for _ in range(8):  # node a's execution-time average learns it is slow (about 70 ms)
            assert call(f"{node_a}/v2/models/sensor_mlp/infer", infer_body())[0] == 200
        for url in (node_a, node_b):
            call(f"{url}/admin/stats?reset=1", headers=stack.node_headers)
        # and busy: six requests straight to it
        blockers = [
            threading.Thread(target=call, args=(f"{node_a}/v2/models/sensor_mlp/infer", infer_body())) for _ in range(6)
        ]
        for t in blockers:
            t.start()
        # its telemetry (queue, execution time) reaches the router, and both nodes are fresh there (waited
        # for rather than slept on: how long a report takes to arrive is not what this test is about)
        deadline = time.monotonic() + 5
        while True:
            nodes = {
                n["node_id"]: n for n in call(f"{stack.router_url}/admin/view", headers=stack.admin_headers)[1]["nodes"]
            }
            if nodes["a"]["queued"] >= 4 and nodes["a"]["fresh"] and nodes["b"]["fresh"]:
                break
            assert time.monotonic() < deadline, nodes
            time.sleep(0.01)
        answers: list[tuple[int, str]] = []

        def send() -> None:
            status, _, headers = call(
                f"{stack.router_url}/v2/models/sensor_mlp/infer",
                infer_body(),
                headers={"x-edgeroute-deadline-ms": "400"},
            )
            answers.append((status, headers.get("x-edgeroute-node", "none")))

        clients = [threading.Thread(target=send) for _ in range(6)]
        for t in clients:
            t.start()
            time.sleep(0.005)
        for t in clients + blockers:
            t.join(20)
        assert len(answers) == 6 and all(status == 200 for status, _ in answers), answers
        reroute = call(f"{stack.router_url}/admin/reroute", headers=stack.admin_headers)[1]
        assert reroute["moves"] >= 1, reroute
        stats_a = call(f"{node_a}/admin/stats?executed=1", headers=stack.node_headers)[1]
        stats_b = call(f"{node_b}/admin/stats?executed=1", headers=stack.node_headers)[1]
        assert stats_a["cancelled"] == reroute["moves"], "every move took its attempt out of node a's queue"
        routed = [i for i in stats_a["executed_ids"] + stats_b["executed_ids"] if i]
        requests = [i.rsplit("-", 1)[0] for i in routed]
        assert len(requests) == len(set(requests)) == 6, f"each routed request ran exactly once: {routed}"
        # each client's answer came from where its request ran, and the moved ones ran on b (how many went to
        # each node first is not fixed: a move's own pick advances round robin's turn)
        ran_at_b = [i for i in stats_b["executed_ids"] if i]
        assert sum(node == "b" for _, node in answers) == len(ran_at_b) >= reroute["moves"], (answers, ran_at_b)
        assert sum(node == "a" for _, node in answers) == len(routed) - len(ran_at_b), answers
        view = call(f"{stack.router_url}/admin/view", headers=stack.admin_headers)[1]
        assert view["reroute"]["moves"] == reroute["moves"] and view["reroute"]["watched"] == 0
        metrics = call(f"{stack.router_url}/metrics")[1]
        assert f'edgeroute_moves_total{{result="moved"}} {float(reroute["moves"])}' in metrics
    finally:
        stack.stop()


def test_reroute_settings_swap_live_and_bad_ones_are_refused(broker: EmbeddedBroker, tmp_path: Path) -> None:
    scenario = Scenario.model_validate(
        {
            "name": "it-reroute-admin",
            "topology": {"partitions": ["site"], "nodes": [{"id": "a", "partition": "site", "models": ["sensor_mlp"]}]},
            "workload": {"sites": [{"site": "site", "rate_rps": 1, "models": {"sensor_mlp": 1}}]},
            "router": {
                "auth": {
                    "tokens": {"ops": "admin-token-0123456789", "camera": "client-token-0123456789"},
                    "admin_clients": ["ops"],
                }
            },
            "policies": ["p2c"],
        }
    )
    stack = Stack(scenario, kafka=broker.bootstrap, log_dir=tmp_path, topic=f"edgeroute.telemetry.rra.{time.time_ns()}")
    try:
        stack.start()
        url = f"{stack.router_url}/admin/reroute"
        admin = {"Authorization": "Bearer admin-token-0123456789"}
        assert call(url)[0] == 401
        assert call(url, headers={"Authorization": "Bearer client-token-0123456789"})[0] == 403
        assert call(url, headers=admin)[1]["enabled"] is False
        for body in (b"{", b"[1]", b'{"enabled": true, "margn_ms": 5}', b'{"max_moves_per_s": -1}', b"[" * 5000):
            status, doc, _ = call(url, body, "PUT", headers=admin)
            assert status == 400 and "error" in doc, (body[:40], status, doc)
        assert call(url, headers=admin)[1]["enabled"] is False, "a refused body changes nothing"
        status, doc, _ = call(url, b'{"enabled": true, "max_moves_per_s": 7}', "PUT", headers=admin)
        assert status == 200 and doc["enabled"] and doc["max_moves_per_s"] == 7
        copies = f"{stack.router_url}/admin/copies"  # copy scaling, switched the same way (a run's `copies`)
        assert (
            call(copies)[0] == 401
            and call(copies, headers={"Authorization": "Bearer client-token-0123456789"})[0] == 403
        )
        assert call(copies, headers=admin)[1]["enabled"] is False
        for body in (b"{", b'{"enabled": true, "max_loadng": 2}', b'{"max_loading": 0}'):
            status, doc, _ = call(copies, body, "PUT", headers=admin)
            assert status == 400 and "error" in doc, (body, status, doc)
        status, doc, _ = call(copies, b'{"enabled": true, "max_loading": 3}', "PUT", headers=admin)
        assert status == 200 and doc["enabled"] and doc["max_loading"] == 3 and doc["made"] == 0
        assert call(copies, headers=admin)[1]["max_loading"] == 3
    finally:
        stack.stop()
