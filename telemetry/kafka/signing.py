"""Signed messages on the telemetry and peers topics: HMAC-SHA256 with a key id and a clock window.

Whoever can write to a topic can otherwise steer traffic: announce a node at an address of their
choosing, or make a real node look busy. With keys configured, every message a node or a router
publishes carries its signature in a record header, the value staying plain JSON that any Kafka tool
reads:

    header  edgeroute-sig: ER1 <key id> <send time, ms> <hex HMAC-SHA256>
    value   <message JSON>

where the MAC covers the topic, the key id, the time and the message, so a message cannot be moved
to another topic or re-dated. Readers also accept the envelope earlier versions wrote into the value
(`ER1 <key id> <time> <MAC> <message JSON>`), so publishers and readers can be upgraded in any order.
A reader with keys drops and counts anything unsigned, under an unknown key, forged, or sent more
than `window_ms` before or after its receipt (a replay of an old message: a fresh one from the same
node supersedes it anyway). A reader without keys accepts
unsigned and signed messages alike (unverified), so signing can be rolled out publisher-first.

Keys are `ID:SECRET` (a secret of at least 16 bytes); one shared key, or several (one per node or
per rotation step). Nodes and routers take them from config or from the environment
(`EDGEROUTE_TELEMETRY_KEY` to sign, `EDGEROUTE_TELEMETRY_KEYS`, comma-separated, to verify);
`edgeroute up` and the replays generate one per stack.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import AfterValidator

PREFIX = b"ER1 "
HEADER = "edgeroute-sig"  # the record header that carries a message's signature
MAX_HEADER = 256  # a signature header longer than this is forged


def header_signature(headers: Any) -> bytes | None:
    """The `HEADER` value among a record's (key, value) headers as a Kafka client hands them over."""
    for key, value in headers or ():
        if key == HEADER and isinstance(value, bytes):
            return value
    return None


KEY_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MIN_SECRET = 16
DEFAULT_WINDOW_MS = 30_000.0
SIGN_ENV = "EDGEROUTE_TELEMETRY_KEY"
VERIFY_ENV = "EDGEROUTE_TELEMETRY_KEYS"


class KeyError_(ValueError):
    """A key that is not `ID:SECRET` with a plain id and a long enough secret."""


def parse_key(text: str) -> tuple[str, bytes]:
    key_id, sep, secret = text.strip().partition(":")
    if not sep or not KEY_ID.match(key_id):
        raise KeyError_("a telemetry key is ID:SECRET, the id of letters, digits, '.', '_' or '-' (1-64)")
    if len(secret.encode()) < MIN_SECRET:
        raise KeyError_(f"telemetry key '{key_id}': the secret must be at least {MIN_SECRET} bytes")
    return key_id, secret.encode()


def check_key(text: str) -> str:
    """A pydantic validator: `text` is a usable key (the configs' `telemetry_key` fields)."""
    parse_key(text)
    return text


TelemetryKey = Annotated[str, AfterValidator(check_key)]


def signer_for(text: str | None) -> Signer | None:
    """The signer of a configured key, else of the environment's, else none."""
    return Signer.parse(text) if text else Signer.from_env()


def _mac(secret: bytes, topic: str, key_id: bytes, ts: bytes, body: bytes) -> bytes:
    msg = topic.encode() + b"\n" + key_id + b"\n" + ts + b"\n" + body
    return hmac.new(secret, msg, hashlib.sha256).hexdigest().encode()


def unsealed(raw: bytes) -> bytes:
    """The message of a sealed record, unverified, for a reader without keys (signing is rolled out
    publisher-first); anything else as it is. A broken envelope yields the bytes after the prefix,
    which the message parser then refuses as malformed."""
    if not raw.startswith(PREFIX):
        return raw
    parts = raw[len(PREFIX) :].split(b" ", 3)
    return parts[3] if len(parts) == 4 else raw


@dataclass(frozen=True)
class Signer:
    key_id: str
    secret: bytes

    @classmethod
    def parse(cls, text: str) -> Signer:
        return cls(*parse_key(text))

    @classmethod
    def from_env(cls) -> Signer | None:
        text = os.environ.get(SIGN_ENV)
        return cls.parse(text) if text else None

    def seal(self, topic: str, body: bytes, now_ms: float) -> bytes:
        """The envelope form: signature and message in the value (what earlier versions published)."""
        return self.signature(topic, body, now_ms) + b" " + body

    def signature(self, topic: str, body: bytes, now_ms: float) -> bytes:
        """The `edgeroute-sig` header's value for `body` on `topic`."""
        kid, ts = self.key_id.encode(), str(int(now_ms)).encode()
        return PREFIX + kid + b" " + ts + b" " + _mac(self.secret, topic, kid, ts, body)


