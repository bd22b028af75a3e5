"""Telemetry: node load messages, their Kafka transport, and the ClusterView the router routes on."""

from telemetry.schema import SCHEMA_VERSION, DeviceInfo, MalformedTelemetry, ModelLoad, NodeLoad
from telemetry.view import ClusterView, NodeState

__all__ = [
    "SCHEMA_VERSION",
    "ClusterView",
    "DeviceInfo",
    "MalformedTelemetry",
    "ModelLoad",
    "NodeLoad",
    "NodeState",
]
