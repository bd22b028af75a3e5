"""The confidence cascade on the router: a model of its own name that runs the small model where the
policy sends it, judges its answer, and sends the unsure ones on to the larger model while the deadline
allows (router.lifecycle.cascade has the rule and the decision, shared with the simulator).

The request's body goes to each model as it came (the two models take the same inputs); the answer is
the model's that answered, as it came, with `x-edgeroute-cascade` saying what became of it (`sure`,
`escalated`, `kept`: unsure, but the trip did not fit or the second model failed; `second` in
`second_only` mode), `x-edgeroute-stages` the executions it took and `x-edgeroute-bytes-moved` the
request bytes sent to nodes outside the client's site (the WAN's share of it, audits included).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping

from policies.api import RouteRequest
from router.dispatch import Dispatcher, Outcome
from router.lifecycle.cascade import ESCALATED, KEPT, SECOND, SURE, CascadeSpec, escalate
from router.workflows import decode_tensors
from telemetry.oip import wire
from telemetry.process import tracing

CASCADE = wire.CASCADE
RESULTS = (SURE, ESCALATED, KEPT, SECOND, "failed")


class CascadeStats:
    def __init__(self) -> None:
        self.by_result = dict.fromkeys(RESULTS, 0)
        self.audits = 0
        self.audits_agreed = 0  # audits whose top class matched the first model's
        self.wan_bytes = 0


class CascadeRunner:
    def __init__(self, spec: CascadeSpec, dispatcher: Dispatcher, clock: Callable[[], float], seed: int = 0) -> None:
        self.spec = spec
        self.dispatcher = dispatcher
        self.clock = clock
        self.stats = CascadeStats()
        self.rng = random.Random(seed)
        self.audits: set[asyncio.Task[None]] = set()

    def models(self) -> list[str]:
        """The models it cannot answer without (in `cascade` mode the second only improves answers)."""
        return [self.spec.second if self.spec.mode == "second_only" else self.spec.first]

    def _unsure(self, outcome: Outcome) -> tuple[bool, int | None]:
        """The rule on the first model's answer: (unsure, its top class); an answer the rule cannot read
        is unsure (the larger model is asked instead of trusting it)."""
        try:
            n = int(outcome.headers.get(wire.HEADER_LENGTH, len(outcome.body)))
            outputs = decode_tensors(wire.loads(outcome.body[:n])["outputs"], outcome.body[n:], "output")
            values = outputs[self.spec.rule.output].reshape(outputs[self.spec.rule.output].shape[0], -1)
        except (ValueError, KeyError, TypeError, IndexError):
            return True, None
        rows = values.astype("float64").tolist()  # (python floats, as the rule reads them)
        top = int(values[0].argmax()) if len(rows) and values.shape[1] else None
        return any(self.spec.rule.unsure(row) for row in rows) or not rows, top

    def _wan(self, outcome: Outcome, site: str | None, nbytes: int) -> int:
        """`nbytes` if the node that took them stands outside the client's site."""
        if site is None or outcome.node == "none":
            return 0
        node = self.dispatcher.lifecycle.view().get(outcome.node)
        return nbytes if node is not None and node.partition != site else 0

    async def run(
        self,
        body: bytes,
        hints: Mapping[str, str],
        priority: int,
        budget_ms: float,
        site: str | None,
        request_id: str,
        arrived_ms: float,
        charge: Callable[[], bool] | None = None,
        tenant: Mapping[str, str] | None = None,
    ) -> Outcome:
        """One request through the cascade. `charge` is asked before an escalation: the second model's
        call is the client's too, against its rate (False: over it, and the first model's answer is kept).
        `tenant`: the router's tenant headers for the nodes (router.director), if any."""
        spec = self.spec
        deadline_at = arrived_ms + budget_ms
        headers = {"Content-Type": hints.get("Content-Type", "application/json"), wire.PRIORITY: str(priority)}
        if tenant:
            headers.update(tenant)
        if wire.HEADER_LENGTH in hints:
            headers[wire.HEADER_LENGTH] = hints[wire.HEADER_LENGTH]
        first_model = spec.second if spec.mode == "second_only" else spec.first
        outcome = await self._send(first_model, priority, site, request_id, body, headers, deadline_at)
        wan = self._wan(outcome, site, len(body))
        stages = 1
        if outcome.status != 200:
            label = "failed"
        elif spec.mode == "second_only":
            label = SECOND
        else:
            unsure, top = self._unsure(outcome)
            if not unsure:
                label = SURE
                if spec.audit_share > 0 and self.rng.random() < spec.audit_share:
                    self._audit(body, headers, site, request_id, top)
            elif spec.mode == "first_only":
                label = KEPT
            else:
                now = self.clock()
                view = self.dispatcher.lifecycle.view()
                label = KEPT
                if escalate(spec, view, priority, site, deadline_at - now, now) and (charge is None or charge()):
                    tracing.event("escalate", model=spec.second)
                    second = await self._send(spec.second, priority, site, request_id, body, headers, deadline_at)
                    stages = 2
                    wan += self._wan(second, site, len(body))
                    if second.status == 200:
                        outcome, label = second, ESCALATED
        self.stats.by_result[label] += 1
        self.stats.wan_bytes += wan
        out = outcome.headers
        out[CASCADE] = label
        out[wire.STAGES] = str(stages)
        out[wire.BYTES_MOVED] = str(wan)
        return outcome

    async def _send(
        self,
        model: str,
        priority: int,
        site: str | None,
        request_id: str,
        body: bytes,
        headers: Mapping[str, str],
        deadline_at: float,
    ) -> Outcome:
        req = RouteRequest(
            model,
            priority,
            deadline_at - self.clock(),
            site,
            1,
            f"{request_id}.{model}",
            tenant=headers.get(wire.TENANT, ""),
        )
        return await self.dispatcher.dispatch(req, f"/v2/models/{model}/infer", body, headers, deadline_at)

    def _audit(
        self, body: bytes, headers: Mapping[str, str], site: str | None, request_id: str, top: int | None
    ) -> None:
        """A sure answer sent on to the second model as well, sheddable, not waited for: does the larger
        model agree with the small one's top class?"""
        spec = self.spec
        fwd = {**headers, wire.PRIORITY: str(spec.audit_priority)}

        async def audit() -> None:
            deadline_at = self.clock() + spec.slo_ms
            out = await self._send(
                spec.second, spec.audit_priority, site, f"{request_id}.audit", body, fwd, deadline_at
            )
            self.stats.audits += 1
            self.stats.wan_bytes += self._wan(out, site, len(body))
            if out.status == 200:
                _, second_top = self._unsure(out)
                self.stats.audits_agreed += int(second_top is not None and second_top == top)

        task = asyncio.get_running_loop().create_task(audit())
        self.audits.add(task)
        task.add_done_callback(self.audits.discard)


__all__ = ["CASCADE", "CascadeRunner", "CascadeStats"]
