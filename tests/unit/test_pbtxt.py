"""Triton's config.pbtxt in a model repository: read with protobuf's text format against Triton's
schema, what it sets honoured, what it cannot be refused with the file, field and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodes import pbtxt
from nodes.config import NodeConfig
from nodes.protocol import TensorSpec
from nodes.repository import resolve, scan
from telemetry.process.configfile import ConfigError
from tests.user_models import scorer_triton_config

GOOD = "# a model configuration written for Triton\n" + scorer_triton_config(
    preferred="4, 8", delay_us=2500, instances=2
)


def repo(
    tmp: Path, pbtxt_text: str | None, yaml_text: str | None = None, versions: tuple[int, ...] = (1, 2, 3)
) -> Path:
    for v in versions:
        (tmp / "scorer" / str(v)).mkdir(parents=True)
        (tmp / "scorer" / str(v) / "model.onnx").write_bytes(b"graph")
    if pbtxt_text is not None:
        (tmp / "scorer" / "config.pbtxt").write_text(pbtxt_text)
    if yaml_text is not None:
        (tmp / "scorer" / "config.yaml").write_text(yaml_text)
    return tmp


def test_what_a_triton_configuration_sets_is_what_the_node_serves(tmp_path: Path) -> None:
    found = scan(repo(tmp_path, GOOD))["scorer"]
    assert found.served == (1, 2, 3)  # version_policy: all
    assert found.settings["max_batch"] == 8
    assert found.settings["preferred_batch"] == [4, 8] and found.settings["max_queue_delay_ms"] == 2.5
    cfg = resolve(NodeConfig(node_id="n", model_repository=str(tmp_path)))
    names = {m.name: m for m in cfg.models}
    assert set(names) == {"scorer", "scorer:1", "scorer:2"}
    assert all(m.max_batch == 8 and m.triton_config == str(tmp_path / "scorer" / "config.pbtxt") for m in cfg.models)
    declared = pbtxt.read(tmp_path / "scorer" / "config.pbtxt", "scorer")
    assert [(d.name, d.datatype, d.dims, d.output) for d in declared.declared] == [
        ("features", "FP32", (3,), False),
        ("offset", "INT64", (1,), False),
        ("score", "FP32", (1,), True),
        ("next", "INT64", (1,), True),
    ]


@pytest.mark.parametrize(
    ("policy", "served"),
    [
        ("version_policy: { latest { num_versions: 2 } }", (2, 3)),
        ("version_policy: { specific { versions: [ 1, 3 ] } }", (1, 3)),
        ("", (3,)),  # Triton's default: the latest one
    ],
)
def test_version_policies(tmp_path: Path, policy: str, served: tuple[int, ...]) -> None:
    assert scan(repo(tmp_path, f'name: "scorer"\n{policy}\n'))["scorer"].served == served


def test_config_yaml_wins_where_both_set_a_value(tmp_path: Path) -> None:
    found = scan(repo(tmp_path, GOOD, "versions: [2]\nmax_batch: 2\n"))["scorer"]
    assert found.served == (2,) and found.settings["max_batch"] == 2
    assert found.settings["max_queue_delay_ms"] == 2.5  # what only config.pbtxt says still holds


@pytest.mark.parametrize(
    ("text", "field", "line"),
    [
        ('name: "scorer"\nplatform: "tensorrt_plan"\n', "platform", 2),
        ('name: "scorer"\n\nbackend: "python"\n', "backend", 3),
        ('name: "other"\n', "name", 1),
        ('name: "scorer"\nsequence_batching { }\n', "sequence_batching", 2),
        ('name: "scorer"\ndynamic_batching {\n  priority_levels: 2\n}\n', "priority_levels", 3),
        (
            'name: "scorer"\ndynamic_batching { priority_queue_policy { key: 1 value: { } } }\n',
            "priority_queue_policy",
            2,
        ),
        (
            'max_batch_size: 4\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] reshape { shape: [ 3 ] } } ]\n',
            "reshape",
            2,
        ),
        ("instance_group [ { kind: KIND_MODEL } ]\n", "kind", 1),
        ("version_policy: { specific { versions: [ 9 ] } }\n", "config.pbtxt", 0),
        ("version_policy: { latest { num_versions: 0 } }\n", "num_versions", 1),
        ('input [ { name: "x" dims: [ 3 ] } ]\n', "data_type", 1),
        ("max_batch_size: 4\nmodel_transaction_policy { decoupled: true }\n", "model_transaction_policy", 2),
    ],
)
def test_what_cannot_be_honoured_is_one_line_with_file_field_and_line(
    tmp_path: Path, text: str, field: str, line: int
) -> None:
    with pytest.raises(ConfigError) as info:
        scan(repo(tmp_path, text))
    message = str(info.value)
    assert "\n" not in message and "config.pbtxt" in message and field in message
    if line:
        assert f"config.pbtxt:{line}: {field}" in message


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ('name: "scorer"\nmax_batch_sise: 4\n', "config.pbtxt:2:"),  # a typo: protobuf's own parser says where
        ('name: "scorer"\nmax_batch_size: "four"\n', "config.pbtxt:2:"),
        ("dynamic_batching {\n", "config.pbtxt:"),
        ("\xff\xfe", "not UTF-8"),
    ],
)
def test_unreadable_configurations(tmp_path: Path, text: str, where: str) -> None:
    root = repo(tmp_path, None)
    (root / "scorer" / "config.pbtxt").write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        scan(root)
    assert where in str(info.value)


def test_a_huge_configuration_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    root = repo(tmp_path, "# " + "x" * (2 << 20))
    with pytest.raises(ConfigError, match="larger than"):
        scan(root)


def _spec(shape: tuple[int, ...], datatype: str = "FP32") -> TensorSpec:
    return TensorSpec("x", datatype, shape)


def test_declared_tensors_are_checked_against_the_graph() -> None:
    x = [pbtxt.Declared("x", "FP32", (3,), False)]
    pbtxt.check_graph(x, True, {"x": _spec((-1, 3))}, {})
    pbtxt.check_graph([pbtxt.Declared("x", "FP32", (-1, 3), False)], False, {"x": _spec((-1, 3))}, {})
    pbtxt.check_graph([pbtxt.Declared("x", "FP32", (-1,), False)], True, {"x": _spec((-1, 7))}, {})
    bad = [
        (x, True, {"y": _spec((-1, 3))}, "not in the graph"),
        (x, True, {"x": _spec((-1, 3), "FP16")}, "FP16"),
        (x, True, {"x": _spec((-1, 4))}, "dims [3]"),
        (x, True, {"x": _spec((2, 3))}, "no dynamic first axis"),
        (x, False, {"x": _spec((-1, 3))}, "dims [3]"),
    ]
    for declared, batching, inputs, why in bad:
        with pytest.raises(ValueError, match=r".*") as info:
            pbtxt.check_graph(declared, batching, inputs, {})
        assert why in str(info.value)


def test_a_default_queue_policy_with_reject_is_honoured(tmp_path: Path) -> None:
    text = (
        'name: "scorer"\nmax_batch_size: 4\ndynamic_batching {\n  default_queue_policy {\n'
        "    timeout_action: REJECT\n    default_timeout_microseconds: 20000\n    allow_timeout_override: true\n"
        "    max_queue_size: 3\n  }\n}\n"
    )
    found = scan(repo(tmp_path, text))["scorer"]
    assert found.settings["queue_timeout_ms"] == 20.0 and found.settings["max_queue_size"] == 3
    assert found.settings["queue_timeout_override"] is True
    delay = text.replace("REJECT", "DELAY")
    (tmp_path / "scorer" / "config.pbtxt").write_text(delay)
    with pytest.raises(ConfigError, match=r"config.pbtxt:5: timeout_action: DELAY"):
        scan(tmp_path)
