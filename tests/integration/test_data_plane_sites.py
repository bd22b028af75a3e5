"""Routers per site, each with its own native data plane (router.dataplane): every site's clients
reach their own site's proxy, which carries what its router's policy lets it, on that router's view
(edge_first: the site's own nodes first); in network namespaces where the machine allows, else on the
loopback. The replay's report counts what every site's proxy carried."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from router.dataplane.proxy import find_binary, install_hint
from scenarios.replay.run import _carried, data_plane_note
from scenarios.stack.sites import SiteStack
from tests.integration.http import call, infer_body
from tests.integration.test_site_partitions import two_sites

if find_binary(None) is None:
    pytest.skip(f"no HAProxy here: {install_hint()}", allow_module_level=True)


def answers(url: str, headers: dict[str, str], n: int = 12) -> list[tuple[int, str, str]]:
    out = []
    for _ in range(n):
        status, _, got = call(f"{url}/v2/models/sensor_mlp/infer", infer_body(), headers=headers)
        lower = {k.lower(): v for k, v in got.items()}
        out.append((status, lower.get("x-edgeroute-node", "none"), lower.get("x-edgeroute-data-plane", "router")))
    return out


def test_each_site_has_its_own_proxy_which_keeps_its_sites_requests_home(tmp_path: Path) -> None:
    stack = SiteStack(two_sites("edge_first", slots=2, linked=False), log_dir=tmp_path, data_plane=True)
    try:
        stack.start()
        urls = stack.router_urls or {}
        client: dict[str, Any] = {"x-edgeroute-deadline-ms": "1000", **stack.client_headers}
        for site, own in (("site-a", "a1"), ("site-b", "b1")):
            router = stack.site_routers[site]
            assert router.dataplane and urls[site] == router.dataplane, "the site's clients' door is its proxy"
            assert answers(urls[site], client) == [(200, own, "native")] * 12, f"{site}: its own node, natively"
            status, view, _ = call(f"{router.url}/admin/view", headers=stack.admin_headers)
            assert status == 200 and view["data_plane"]["native"] is True, view.get("data_plane")
        assert data_plane_note(stack) == {"on": True}
        carried = _carried(stack)
        assert carried is not None and carried["native"] >= 24, carried
    finally:
        stack.stop()
    assert not stack.site_routers
