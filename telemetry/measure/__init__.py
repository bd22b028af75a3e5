"""Measuring: the one quantile helper and the request path's cheap metrics."""
