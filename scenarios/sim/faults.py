"""Faults on virtual time: kill and restart a node, slow it, cut and restore a link, broker outage."""

from __future__ import annotations

from typing import Any

from router.lifecycle import Failure
from scenarios.sim.state import (
    FAULT,
    PUBLISH,
    SimState,
)
from scenarios.spec.schema import Fault


class FaultModel(SimState):
    def _schedule_fault(self, f: Fault) -> None:
        at = f.at_s * 1000.0
        end = None if f.duration_s is None else at + f.duration_s * 1000.0
        if f.kind == "kill_node":
            self.push(at, FAULT, ("kill", f.node))
            if end is not None:
                self.push(end, FAULT, ("restart", f.node))
        elif f.kind == "restart_node":
            self.push(at, FAULT, ("restart", f.node))
        elif f.kind == "slow_node":
            self.push(at, FAULT, ("speed", f.node, 1.0 / float(f.factor or 1.0)))
            if end is not None:
                self.push(end, FAULT, ("speed", f.node, 1.0))
        elif f.kind in ("cut_link", "restore_link"):
            assert f.link is not None
            cut = f.kind == "cut_link"
            self.push(at, FAULT, ("link", f.link, cut))
            if cut and end is not None:
                self.push(end, FAULT, ("link", f.link, False))
        elif f.kind == "cut_telemetry":
            assert f.link is not None
            self.push(at, FAULT, ("telemetry", f.link, True))
            if end is not None:
                self.push(end, FAULT, ("telemetry", f.link, False))
        elif f.kind == "broker_outage":
            self.push(at, FAULT, ("broker", False))
            if end is not None:
                self.push(end, FAULT, ("broker", True))

    def _telemetry_link(self, a: str, b: str, cut: bool) -> None:
        pair = frozenset((a, b))
        if cut:
            self.telemetry_cut.add(pair)
        else:
            self.telemetry_cut.discard(pair)

    def _fault(self, action: tuple[Any, ...]) -> None:
        kind = action[0]
        t = round(self.now / 1000.0, 3)
        if kind == "kill":
            node = self.nodes[action[1]]
            if not node.alive:
                return
            self._touch(node)
            node.alive = False
            node.epoch += 1
            if node.up_since is not None:
                node.up_total_ms += self.now - node.up_since
                node.up_since = None
            # a crash resets every connection: running and queued requests fail at once
            jobs = [j for b in node.running for j in b.jobs] + [w.handle for w in node.sched.drain()]
            for job in jobs:
                job.dropped = True
                self._send_reply(job, 503, f"node {node.spec.id} unavailable: reset", None, Failure.CONNECT)
            node.running.clear()
            node.busy = 0
            for waiting in node.load_waiters.values():
                for job in waiting:
                    self._send_reply(job, 503, f"node {node.spec.id} unavailable: reset", None, Failure.CONNECT)
            node.load_waiters.clear()
            node.load_queue.clear()
            node.loading = None
            node.residency = self._initial_residency(node.spec)  # the restarted process loads at start
            self.fault_log.append((t, f"kill {node.spec.id}"))
        elif kind == "restart":
            node = self.nodes[action[1]]
            if node.alive:
                return
            node.alive = True
            node.first_phase = False  # (its reports fall on the restart's instants from now on)
            node.starting, node.up_since = False, self.now
            node.epoch += 1
            node.seq = 0
            node.ewma.clear()
            node.ewma_rows.clear()
            node.batched.clear()  # a new process has measured no batch yet
            node.ewma_moved.update(node.spec.models)
            node.started_ms = self.now + 2000.0
            # start-up (process, sessions) takes about two seconds before the first telemetry
            self.push(self.now + 2000.0, PUBLISH, (node, node.epoch))
            self.fault_log.append((t, f"restart {node.spec.id}"))
        elif kind == "speed":
            node = self.nodes[action[1]]
            self._touch(node)
            node.speed = node.spec.speed * action[2]
            node.ewma_moved.update(node.spec.models)  # (a model not measured yet reports its baseline / speed)
            self.fault_log.append((t, f"{node.spec.id} speed x{action[2]:g}"))
        elif kind == "link":
            (a, b), cut = action[1], action[2]
            for _, lc in self.stands:  # (routers per site, or several: every router's requests)
                lc.set_link(a, b, cut)
            if len(self.lcs) > 1:  # ... and the telemetry between the two sites
                self._telemetry_link(a, b, cut)
            self.fault_log.append((t, f"{'cut' if cut else 'restore'} link {a}-{b}"))
        elif kind == "telemetry":
            (a, b), cut = action[1], action[2]
            self._telemetry_link(a, b, cut)
            self.fault_log.append((t, f"{'cut' if cut else 'restore'} telemetry {a}-{b}"))
        elif kind == "broker":
            self._draw(self.now)  # (what was sent while it was up, or down, is drawn for as it was)
            self.broker_up = action[1]
            self.fault_log.append((t, "broker up" if action[1] else "broker down"))
