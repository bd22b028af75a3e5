"""Scenarios name users' model files and repositories, relative to the scenario's folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from scenarios.sim.state import model_bytes
from scenarios.spec.schema import ScenarioError, load_scenario
from scenarios.stack.nodeconfig import node_config
from tests.user_models import repository

SCENARIO = """
name: users-models
topology:
  partitions: [edge-a]
  nodes:
    - {{id: n1, partition: edge-a, models: [scorer, flags], model_repository: {repo}}}
    - {{id: n2, partition: edge-a, models: [theirs, echo]}}
workload:
  sites: [{{site: edge-a, rate_rps: 5, models: {{scorer: 1, theirs: 1}}}}]
policies: [p2c]
models:
  theirs: {{path: {path}}}
"""


def write(tmp: Path, repo: str = "repo", path: str = "files/theirs.onnx") -> Path:
    repository(tmp / "repo", broken=False)
    (tmp / "files").mkdir(exist_ok=True)
    (tmp / "files" / "theirs.onnx").write_bytes((tmp / "repo" / "scorer" / "1" / "model.onnx").read_bytes())
    f = tmp / "s.yaml"
    f.write_text(SCENARIO.format(repo=repo, path=path))
    return f


def test_files_and_repositories_resolve_against_the_scenario_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir("/")  # not the scenario's folder
    sc = load_scenario(write(tmp_path))
    assert sc.models["theirs"].path == str((tmp_path / "files" / "theirs.onnx").resolve())
    n1 = sc.topology.nodes[0]
    assert n1.model_repository == str((tmp_path / "repo").resolve())
    cfg = node_config(n1, 8000, "127.0.0.1:9092", sc.seed, catalogue=sc.models)
    assert cfg["model_repository"] == n1.model_repository and [m["name"] for m in cfg["models"]] == ["scorer", "flags"]
    cfg2 = node_config(sc.topology.nodes[1], 8001, "127.0.0.1:9092", sc.seed, catalogue=sc.models)
    assert cfg2["models"][0]["path"] == sc.models["theirs"].path
    # the simulator accounts the files' sizes as the nodes do
    assert model_bytes(sc, "theirs") == (tmp_path / "files" / "theirs.onnx").stat().st_size
    assert model_bytes(sc, "scorer") == (tmp_path / "repo" / "scorer" / "2" / "model.onnx").stat().st_size


@pytest.mark.parametrize(
    ("repo", "path", "needle"),
    [
        ("repo", "files/missing.onnx", "models.theirs.path: no such file"),
        ("nowhere", "files/theirs.onnx", "model_repository"),
    ],
)
def test_a_missing_file_or_repository_is_a_scenario_error(tmp_path: Path, repo: str, path: str, needle: str) -> None:
    with pytest.raises(ScenarioError, match=needle):
        load_scenario(write(tmp_path, repo, path))


def test_a_model_the_repository_does_not_hold_is_named(tmp_path: Path) -> None:
    f = write(tmp_path)
    f.write_text(f.read_text().replace("models: [scorer, flags]", "models: [scorer, nothere]"))
    with pytest.raises(ScenarioError, match="nothere"):
        load_scenario(f)
