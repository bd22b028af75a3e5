"""The MQTT door's answer properties, encoded by the router: what paho's own decoder reads back is what
was set, for any content type, correlation data, user properties and expiry (generated), and a field
too long for MQTT is refused rather than sent broken."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from router.mqtt_codec import AnswerProperties

text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=80)


def _read(packed: bytes) -> Properties:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    _, length = props.unpack(packed)  # type: ignore[no-untyped-call]
    assert length == len(packed)
    return props


@settings(max_examples=300, deadline=None)
@given(
    text,
    st.binary(max_size=300),
    st.lists(st.tuples(text, text), max_size=6),
    st.one_of(st.none(), st.integers(0, 2**32 - 1)),
)
def test_paho_reads_back_what_was_set(
    content_type: str, corr: bytes, user: list[tuple[str, str]], expiry: int | None
) -> None:
    props = AnswerProperties(content_type, corr, user, expiry)
    read = _read(props.pack())
    assert getattr(read, "ContentType", None) == content_type
    assert getattr(read, "CorrelationData", b"") == corr
    assert [tuple(p) for p in getattr(read, "UserProperty", [])] == user
    assert getattr(read, "MessageExpiryInterval", None) == expiry
    assert str(props)  # (what paho logs)


def test_the_bytes_are_those_paho_would_send() -> None:
    mine = AnswerProperties("application/json", b"\x00\x01", [("status", "200"), ("node", "n1")], 3)
    theirs = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    theirs.MessageExpiryInterval = 3
    theirs.ContentType = "application/json"
    theirs.CorrelationData = b"\x00\x01"
    theirs.UserProperty = [("status", "200"), ("node", "n1")]
    assert mine.pack() == theirs.pack()  # type: ignore[no-untyped-call]


def test_a_field_too_long_for_mqtt_is_refused() -> None:
    with pytest.raises(ValueError):
        AnswerProperties("x" * 70_000, b"", [], None)
    with pytest.raises(ValueError):
        AnswerProperties("application/json", b"", [("k", "v" * 70_000)], None)
