"""Signed telemetry and peer messages (telemetry.kafka.signing)."""

from __future__ import annotations

import pytest

from telemetry.kafka.signing import KeyError_, Signer, Verifier, parse_key

KEY = "fleet:0123456789abcdef0123"
NOW = 1_700_000_000_000.0
BODY = b'{"node_id": "n1", "queued_by_priority": {"0": 1}}'


def test_a_sealed_message_opens_with_the_key() -> None:
    sealed = Signer.parse(KEY).seal("edgeroute.telemetry", BODY, NOW)
    v = Verifier.parse([KEY])
    assert v.open("edgeroute.telemetry", sealed, NOW + 50) == BODY
    assert v.summary()["accepted"] == 1


@pytest.mark.parametrize(
    ("raw", "counter"),
    [
        (BODY, "unsigned"),
        (Signer.parse("other:0123456789abcdef0123").seal("edgeroute.telemetry", BODY, NOW), "unknown_key"),
        (Signer.parse("fleet:not-the-right-secret!!").seal("edgeroute.telemetry", BODY, NOW), "forged"),
        (Signer.parse(KEY).seal("edgeroute.routers", BODY, NOW), "forged"),  # moved to another topic
        (Signer.parse(KEY).seal("edgeroute.telemetry", BODY, NOW).replace(b'"0": 1', b'"0": 9'), "forged"),
        (Signer.parse(KEY).seal("edgeroute.telemetry", BODY, NOW - 60_000), "expired"),  # replayed later
        (Signer.parse(KEY).seal("edgeroute.telemetry", BODY, NOW + 60_000), "expired"),
        (b"ER1 fleet 1700000000000", "forged"),
        (b"ER1 fleet notanumber " + b"0" * 64 + b" " + BODY, "expired"),
    ],
)
def test_what_does_not_verify_is_dropped_and_counted(raw: bytes, counter: str) -> None:
    v = Verifier.parse([KEY])
    assert v.open("edgeroute.telemetry", raw, NOW) is None
    assert v.summary()[counter] == 1 and v.summary()["accepted"] == 0


def test_without_keys_everything_is_accepted_unverified() -> None:
    v = Verifier({})
    sealed = Signer.parse(KEY).seal("t", BODY, NOW)
    assert v.open("t", BODY, NOW) == BODY and v.open("t", sealed, NOW) == BODY


@pytest.mark.parametrize("text", ["nocolon", ":0123456789abcdef0123", "bad id:0123456789abcdef0123", "k:short"])
def test_bad_keys_are_refused(text: str) -> None:
    with pytest.raises(KeyError_):
        parse_key(text)


def test_keys_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEROUTE_TELEMETRY_KEY", KEY)
    monkeypatch.setenv("EDGEROUTE_TELEMETRY_KEYS", f"{KEY}, old:abcdefabcdefabcdefab")
    signer, verifier = Signer.from_env(), Verifier.from_env()
    assert signer is not None and verifier is not None and set(verifier.keys) == {"fleet", "old"}
    assert verifier.open("t", signer.seal("t", BODY, NOW), NOW) == BODY


def test_keys_bound_to_node_ids() -> None:
    from telemetry.kafka.signing import Signer, Verifier

    key = "edge-1:" + "k" * 32
    verifier = Verifier.parse([key, "shared:" + "s" * 32])
    verifier.bindings = {"edge-1": ("edge-1", "edge-1-*")}
    sealed = Signer.parse(key).seal("t", b"{}", 1_000.0)
    assert verifier.open_keyed("t", sealed, 1_000.0) == ("edge-1", b"{}")
    assert verifier.may_sign_for("edge-1", "edge-1-gpu") and verifier.may_sign_for("shared", "anything")
    assert not verifier.may_sign_for("edge-1", "cloud-1") and verifier.summary()["unbound"] == 1


def test_unsealed_gives_the_message_of_a_sealed_record_unverified() -> None:
    from telemetry.kafka.signing import Signer, unsealed

    sealed = Signer.parse("fleet:" + "k" * 32).seal("t", b'{"a": 1}', 1000.0)
    assert unsealed(sealed) == b'{"a": 1}'
    assert unsealed(b'{"a": 1}') == b'{"a": 1}'
    assert unsealed(b"ER1 broken") == b"ER1 broken", "a broken envelope is left for the parser to refuse"


def test_a_signature_in_a_record_header_leaves_the_value_plain_json() -> None:
    from telemetry.kafka.signing import Signer, Verifier

    signer = Signer.parse(KEY)
    sig = signer.signature("edgeroute.telemetry", BODY, NOW)
    verifier = Verifier.parse([KEY])
    assert verifier.open_keyed("edgeroute.telemetry", BODY, NOW, sig) == ("fleet", BODY)
    bad = [
        (signer.signature("edgeroute.routers", BODY, NOW), BODY, "forged"),  # moved to another topic
        (sig, BODY.replace(b'"0": 1', b'"0": 9'), "forged"),  # the value changed under its signature
        (signer.signature("edgeroute.telemetry", BODY, NOW - 60_000), BODY, "expired"),
        (sig + b" trailing", BODY, "forged"),
        (b"ER1 " + b"x" * 300, BODY, "forged"),
        (b"", BODY, "forged"),
    ]
    for header, body, why in bad:
        before = getattr(verifier, why)
        assert verifier.open_keyed("edgeroute.telemetry", body, NOW, header) == (None, None), why
        assert getattr(verifier, why) > before, why
    # a roll-out: an envelope in the value (earlier publishers) is still read, by key and without
    sealed = signer.seal("edgeroute.telemetry", BODY, NOW)
    assert verifier.open_many("edgeroute.telemetry", [BODY, sealed], NOW, [sig, None]) == ([BODY, BODY], ["fleet"] * 2)
    open_reader = Verifier.parse([])
    assert open_reader.open_keyed("edgeroute.telemetry", BODY, NOW, sig) == (None, BODY)
    assert open_reader.open_keyed("edgeroute.telemetry", BODY, NOW, b"junk") == (None, BODY)
