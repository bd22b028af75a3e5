"""Replays of a scenario, live and simulated, and their reports."""
