"""Unit tests never open a network socket: any AF_INET/AF_INET6 socket creation fails the test.

Unix socket pairs (asyncio's self-pipe) stay allowed.
"""

from __future__ import annotations

import socket

import pytest

_real_socket = socket.socket


class _NoNetworkSocket(_real_socket):
    def __init__(self, family: int = -1, type: int = -1, proto: int = -1, fileno: int | None = None) -> None:
        if fileno is None and family in (-1, socket.AF_INET, socket.AF_INET6):
            raise RuntimeError("unit tests must not open network sockets; use tests/integration")
        super().__init__(family, type, proto, fileno)


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "socket", _NoNetworkSocket)
