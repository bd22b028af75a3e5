"""Scenarios: schema, local stack launcher, live replay, reports, benchmarks, and the CLI."""
