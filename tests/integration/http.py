"""A tiny blocking HTTP helper for integration tests (raw bytes in, status + JSON out)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def call(
    url: str,
    body: bytes | None = None,
    method: str | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 10.0,
) -> tuple[int, Any, dict[str, str]]:
    req = urllib.request.Request(
        url,
        data=body,
        method=method or ("POST" if body is not None else "GET"),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw, status, hdrs = resp.read(), resp.status, dict(resp.headers)
    except urllib.error.HTTPError as exc:
        raw, status, hdrs = exc.read(), exc.code, dict(exc.headers)
    try:
        doc = json.loads(raw) if raw else None
    except ValueError:
        doc = raw.decode(errors="replace")
    return status, doc, hdrs


def infer_body(
    name: str = "readings",
    shape: list[int] | None = None,
    datatype: str = "FP32",
    data: list[Any] | None = None,
) -> bytes:
    shape = shape if shape is not None else [1, 16]
    data = data if data is not None else [0.5] * 16
    return json.dumps({"inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": data}]}).encode()
