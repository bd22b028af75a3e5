"""Calibration: the simulator's profile and the host measurement, measured on a live stack."""
