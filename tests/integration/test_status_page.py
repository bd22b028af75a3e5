"""The status page in a real browser: headless Chromium opens it against a live stack with auth on
(the admin token in the URL fragment, never sent to the server), its script fills the page from
`/admin/view`, and the test checks what it shows and saves a screenshot
(reports/screenshots/status_page.png). Skipped where Chromium is not installed (`.ci/run` installs
Debian's chromium)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from scenarios.stack.launcher import Stack
from tests.integration.http import call, infer_body

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
SCREENSHOTS = Path(__file__).resolve().parents[2] / "reports" / "screenshots"
ADMIN, CLIENT = "a" * 24, "c" * 24
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium)")


def chromium(profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=6000",  # let the page's script fetch /admin/view and render
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def test_status_page_in_headless_chromium(own_stack: Any, tmp_path: Path) -> None:
    stack: Stack = own_stack(
        [
            {"id": "edge-1", "partition": "edge-a", "models": ["sensor_mlp", "mobilenet_s"]},
            # resnet_s (~1.5 MB) cannot fit a 1 MB budget: it stays cold
            {"id": "cloud-1", "partition": "cloud", "tier": "cloud", "models": ["sensor_mlp", "resnet_s"],
             "memory_budget_mb": 1},
        ],
        router={"auth": {"tokens": {"ops": ADMIN, "cams": CLIENT}, "admin_clients": ["ops"]}},
    )  # fmt: skip
    url = stack.router_url
    headers = {"Authorization": f"Bearer {CLIENT}"}
    for _ in range(20):
        assert call(f"{url}/v2/models/sensor_mlp/infer", infer_body(), headers=headers)[0] == 200

    # without a token the page asks for one (the view is admin-only)
    dom = chromium(tmp_path / "p0", "--dump-dom", f"{url}/").stdout
    assert 'id="auth" style="display: block;"' in dom, dom[-2000:]

    dom = chromium(tmp_path / "p1", "--dump-dom", f"{url}/#token={ADMIN}").stdout
    assert 'data-loaded="1"' in dom, dom[-3000:]
    assert '<b id="policy">p2c</b>' in dom and '<b id="known">2</b>' in dom
    edge = dom[dom.index('data-node="edge-1"') :].split("</tr>")[0]
    cloud = dom[dom.index('data-node="cloud-1"') :].split("</tr>")[0]
    assert "<td>cpu" in edge and "<td>mobilenet_s, sensor_mlp</td>" in edge
    assert '<td class="cold">resnet_s</td>' in cloud and "MiB" in cloud and "%" in cloud
    model = dom[dom.index('data-model="sensor_mlp"') :].split("</tr>")[0]
    assert '<td class="num">0</td>' in model  # no errors
    assert "ejections 0" in dom and '<p id="error" class="err"></p>' in dom

    assert '<p id="canary-state" class="muted">no canary running</p>' in dom
    # a canary running: its arms in words, its chart drawn, its start in the log; policy state as a table
    admin = {"Authorization": f"Bearer {ADMIN}"}
    canary = {"canary": {"candidate": {"preset": "round_robin"}, "share": 0.5, "by": "request",
                         "guard": {"interval_s": 0.5, "min_requests": 100000, "min_rollback": 100000}}}  # fmt: skip
    assert call(f"{url}/admin/policy", json.dumps(canary).encode(), "PUT", headers=admin)[0] == 200
    for _ in range(40):
        assert call(f"{url}/v2/models/sensor_mlp/infer", infer_body(), headers=headers)[0] == 200
    time.sleep(1.5)
    dom = chromium(tmp_path / "p3", "--dump-dom", f"{url}/#token={ADMIN}").stdout
    assert "candidate {" in dom and "round_robin" in dom and "by request" in dom, dom[-3000:]
    assert 'id="canary-chart"' in dom and 'style="display: block;' in dom.split('id="canary-chart"')[1][:200]
    assert "<td>start</td>" in dom and '<table id="policy-state">' in dom
    assert '<p id="tenants-off" class="muted">no tenants configured</p>' in dom

    # tenants turned on live: each one's row, with what it was admitted and refused
    tenants = {"named": {"cams": {"clients": ["cams"], "quota": {"rps": 2, "burst": 2}}}}
    assert call(f"{url}/admin/tenants", json.dumps(tenants).encode(), "PUT", headers=admin)[0] == 200
    statuses = [call(f"{url}/v2/models/sensor_mlp/infer", infer_body(), headers=headers)[0] for _ in range(6)]
    assert statuses.count(429) >= 3, statuses
    dom = chromium(tmp_path / "p4", "--dump-dom", f"{url}/#token={ADMIN}").stdout
    row = dom[dom.index('data-tenant="cams"') :].split("</tr>")[0]
    assert "quota_rps" in row and "rps 2" in row, row

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOTS / "status_page.png"
    out = chromium(tmp_path / "p2", f"--screenshot={shot}", "--window-size=1400,900", f"{url}/#token={ADMIN}")
    assert shot.is_file() and shot.stat().st_size > 10_000, out.stderr[-2000:]
