"""The Open Inference Protocol v2 wire formats: REST (`wire`), gRPC (`grpc`), Triton's messages (`triton`)."""
