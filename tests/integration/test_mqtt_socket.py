"""The MQTT door's socket: paho leaves Nagle's algorithm on, and an answer written while the broker had
not acknowledged the previous packet waited for its delayed ACK (p99 25 ms against HTTP's 6 ms for
1,000 devices at 200 req/s). The door turns it off on every socket paho opens."""

from __future__ import annotations

import socket

from router.mqtt_link import no_delay


def test_the_door_turns_nagle_off_on_a_tcp_socket() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname()) as sock:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
            no_delay(sock)
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_a_transport_without_socket_options_is_left_alone() -> None:
    class Websocket:  # paho's websocket wrapper has no setsockopt
        pass

    no_delay(Websocket())
    closed = socket.socket()
    closed.close()
    no_delay(closed)  # a socket closed under it: OSError, kept
