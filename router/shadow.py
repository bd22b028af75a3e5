"""Shadow copies of a model canary (router.canary.ModelCanary, `shadow:` in its spec): a control-arm
request the client already has its answer to is run again on the candidate version, and the two
answers compared; the copy's answer goes nowhere else.

A copy must never take capacity from answered work (FIKIT's rule: low priority fills the gaps high
priority leaves). So it is sent at the lowest priority there is (`SHADOW_PRIORITY`: a node's priority
queue runs it after everything else, and sheds it first under a standing queue), only to a node with a
free slot as the router sees it (the shadow policy: `priority_headroom` with a load cap of one request
per slot, then the shortest queue; none free: the copy is skipped, 429 at once), within the request's
own remaining deadline, and at most `shadow.max_in_flight` at once per router.

Agreement is the top class of every output both answers carry, row by row (a classifier's answer);
answers that cannot be read (an error, a body that is not a tensor answer) count as failed, not as
disagreement.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from policies import PolicySpec, build_policy
from policies.api import RouteRequest
from router.canary import ModelCanary
from router.dispatch import Outcome
from router.workflows import WorkflowInputError, decode_tensors
from telemetry.oip import wire

if TYPE_CHECKING:
    from router.state import Router

SHADOW_PRIORITY = -wire.MAX_PRIORITY  # below any request a client may send
SHADOW_POLICY = build_policy(
    PolicySpec(
        name="shadow",
        filters=[{"type": "priority_headroom", "high_priority_min": 1, "max_load": 1.0}],
        scorers=[{"type": "queue"}],
        picker={"type": "max"},
    )
)
_tasks: set[asyncio.Task[None]] = set()


def top_classes(outcome: Outcome) -> dict[str, list[int]] | None:
    """Each output's top class per row, or None when the answer is not a readable tensor answer."""
    if outcome.status != 200:
        return None
    try:
        n = int(outcome.headers.get(wire.HEADER_LENGTH, len(outcome.body)))
        outputs = decode_tensors(wire.loads(outcome.body[:n])["outputs"], outcome.body[n:], "output")
    except (ValueError, KeyError, TypeError, WorkflowInputError):
        return None
    out: dict[str, list[int]] = {}
    for name, arr in outputs.items():
        if arr.ndim == 0 or arr.size == 0 or not np.issubdtype(arr.dtype, np.number):
            continue
        rows = arr.reshape(arr.shape[0], -1)
        out[name] = [int(i) for i in rows.argmax(axis=1)]
    return out


def agree(control: Mapping[str, list[int]], candidate: Mapping[str, list[int]]) -> bool | None:
    """Whether the candidate's top classes match the control's on every output both carry (None: no
    output in common, nothing to compare)."""
    common = [k for k in control if k in candidate]
    if not common:
        return None
    return all(control[k] == candidate[k] for k in common)


def start(
    router: Router,
    run: ModelCanary,
    body: bytes,
    headers: Mapping[str, str],
    answer: Outcome,
    site: str | None,
    request_id: str,
    deadline_at_ms: float,
) -> None:
    """Mirror a control answer's request to the candidate version (a task; nothing waits for it)."""
    control = top_classes(answer)
    if control is None:
        return
    spec = run.spec
    fwd = {**headers, wire.PRIORITY: str(SHADOW_PRIORITY)}
    path = f"/v2/models/{spec.model}/versions/{spec.version}/infer"
    run.shadow_in_flight += 1

    async def mirror() -> None:
        try:
            now = router.clock()
            req = RouteRequest(
                run.candidate_model, SHADOW_PRIORITY, deadline_at_ms - now, site, 1, f"{request_id}.shadow"
            )
            out = await router.dispatcher.dispatch(req, path, body, fwd, deadline_at_ms, SHADOW_POLICY)
            if out.status == 429 and out.node == "none":  # no free slot anywhere: skipped, not failed
                run.shadowed("skipped")
                return
            candidate = top_classes(out)
            matched = None if candidate is None else agree(control, candidate)
            if matched is None:
                run.shadowed("failed")
                return
            run.shadowed("agreed" if matched else "disagreed")
            if router.canaries.models.get(spec.model) is run:
                run.canary.compared(matched)
        finally:
            run.shadow_in_flight -= 1

    task = asyncio.get_running_loop().create_task(mirror())
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


__all__ = ["SHADOW_POLICY", "SHADOW_PRIORITY", "agree", "start", "top_classes"]
