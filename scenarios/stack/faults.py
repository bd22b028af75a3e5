"""A scenario's faults against a live stack (`edgeroute replay`): kill, restart or slow a node, cut or
restore a link, take the broker down, each at its time on the wall clock and undone after its
`duration_s`. The simulator plays the same faults on its own clock (scenarios.sim.faults)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from scenarios.spec.schema import Fault
from scenarios.stack.launcher import Stack

log = logging.getLogger("edgeroute.launcher")  # one logger for the live stack and its faults


class FaultInjector:
    """Runs a scenario's faults against a live stack on the wall clock, from `start()` on.

    Each fault with a `duration_s` gets its undo scheduled. `events` records (seconds from start,
    description) of what was done, for the report's timeline.
    """

    def __init__(self, stack: Stack, faults: list[Fault]) -> None:
        self.stack = stack
        self.actions: list[tuple[float, str, Any]] = []
        for f in faults:
            self.actions += _actions(stack, f)
        self.actions.sort(key=lambda a: a[0])
        self.events: list[tuple[float, str]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self.actions:
            return
        self._thread = threading.Thread(target=self._run, name="faults", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        for at, label, action in self.actions:
            if self._stop.wait(max(0.0, at - (time.monotonic() - t0))):
                return
            try:
                action()
                self.events.append((round(time.monotonic() - t0, 3), label))
                log.warning("fault at %.1fs: %s", at, label)
            except Exception as exc:  # noqa: BLE001 - a failed injection is reported, not fatal
                self.errors.append(f"{label}: {exc}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


def _actions(stack: Stack, f: Fault) -> list[tuple[float, str, Any]]:
    """(at_s, label, callable) for a fault and, where it has a duration, its undo."""
    end = None if f.duration_s is None else f.at_s + f.duration_s
    out: list[tuple[float, str, Any]] = []
    if f.kind == "kill_node":
        node = str(f.node)
        out.append((f.at_s, f"kill {node}", lambda: stack.kill_node(node)))
        if end is not None:
            out.append((end, f"restart {node}", lambda: stack.restart_node(node)))
    elif f.kind == "restart_node":
        node = str(f.node)
        out.append((f.at_s, f"restart {node}", lambda: stack.restart_node(node)))
    elif f.kind == "slow_node":
        node, factor = str(f.node), float(f.factor or 1.0)
        spec = next(n for n in stack.scenario.topology.nodes if n.id == node)
        out.append((f.at_s, f"slow {node} x{factor:g}", lambda: stack.set_speed(node, spec.speed / factor)))
        if end is not None:
            out.append((end, f"restore {node} speed", lambda: stack.set_speed(node, spec.speed)))
    elif f.kind in ("cut_link", "restore_link"):
        assert f.link is not None
        a, b = f.link
        cut = f.kind == "cut_link"
        out.append((f.at_s, f"{'cut' if cut else 'restore'} link {a}-{b}", lambda: stack.cut_link(a, b, cut)))
        if cut and end is not None:
            out.append((end, f"restore link {a}-{b}", lambda: stack.cut_link(a, b, False)))
    elif f.kind == "broker_outage":
        out.append((f.at_s, "broker down", stack.broker_down))
        if end is not None:
            out.append((end, "broker up", stack.broker_up))
    return out
