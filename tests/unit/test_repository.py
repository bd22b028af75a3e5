"""A node's model repository (nodes.repository): what is a model and a version, which versions are
served under which names, and the mistakes that stop a node with a clear message."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from nodes.__main__ import load_config
from nodes.config import ModelSpec, NodeConfig
from nodes.repository import repository_index, resolve, scan
from telemetry.process.configfile import ConfigError
from tests.user_models import repository


def node(**kw: object) -> NodeConfig:
    return NodeConfig.model_validate({"node_id": "n", **kw})


def test_scan_finds_models_and_numeric_versions_and_passes_over_the_rest(tmp_path: Path) -> None:
    root = repository(tmp_path)
    (root / "scorer" / "latest").mkdir()  # not a number
    (root / "scorer" / "latest" / "model.onnx").write_bytes(b"x")
    (root / "scorer" / "3").mkdir()  # a version directory without a model file
    (root / ".hidden" / "1").mkdir(parents=True)
    (root / ".hidden" / "1" / "model.onnx").write_bytes(b"x")
    (root / "bad name" / "1").mkdir(parents=True)
    (root / "bad name" / "1" / "model.onnx").write_bytes(b"x")
    (root / "README.md").write_text("a file at the top")
    (root / "empty").mkdir()
    found = scan(root)
    assert sorted(found) == ["broken", "flags", "scorer"]
    assert found["scorer"].versions == (1, 2) and found["scorer"].served == (2,)
    assert found["scorer"].default == 2


def test_versions_sort_as_numbers_not_as_text(tmp_path: Path) -> None:
    for v in (2, 10, 9):
        (tmp_path / "m" / str(v)).mkdir(parents=True)
        (tmp_path / "m" / str(v) / "model.onnx").write_bytes(b"x")
    assert scan(tmp_path)["m"].served == (10,)


@pytest.mark.parametrize(
    ("config", "served"),
    [("versions: all\n", (1, 2)), ("versions: [1]\n", (1,)), ("versions: latest\n", (2,)), ("max_batch: 4\n", (2,))],
)
def test_config_yaml_chooses_the_versions(tmp_path: Path, config: str, served: tuple[int, ...]) -> None:
    assert scan(repository(tmp_path, config=config))["scorer"].served == served


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ("versions: [3]\n", "versions 3 have no model.onnx"),
        ("versions: []\n", "serve at least one"),
        ("versions: newest\n", "versions"),
        ("max_batch: 0\n", "max_batch"),
        ("shape: [1, 2]\n", "shape"),  # not a setting: unknown keys are refused
        ("- a list\n", "mapping"),
        ("versions: [1\n", "YAML"),
    ],
)
def test_a_wrong_config_yaml_stops_the_node_with_its_file_and_field(tmp_path: Path, config: str, needle: str) -> None:
    root = repository(tmp_path, config=config)
    with pytest.raises(ConfigError) as info:
        resolve(node(model_repository=str(root)))
    assert "config.yaml" in str(info.value) and needle.lower() in str(info.value).lower()


def test_without_a_models_list_every_model_is_served_and_its_settings_come_along(tmp_path: Path) -> None:
    root = repository(tmp_path, config="versions: all\nmax_batch: 8\nsize_mb: 12\n")
    cfg = resolve(node(model_repository=str(root)))
    by_name = {m.name: m for m in cfg.models}
    assert sorted(by_name) == ["broken", "flags", "scorer", "scorer:1"]
    assert by_name["scorer"].version == "2" and by_name["scorer"].model is None
    assert by_name["scorer:1"].version == "1" and by_name["scorer:1"].model == "scorer"
    assert by_name["scorer:1"].served_name == "scorer"
    assert by_name["scorer"].path == str(root / "scorer" / "2" / "model.onnx")
    assert by_name["scorer"].max_batch == 8 and by_name["scorer:1"].size_mb == 12
    assert resolve(cfg).models == cfg.models, "resolving twice changes nothing"


def test_a_models_list_picks_from_the_repository_and_its_entries_win(tmp_path: Path) -> None:
    root = repository(tmp_path, config="max_batch: 8\n")
    cfg = resolve(
        node(
            model_repository=str(root),
            models=[{"name": "scorer", "max_batch": 2}, {"name": "echo"}, {"name": "flags", "version": "1"}],
        )
    )
    by_name = {m.name: m for m in cfg.models}
    assert sorted(by_name) == ["echo", "flags", "scorer"]
    assert by_name["scorer"].max_batch == 2 and by_name["scorer"].version == "2"
    assert by_name["echo"].path is None, "not in the repository: the zoo's"
    with pytest.raises(ConfigError, match="no version 5"):
        resolve(node(model_repository=str(root), models=[{"name": "scorer", "version": "5"}]))


def test_repository_mistakes_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        resolve(node(model_repository=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no model"):
        resolve(node(model_repository=str(tmp_path / "empty")))
    with pytest.raises(ValidationError, match="needs `models`, a `model_repository`"):
        node()
    with pytest.raises(ValidationError, match="not both"):
        ModelSpec(name="m", path="/x.onnx", zoo="echo")
    with pytest.raises(ValidationError):
        ModelSpec(name="m", version="v2")
    with pytest.raises(ValidationError):
        ModelSpec(name="../m")
    with pytest.raises(ValidationError, match="unique"):
        node(models=[{"name": "echo"}, {"name": "echo"}])


def test_the_node_command_reads_the_repository_at_start(tmp_path: Path) -> None:
    root = repository(tmp_path / "repo")
    cfg = load_config(f'{{"node_id": "n", "model_repository": "{root}"}}')
    assert {m.name for m in cfg.models} == {"scorer", "flags", "broken"}
    with pytest.raises(ConfigError):
        load_config(f'{{"node_id": "n", "model_repository": "{tmp_path / "missing"}"}}')


def test_the_index_lists_every_version_with_its_state(tmp_path: Path) -> None:
    root = repository(tmp_path, broken=False)
    cfg = resolve(node(model_repository=str(root), models=[{"name": "scorer"}, {"name": "echo"}]))
    index = {(e["name"], e["version"]): e for e in repository_index(cfg, {"scorer"})}
    assert index[("scorer", "2")]["state"] == "READY"
    assert index[("scorer", "1")]["state"] == "UNAVAILABLE" and "not served" in index[("scorer", "1")]["reason"]
    assert index[("flags", "1")]["state"] == "UNAVAILABLE"
    assert index[("echo", "1")]["state"] == "UNAVAILABLE", "a zoo model not resident"


def test_the_device_is_the_one_the_session_really_got(caplog: pytest.LogCaptureFixture) -> None:
    """ONNX Runtime falls back to the CPU silently when its CUDA provider cannot load; the node reads the
    session's providers: `cuda` then refuses to serve the model, `auto` says so in its log."""
    from nodes.runtime import session_device

    cuda, cpu = ["CUDAExecutionProvider", "CPUExecutionProvider"], ["CPUExecutionProvider"]
    assert session_device("m", cuda, cuda, "cuda") == "cuda"
    assert session_device("m", cpu, cpu, "cpu") == "cpu"
    assert session_device("m", cpu, cpu, "auto") == "cpu" and not caplog.records
    with pytest.raises(RuntimeError, match="device 'cuda' requested"):
        session_device("m", cuda, cpu, "cuda")
    assert session_device("m", cuda, cpu, "auto") == "cpu"
    assert "runs on the CPU" in caplog.text


