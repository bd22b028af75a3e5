import socket

import pytest


def test_unit_tier_refuses_network_sockets() -> None:
    with pytest.raises(RuntimeError, match="must not open network sockets"):
        socket.socket(socket.AF_INET, socket.SOCK_STREAM)


async def test_event_loop_still_works() -> None:
    import asyncio

    await asyncio.sleep(0)
