"""The load report (`schema.NodeLoad`) and the `ClusterView` snapshot store built from reports."""
