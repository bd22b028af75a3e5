"""Generated hostile requests against a real router and real nodes (hypothesis), through both front
doors: over HTTP odd paths and model names, encoded slashes, hostile hint headers (huge, negative, NaN,
text priorities and deadlines, unknown sites, control characters), malformed binary framing, random
JSON, tensors whose shapes and data disagree, deep nesting, huge numbers, random bytes; over gRPC
mutated and random inference, metadata, configuration and statistics messages, typed contents of every
type. Every request gets one answer and none is a 500 or 502 (over gRPC: never UNKNOWN or INTERNAL);
honest clients on both doors are served within their deadlines all along; afterwards every process is
alive, its memory within bounds, no node is ejected, and valid requests succeed on every node, directly
and through the router, from every site. The same attack runs on a router whose native data plane
carries its doors (HAProxy in front: what it answers itself, carries to the nodes and passes on), the
proxy held to the same bounds.

`make test` runs a slice (EDGEROUTE_FUZZ_EXAMPLES, default 300, deterministic); `make fuzz` runs
10,000 with a fresh seed each time."""

from __future__ import annotations

import http.client
import json
import os
import re
import struct
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from scenarios.stack.launcher import Stack
from telemetry.oip import wire
from tests.integration.conftest import router_grpc
from tests.integration.http import call, infer_body

EXAMPLES = int(os.environ.get("EDGEROUTE_FUZZ_EXAMPLES", "300"))
RANDOM = bool(os.environ.get("EDGEROUTE_FUZZ_RANDOM"))
MODELS = ["sensor_mlp", "echo", "mobilenet_s"]
# what a hostile request may get: its own fault (4xx), overload or no time (503, 504), or success
ALLOWED = {200, 400, 401, 403, 404, 405, 409, 413, 415, 429, 431, 503, 504}

numbers = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "1e400", "-1e400", "0x10", "", " ", "1_000", "9" * 5000, "true", "[]"]),
    st.text(max_size=20),
)
names = st.one_of(
    st.sampled_from(MODELS),
    st.sampled_from(["..", ".", "%2e%2e", "x%2F..%2F..%2Fadmin%2Fstats", "sensor_mlp%00", "a" * 300, "%", "%ZZ"]),
    st.text(alphabet=st.characters(codec="ascii", exclude_characters="/?#"), min_size=1, max_size=40),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=20,
)
datatypes = st.sampled_from(["FP32", "FP16", "FP64", "INT64", "INT8", "UINT8", "BOOL", "BYTES", "fp32", "X", ""])


@st.composite
def tensors(draw: st.DrawFn) -> dict[str, Any]:
    shape = draw(
        st.one_of(
            st.lists(st.integers(min_value=-3, max_value=8), max_size=4),
            st.just([2**60, 16]),
            st.just([0, 4]),
            st.lists(st.integers(min_value=-(2**63), max_value=2**64), max_size=3),
            json_values,
        )
    )
    data = draw(st.one_of(st.lists(st.floats(allow_nan=True), max_size=40), json_values, st.just([1.0] * 4)))
    out: dict[str, Any] = {"name": draw(st.sampled_from(["readings", "x", "input", ""])), "shape": shape}
    out["datatype"] = draw(datatypes)
    out["data"] = data
    if draw(st.booleans()):
        out["parameters"] = draw(json_values)
    return out


