"""The local stack: embedded broker, nodes and routers as processes, faults, a load generator."""
