"""Kafka transport: publishing and reading node reports and router peer counts, and their signing."""
