"""The native data plane: a proxy (HAProxy) carries each request the policy lets it carry, with no
Python on the path; the router is its control plane (router.dataplane.control) and serves the rest
behind it.

- `plan`: what the proxy should hold, from the view and the policy (pure; the simulator runs it too);
- `haproxy`: its configuration and the runtime commands between two plans (pure);
- `proxy`: the process and its runtime API;
- `control`: the loop that keeps them in step, and the proxy's checks fed back as evidence.
"""

from router.dataplane.settings import DataPlaneConfig

__all__ = ["DataPlaneConfig"]
