"""The request lifecycle, pure: what happens around a policy, for the router and the simulator alike.

No asyncio, aiohttp or Kafka here (tests/unit/test_lifecycle.py checks the imports). The router
(`router.dispatch`) drives it with asyncio, the simulator (`scenarios.sim`) with its event heap. The
package sits under `router/` because it is the router's behaviour; the simulator imports it as it
imports `policies`, and never the router's aiohttp code.

- `lifecycle`: `Lifecycle` and its steps (decide, cross, count, judge, retry, hedge, finish)
- `attempts`: one request's attempt state and the steps (`Send`, `Hold`, `Answer`)
- `failures`: failure kinds, what is retried and what counts against a node
- `holds`: requests held for a slot (delay scheduling), woken oldest first
- `hedges`: when to send a duplicate
- `overlay`: this router's in-flight counts per node between reports; loads it set off
- `health`: outlier ejection and slow start per (site, node)
- `evidence`: the router's own evidence of a node's life (answers, probes): routable without telemetry
- `links`: partition links (RTT, jitter, loss, cuts) as emulated
- `copies`: copy scaling (demand meter and planner)
- `reroute`: taking queued attempts back from a node and sending them elsewhere
"""

from router.lifecycle.attempts import Answer, Attempts, Ended, Hold, Next, Send
from router.lifecycle.failures import Failure, classify
from router.lifecycle.lifecycle import NO_TELEMETRY_YET, Lifecycle, LifecycleSettings

__all__ = [
    "Answer",
    "Attempts",
    "Ended",
    "Failure",
    "Hold",
    "Lifecycle",
    "LifecycleSettings",
    "Next",
    "NO_TELEMETRY_YET",
    "Send",
    "classify",
]
