"""edgeroute's version: the one source (pyproject.toml reads it; `--version` prints it)."""

__version__ = "0.3.0"