@st.composite
def bodies(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    kind = draw(st.sampled_from(["valid", "tensors", "json", "bytes", "deep", "bignum", "binary", "empty"]))
    headers: dict[str, str] = {}
    if kind == "valid":
        body = infer_body()
    elif kind == "tensors":
        doc: dict[str, Any] = {"inputs": draw(st.lists(tensors(), max_size=3))}
        if draw(st.booleans()):
            doc["outputs"] = draw(json_values)
        if draw(st.booleans()):
            doc["id"] = draw(st.text(max_size=40))
        if draw(st.booleans()):
            doc["parameters"] = {"priority": draw(json_values), "deadline_ms": draw(json_values)}
        body = json.dumps(doc).encode()
    elif kind == "json":
        body = json.dumps(draw(json_values)).encode()
    elif kind == "bytes":
        body = draw(st.binary(max_size=512))
    elif kind == "deep":
        depth = draw(st.integers(min_value=100, max_value=100_000))
        body = b"[" * depth + b"]" * depth
    elif kind == "bignum":
        body = (
            b'{"inputs":[{"name":"readings","shape":[1,'
            + b"9" * draw(st.integers(1, 20_000))
            + b'],"datatype":"FP32","data":[1]}]}'
        )  # noqa: E501
    elif kind == "binary":
        size = draw(st.integers(-5, 64))
        tensor = {"name": "readings", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": size}}
        header = json.dumps({"inputs": [tensor]}).encode()
        tail = draw(st.binary(max_size=64))
        headers[wire.HEADER_LENGTH] = draw(st.one_of(st.just(str(len(header))), numbers))
        body = header + tail
    else:
        body = b""
    return body, headers


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, str, bytes, dict[str, str]]:
    target = draw(st.sampled_from(["router", "router", "node"]))
    model = draw(names)
    route = draw(st.sampled_from(["infer", "infer", "infer", "version", "meta", "ready", "load"]))
    version = draw(st.one_of(st.just("1"), names))
    path = {
        "infer": f"/v2/models/{model}/infer",
        "version": f"/v2/models/{model}/versions/{version}/infer",
        "meta": f"/v2/models/{model}",
        "ready": f"/v2/models/{model}/ready",
        "load": f"/v2/repository/models/{model}/load",
    }[route]
    method = "GET" if route in ("meta", "ready") else draw(st.sampled_from(["POST", "POST", "POST", "PUT", "DELETE"]))
    body, headers = draw(bodies())
    hints = {
        wire.PRIORITY: numbers,
        wire.DEADLINE_MS: numbers,
        wire.SITE: st.one_of(st.sampled_from(["edge-a", "cloud", "mars"]), st.text(max_size=300)),
        wire.REQUEST_ID: st.text(max_size=80),
        "Content-Type": st.sampled_from(["application/json", "application/octet-stream", "text/plain", "x/y"]),
    }
    for header, strategy in hints.items():
        if draw(st.booleans()):
            headers[header] = draw(strategy)
    # what http.client cannot put on the wire (CR, LF, NUL, non-Latin-1) is left out
    headers = {k: v for k, v in headers.items() if v.isprintable() and v.isascii()}
    return target, method, path, body, headers


grpc = pytest.importorskip("grpc")
from tritonclient.grpc import service_pb2 as pb  # noqa: E402

from tests.integration.test_grpc import ALLOWED as INFER_CODES  # noqa: E402

# the inference codes test_grpc allows, and those of the other calls the fuzzer makes
GRPC_ALLOWED = INFER_CODES | {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED}
GRPC_METHODS = [
    "ModelInfer",
    "ModelInfer",
    "ModelInfer",
    "ModelMetadata",
    "ModelConfig",
    "ModelStatistics",
    "ModelReady",
]
TYPED = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


def _good_grpc() -> bytes:
    req = pb.ModelInferRequest(model_name="sensor_mlp")
    req.inputs.add(name="readings", datatype="FP32", shape=[1, 16])
    req.raw_input_contents.append(struct.pack("<16f", *range(16)))
    return req.SerializeToString()  # type: ignore[no-any-return]


GOOD_GRPC = _good_grpc()


@st.composite
def grpc_messages(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """(target, method, message bytes)."""
    target = draw(st.sampled_from(["router", "router", "node"]))
    method = draw(st.sampled_from(GRPC_METHODS))
    kind = draw(st.sampled_from(["flipped", "random", "typed", "named"]))
    if kind == "flipped":
        buf = bytearray(GOOD_GRPC)
        for at, value in draw(st.lists(st.tuples(st.integers(0, len(buf) - 1), st.integers(0, 255)), max_size=6)):
            buf[at] = value
        return target, method, bytes(buf)
    if kind == "random":
        return target, method, draw(st.binary(max_size=512))
    req = pb.ModelInferRequest(
        model_name=draw(st.one_of(st.sampled_from(MODELS), names)), id=draw(st.text(max_size=64))
    )
    if kind == "typed":
        datatype = draw(st.sampled_from([*TYPED, "FP16", "BYTES", "X"]))
        shape = draw(st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=4))
        tensor = req.inputs.add(name=draw(st.sampled_from(["readings", "x", ""])), datatype=datatype, shape=shape)
        field = TYPED.get(datatype)
        if field is not None:
            values = {
                "bool_contents": st.booleans(),
                "int_contents": st.integers(-(2**31), 2**31 - 1),
                "int64_contents": st.integers(-(2**63), 2**63 - 1),
                "uint_contents": st.integers(0, 2**32 - 1),
                "uint64_contents": st.integers(0, 2**64 - 1),
                "fp32_contents": st.floats(width=32),
                "fp64_contents": st.floats(),
            }[field]
            getattr(tensor.contents, field).extend(draw(st.lists(values, max_size=64)))
    else:
        req.model_version = draw(st.one_of(st.just("1"), names))
        for key in draw(st.lists(st.text(max_size=12), max_size=4)):
            req.parameters[key].string_param = draw(st.text(max_size=20))
    return target, method, req.SerializeToString()


class Honest:
    """Clients that play by the rules beside the attack: a valid inference over HTTP and one over gRPC
    to the router every 50 ms, each with a 2 s deadline; what each got and how long it took."""

    DEADLINE_MS = 2000.0

    def __init__(self, stack: Stack) -> None:
        assert stack.router is not None and stack.router.grpc is not None
        self.url, self.grpc = stack.router_url, router_grpc(stack)
        self.results: list[tuple[str, object, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = infer_body()
        headers = {wire.DEADLINE_MS: str(self.DEADLINE_MS)}
        with grpc.insecure_channel(self.grpc) as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            while not self.stop.is_set():
                began = time.monotonic()
                try:
                    status: object = call(f"{self.url}/v2/models/sensor_mlp/infer", body, headers=headers)[0]
                except OSError as exc:
                    status = repr(exc)
                self.results.append(("http", status, (time.monotonic() - began) * 1000))
                began = time.monotonic()
                try:
                    infer(GOOD_GRPC, timeout=self.DEADLINE_MS / 1000)
                    code: object = grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    code = exc.code()
                self.results.append(("grpc", code, (time.monotonic() - began) * 1000))
                self.stop.wait(0.05)

    def __enter__(self) -> Honest:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Targets:
    def __init__(self, stack: Stack) -> None:
        node = next(iter(stack.nodes.values()))
        assert stack.router is not None and stack.router.grpc is not None and node.grpc is not None
        self.urls = {"router": stack.router_url, "node": node.url}
        self.conns: dict[str, http.client.HTTPConnection] = {}
        self.channels = {
            name: grpc.insecure_channel(t) for name, t in (("router", router_grpc(stack)), ("node", node.grpc))
        }
        self.sent = 0

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()
        for channel in self.channels.values():
            channel.close()

    def send_grpc(self, target: str, method: str, message: bytes) -> grpc.StatusCode:
        call = self.channels[target].unary_unary(f"/inference.GRPCInferenceService/{method}")
        self.sent += 1
        try:
            call(message, timeout=15)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK

    def send(self, target: str, method: str, path: str, body: bytes, headers: dict[str, str]) -> int | None:
        """The answer's status, or None for a request http.client will not put on the wire."""
        parts = urlsplit(self.urls[target])
        for attempt in range(2):
            conn = self.conns.get(target)
            if conn is None:
                conn = self.conns[target] = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=15)
            try:
                conn.putrequest(method, path, skip_accept_encoding=True)
            except (http.client.InvalidURL, ValueError, UnicodeError):
                conn.close()
                self.conns.pop(target, None)
                return None
            try:
                for name, value in headers.items():
                    conn.putheader(name, value)
                conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body)
                resp = conn.getresponse()
                resp.read()
                if resp.will_close:
                    conn.close()
                    self.conns.pop(target, None)
                self.sent += 1
                return resp.status
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # a keep-alive connection the server closed after the previous answer: once more, fresh
                conn.close()
                self.conns.pop(target, None)
                if attempt:
                    raise
        raise AssertionError("unreachable")


FUZZ_NODES = [
    {"id": "e1", "partition": "edge-a", "models": MODELS},
    {"id": "c1", "partition": "cloud", "tier": "cloud", "slots": 2, "models": MODELS},
]
FUZZ_ROUTER = {"max_body_bytes": 1 << 20, "outlier": {"consecutive": 3}}


def _descendants(pid: int) -> dict[str, int]:
    """The processes under `pid` by name and pid (the router's proxy, where it has one)."""
    parents: dict[int, list[tuple[int, str]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        parents.setdefault(ppid, []).append((int(stat.parent.name), name))
    out: dict[str, int] = {}
    todo = [pid]
    while todo:
        for child, name in parents.get(todo.pop(), []):
            out[f"{name}-{child}"] = child
            todo.append(child)
    return out


def test_hostile_requests_hurt_no_one(own_stack: Any) -> None:
    _attack(own_stack(FUZZ_NODES, router=FUZZ_ROUTER))


def test_hostile_requests_through_the_native_data_plane_hurt_no_one(broker: Any, tmp_path: Path) -> None:
    """The same attack on a router whose native data plane (HAProxy) carries its doors: what the proxy
    answers itself, what it carries to the nodes and what it passes to the router."""
    from router.dataplane.proxy import find_binary, install_hint
    from tests.integration.conftest import stack_factory

    if find_binary(None) is None:
        pytest.skip(f"no HAProxy here: {install_hint()}")
    with stack_factory(broker, tmp_path, data_plane=True) as make:
        stack = make(FUZZ_NODES, router=FUZZ_ROUTER)
        assert stack.router is not None and stack.router.dataplane_grpc is not None
        proxies = [n for n in _descendants(stack.router.popen.pid) if n.startswith("haproxy")]
        assert proxies, "no proxy under the router"
        for raw in MALFORMED:
            _malformed_gets_a_4xx(stack.router_url, raw)
        _attack(stack)


def _attack(stack: Stack) -> None:
    targets = Targets(stack)
    seen: dict[object, int] = {}
    pids = {p.name: p.popen.pid for p in (stack.router, *stack.nodes.values()) if p is not None}
    assert stack.router is not None
    # (its proxy, where it has one)
    pids.update({name: pid for name, pid in _descendants(stack.router.popen.pid).items() if name.startswith("haproxy")})
    rss_before = {name: _rss_mb(pid) for name, pid in pids.items()}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=not RANDOM,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.one_of(requests(), requests(), requests(), grpc_messages()))
    def attack(req: tuple[Any, ...]) -> None:
        if len(req) == 3:  # gRPC
            target, method, message = req
            code = targets.send_grpc(target, method, message)
            seen[code.name] = seen.get(code.name, 0) + 1
            assert code in GRPC_ALLOWED, (code, target, method, message[:300])
            return
        target, method, path, body, headers = req
        status = targets.send(target, method, path, body, headers)
        assume(status is not None)
        assert status is not None
        seen[status] = seen.get(status, 0) + 1
        assert status in ALLOWED, (status, target, method, path, body[:300], headers)

    try:
        with Honest(stack) as honest:
            attack()
    finally:
        targets.close()
    print(f"fuzz: {targets.sent} requests, answers {dict(sorted(seen.items(), key=str))}")
    assert targets.sent >= EXAMPLES
    late = [
        (door, got, round(ms))
        for door, got, ms in honest.results
        if got not in (200, grpc.StatusCode.OK) or ms > Honest.DEADLINE_MS
    ]
    assert honest.results and not late, (
        f"{len(late)} of {len(honest.results)} honest requests failed or were late: {late[:5]}"
    )
    grown = {name: round(_rss_mb(pid) - rss_before[name]) for name, pid in pids.items()}
    print(f"fuzz: {len(honest.results)} honest requests alongside, all in time; memory grown (MB) {grown}")
    assert all(mb < 200 for mb in grown.values()), grown  # bounded: no input may grow a process without limit

    # nobody died, nobody was ejected, and valid requests succeed everywhere
    assert stack.router is not None and stack.router.popen.poll() is None
    assert all(Path(f"/proc/{pid}").exists() for pid in pids.values()), pids
    for proc in stack.nodes.values():
        assert proc.popen.poll() is None, proc.name
    status, view, _ = call(f"{stack.router_url}/admin/view", headers=stack.admin_headers)
    assert status == 200 and view["health"]["ejected_now"] == [], view["health"]
    for proc in stack.nodes.values():
        for model in MODELS:
            meta = call(f"{proc.url}/v2/models/{model}")[1]
            shape = [1, *(d if d > 0 else 1 for d in meta["inputs"][0]["shape"][1:])]
            n = 1
            for d in shape:
                n *= d
            body = infer_body(meta["inputs"][0]["name"], shape, data=[0.5] * n)
            assert call(f"{proc.url}/v2/models/{model}/infer", body)[0] == 200, (proc.name, model)
            for site in ("edge-a", "cloud"):
                status, doc, hdrs = call(f"{stack.router_url}/v2/models/{model}/infer", body, headers={wire.SITE: site})
                assert status == 200, (model, site, doc)


MALFORMED = [
    b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + b"X-Long: " + b"a" * 20_000 + b"\r\n\r\n",
    b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GARBAGE\r\n\r\n",
    b"GET /v2/models/ech\x00o HTTP/1.1\r\nHost: x\r\n\r\n",
    # two lengths, a length beside chunking (request smuggling's openings)
    b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nContent-Length: 40\r\n\r\nabcd",
    b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"0\r\n\r\nGET /admin/view HTTP/1.1\r\nHost: x\r\n\r\n",
]


def _malformed_gets_a_4xx(url: str, raw: bytes) -> None:
    import socket

    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(raw)
        answer = sock.recv(4096)
    assert re.match(rb"HTTP/1\.[01] 4\d\d ", answer), (url, raw[:80], answer[:200])


@pytest.mark.parametrize("raw", MALFORMED)
def test_malformed_http_gets_a_4xx_and_the_router_lives(own_stack: Any, raw: bytes) -> None:
    stack: Stack = own_stack([{"id": "e1", "partition": "edge-a", "models": ["echo"]}])
    for url in (stack.router_url, next(iter(stack.nodes.values())).url):
        _malformed_gets_a_4xx(url, raw)
    assert call(f"{stack.router_url}/v2/health/live")[0] == 200