def test_a_loaded_users_model_says_where_it_runs(tmp_path: Path) -> None:
    from nodes.runtime import load_model

    root = repository(tmp_path, broken=False)
    cfg = resolve(node(model_repository=str(root)))
    spec = next(m for m in cfg.models if m.name == "scorer")
    model = load_model(spec, ["CPUExecutionProvider"], 1, None, "cpu")
    assert model.device == "cpu" and model.version == "2" and model.served_name == "scorer"
    assert model.metadata()["inputs"][1] == {"name": "offset", "datatype": "INT64", "shape": [-1, 1]}


def test_a_model_with_a_tensor_type_the_node_does_not_serve_fails_to_load_saying_so(tmp_path: Path) -> None:
    """A string tensor (BYTES) cannot be served; the load said only ONNX Runtime's complaint about
    the warm-up's float zeros ("Unexpected input data type. Actual: (tensor(float))")."""
    from nodes.config import ModelSpec
    from nodes.runtime import load_model
    from tests.user_models import strings

    path = tmp_path / "strings.onnx"
    path.write_bytes(strings())
    with pytest.raises(
        ValueError, match=r"input 'text' is BYTES; output 'text_out' is BYTES: this node serves tensors of BOOL"
    ):
        load_model(ModelSpec(name="strings", path=str(path)), ["CPUExecutionProvider"], 1, None)