@dataclass
class Verifier:
    """Checks sealed messages (thread-safe counters; one reader thread calls `open`)."""

    keys: dict[str, bytes]
    window_ms: float = DEFAULT_WINDOW_MS
    accepted: int = 0
    unsigned: int = 0
    unknown_key: int = 0
    forged: int = 0
    expired: int = 0
    unbound: int = 0  # validly signed, but for a node id its key may not speak for
    # key id -> the node ids (fnmatch patterns) that key may sign for; keys not listed sign for any
    bindings: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def parse(cls, texts: list[str], window_ms: float = DEFAULT_WINDOW_MS) -> Verifier:
        keys: dict[str, bytes] = {}
        for text in texts:
            key_id, secret = parse_key(text)
            keys[key_id] = secret
        return cls(keys, window_ms)

    @classmethod
    def from_env(cls, window_ms: float = DEFAULT_WINDOW_MS) -> Verifier | None:
        text = os.environ.get(VERIFY_ENV)
        return cls.parse([t for t in text.split(",") if t.strip()], window_ms) if text else None

    @property
    def enforcing(self) -> bool:
        return bool(self.keys)

    def open(self, topic: str, raw: bytes, received_ms: float) -> bytes | None:
        """The message inside `raw` if it may be believed, else None (counted)."""
        return self.open_keyed(topic, raw, received_ms)[1]

    def open_keyed(
        self, topic: str, raw: bytes, received_ms: float, sig: bytes | None = None
    ) -> tuple[str | None, bytes | None]:
        """(the key id that signed it, or None when unverified; the message, or None: not believed).
        `sig`: the record's `edgeroute-sig` header, when it has one (else the value may be an envelope)."""
        if sig is not None:
            parts = sig[len(PREFIX) :].split(b" ", 3) if sig.startswith(PREFIX) and len(sig) <= MAX_HEADER else []
            if len(parts) != 3:
                if self.enforcing:
                    self._count("forged")
                    return None, None
                return None, unsealed(raw)
            parts.append(raw)
        elif not raw.startswith(PREFIX):
            if self.enforcing:
                self._count("unsigned")
                return None, None
            return None, raw
        else:
            parts = raw[len(PREFIX) :].split(b" ", 3)
        if len(parts) != 4:
            self._count("forged")
            return None, None
        kid, ts, mac, body = parts
        if not self.enforcing:
            return None, body
        key_id = kid.decode(errors="replace")
        secret = self.keys.get(key_id)
        if secret is None:
            self._count("unknown_key")
            return None, None
        if not ts.isdigit() or len(ts) > 16 or abs(received_ms - int(ts)) > self.window_ms:
            self._count("expired")
            return None, None
        if not hmac.compare_digest(mac, _mac(secret, topic, kid, ts, body)):
            self._count("forged")
            return None, None
        self._count("accepted")
        return key_id, body

    def open_many(
        self, topic: str, raws: list[bytes], received_ms: float, sigs: list[bytes | None] | None = None
    ) -> tuple[list[bytes], list[str | None]]:
        """The believable messages of a batch and, for each, the key id that signed it; `sigs`: each
        record's signature header (None where it has none)."""
        bodies: list[bytes] = []
        kids: list[str | None] = []
        for i, raw in enumerate(raws):
            kid, body = self.open_keyed(topic, raw, received_ms, None if sigs is None else sigs[i])
            if body is not None:
                bodies.append(body)
                kids.append(kid)
        return bodies, kids

    def may_sign_for(self, kid: str | None, node_id: str) -> bool:
        """Whether a message signed with `kid` may speak for `node_id` (counted when not)."""
        patterns = self.bindings.get(kid) if kid is not None else None
        if patterns is None or any(fnmatch.fnmatchcase(node_id, p) for p in patterns):
            return True
        self._count("unbound")
        return False

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    def summary(self) -> dict[str, int]:
        return {
            "accepted": self.accepted,
            "unsigned": self.unsigned,
            "unknown_key": self.unknown_key,
            "forged": self.forged,
            "expired": self.expired,
            "unbound": self.unbound,
        }
