"""The discrete-event simulator: the scenario on virtual time, with the router's own policy objects and
request lifecycle.

- `engine`: the event loop (`Simulation`, `simulate`)
- `router`: the router's lifecycle driven on the heap
- `workflows`: workflow jobs stage by stage
- `nodes`: the node model (slots, scheduler, residency, loads, speed)
- `telemetry`: snapshots, lag and polling
- `faults`: kills, slow nodes, cut links, broker outages
- `profile`: the measured distributions the model samples
- `state`: event kinds and the records the parts share
"""

from scenarios.sim.engine import Simulation, simulate
from scenarios.sim.profile import DEFAULT_PROFILE, Distribution, Profile
from scenarios.sim.sizes import model_bytes, output_bytes
from scenarios.sim.state import SimConfig

__all__ = [
    "DEFAULT_PROFILE",
    "Distribution",
    "Profile",
    "SimConfig",
    "Simulation",
    "model_bytes",
    "output_bytes",
    "simulate",
]
