"""The shared kernel of routers, nodes and tools, by what each sub-package holds.

- `telemetry.cluster`: the load report a node publishes (`NodeLoad`) and the `ClusterView` snapshots
  a router routes on (store, column tables; reads never write).
- `telemetry.kafka`: the Kafka transport of reports and peer counts, and their signing.
- `telemetry.oip`: the Open Inference Protocol v2 wire formats, REST and gRPC, with Triton's
  definitions.
- `telemetry.process`: process plumbing: serving, TLS, settings, config files, shared CLI flags.
- `telemetry.measure`: the one quantile helper and cheap request metrics.
"""
