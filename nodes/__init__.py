"""The model server node: OIP v2 over ONNX Runtime, with load telemetry to Kafka."""
