"""The scenario spec (pydantic schema of scenarios/*.yaml) and the workload schedule drawn from it."""
