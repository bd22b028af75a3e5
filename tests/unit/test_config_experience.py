"""One config experience for router, node and scenario files: settings from the environment
(EDGEROUTE_<FIELD>, `__` for nesting, `_FILE` for secrets), and every mistake one line naming the
field and its YAML line (or variable), exit 2, no traceback; the README's config examples are the
inputs that get broken."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import pytest
import yaml

from nodes.__main__ import load_config as load_node
from nodes.__main__ import main as node_main
from nodes.config import NodeConfig
from router.__main__ import main as router_main
from router.config import load_config as load_router
from router.config import parse_config
from scenarios.cli.main import main as cli_main
from scenarios.spec.schema import parse_scenario
from telemetry.process.configfile import ConfigError, env_overlay, safe_yaml
from tests.helpers import mutated

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
SCENARIOS = ROOT / "docs" / "scenarios.md"


def readme_block(heading: str, page: Path = README, nth: int = 0) -> str:
    """The `nth` ```yaml block after a heading of a page (the README or a docs page)."""
    text = page.read_text()
    start = text.index(heading)
    blocks = re.findall(r"```yaml\n(.*?)```", text[start:], re.S)
    assert len(blocks) > nth, heading
    # the docs write secrets as placeholders
    return blocks[nth].replace("<secret>", "s" * 32).replace("<token>", "t" * 24)


ROUTER_DOC = readme_block("### Router config", CONFIGURATION)
NODE_DOC = readme_block("### Node config", CONFIGURATION)
SCENARIO_DOC = readme_block("## Scenarios", SCENARIOS)
# the README's own short examples: a router's and a node's config
README_ROUTER = readme_block("## Configuring")
README_NODE = readme_block("## Configuring", nth=1)
README_SITE_ROUTER = readme_block("### A router per site")
README_MQTT = readme_block("### The MQTT door")
README_TENANTS = readme_block("### Tenants")


def _load(kind: str, text: str, tmp_path: Path) -> object:
    path = tmp_path / f"{kind}.yaml"
    path.write_text(text)
    if kind == "router":
        return load_router(path, environ={})
    if kind == "node":
        return load_node(str(path), environ={})
    return parse_scenario(text, str(path))


@pytest.mark.parametrize(
    "kind,doc",
    [
        ("router", ROUTER_DOC),
        ("node", NODE_DOC),
        ("scenario", SCENARIO_DOC),
        ("router", README_ROUTER),
        ("node", README_NODE),
        ("router", README_SITE_ROUTER),
        ("router", README_MQTT),
        ("router", README_TENANTS),
    ],
)
def test_readme_examples_are_valid(kind: str, doc: str, tmp_path: Path) -> None:
    _load(kind, doc, tmp_path)


def _top_keys(doc: str) -> list[tuple[int, str]]:
    return [(i, m.group(1)) for i, line in enumerate(doc.splitlines()) if (m := re.match(r"^([a-z_]+):", line))]


def _mistakes(doc: str) -> list[tuple[str, str, str, int]]:
    """(label, broken document, field the error must name, its 1-based line) for each top-level key:
    the key misspelt, and its value replaced by one of the wrong type."""
    lines = doc.splitlines()
    out = []
    for i, key in _top_keys(doc):
        misspelt = [*lines]
        misspelt[i] = misspelt[i].replace(f"{key}:", f"{key}x:", 1)
        out.append((f"{key}-misspelt", "\n".join(misspelt), f"{key}x", i + 1))
        value = yaml.safe_load(lines[i].split(":", 1)[1]) if lines[i].split(":", 1)[1].strip() else {}
        wrong = "[[1, 2]]" if not isinstance(value, list) else "{not: a list}"
        if isinstance(value, str) or value is None:
            wrong = "{a: 1}"
        retyped = [*lines[: i + 1]]
        retyped[i] = f"{key}: {wrong}"
        # drop the old value's indented continuation lines
        rest = lines[i + 1 :]
        while rest and (rest[0].startswith(" ") or rest[0].startswith("-")):
            rest = rest[1:]
        out.append((f"{key}-wrong-type", "\n".join(retyped + rest), key, i + 1))
    return out


CASES = [
    (kind, *m)
    for kind, doc in (("router", ROUTER_DOC), ("node", NODE_DOC), ("scenario", SCENARIO_DOC))
    for m in _mistakes(doc)
]


@pytest.mark.parametrize("kind,label,doc,field,line", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_every_mistake_is_one_line_naming_field_and_line(
    kind: str, label: str, doc: str, field: str, line: int, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as info:
        _load(kind, doc, tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert f"{kind}.yaml: {field}" in message, message
    assert f"(line {line})" in message or "line" in message and field in message, message


HOSTILE_VALUES = [
    -1, -(2**63), 2**64, 1e300, float("inf"), float("nan"), "", "x" * 300, "a\x00b", "../..", None, True,
    [], {}, {"abc": 1}, [[1, 2]], "http://a@b", 0, "/dev/zero", "0" * 5000,
]  # fmt: skip


def _mutated(doc: object, rng: random.Random) -> object:
    """`doc` with a hostile value somewhere, or a key added or dropped (lists entered too)."""
    keys = ["abc", "port", "x" * 200, "models", "0"]
    return mutated(doc, rng, HOSTILE_VALUES, keys, odds=(0.45, 0.75, 0.9), max_depth=4, lists=True)


def test_generated_hostile_configs_are_one_line_mistakes_or_valid(tmp_path: Path) -> None:
    """The README's router, node and scenario documents, each mutated fifty times (hostile
    values anywhere, keys added and dropped): every load is a valid config or one ConfigError line,
    never another exception. (This found the TLS file check raising on a name past the system's
    limit.) A fresh seed each run with EDGEROUTE_FUZZ_RANDOM=1."""
    seed = random.randrange(1 << 30) if os.environ.get("EDGEROUTE_FUZZ_RANDOM") == "1" else 7
    rng = random.Random(seed)
    seeds = {
        "router": yaml.safe_load(ROUTER_DOC),
        "node": yaml.safe_load(NODE_DOC),
        "scenario": yaml.safe_load(SCENARIO_DOC),
    }
    for n in range(150):
        kind = ("router", "node", "scenario")[n % 3]
        doc = seeds[kind]
        for _ in range(rng.randrange(1, 4)):
            doc = _mutated(doc, rng)
        try:
            text = yaml.safe_dump(doc, allow_unicode=True)
        except yaml.YAMLError:
            continue
        try:
            _load(kind, text, tmp_path)
        except ConfigError as exc:
            assert "\n" not in str(exc), (seed, kind, text)
        except Exception as exc:  # noqa: BLE001 - the point: nothing else may escape
            raise AssertionError(f"seed {seed}: {kind} raised {type(exc).__name__}: {exc}\n{text[:2000]}") from None


def test_misspelt_setting_suggests_the_field(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("port: 8000\noutlier:\n  consecutve: 3\n")
    with pytest.raises(ConfigError) as info:
        load_router(path, environ={})
    assert str(info.value).endswith("outlier.consecutve (line 3): unknown setting (did you mean 'consecutive'?)")


def test_hostile_documents_are_one_line_errors(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("[" * 50_000 + "]" * 50_000)
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_router(path, environ={})
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_node("{" + '"a":[' * 50_000, environ={})
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="cannot read"):
        load_router(path, environ={})


def alias_bomb(levels: int, under: str = "") -> str:
    """YAML of a few hundred bytes whose aliases expand to 10**levels strings."""
    lines = [f'{under}k0: &a0 ["x","x","x","x","x","x","x","x","x","x"]']
    lines += [f"{under}k{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_documents_that_expand_past_any_config_are_refused_before_validation(tmp_path: Path) -> None:
    """Aliases repeat what they name: nine levels of ten are 10**9 values from a 500-byte file for
    whatever walks the document. Refused at once as one line, for routers, nodes, model repositories,
    scenarios and settings from the environment alike; a config's ordinary aliases still work."""
    import time

    from nodes.repository import scan

    path = tmp_path / "router.yaml"
    path.write_text("telemetry_key_nodes:\n" + alias_bomb(9, under="  "))
    began = time.perf_counter()
    with pytest.raises(ConfigError, match="router.yaml: more than 1,000,000 values once its aliases are expanded"):
        load_router(path, environ={})
    assert time.perf_counter() - began < 60  # (a liveness bound, not a speed target: the expansion takes hours)
    with pytest.raises(ConfigError, match="more than 1,000,000 values"):
        parse_scenario(alias_bomb(9), "s.yaml")
    repo = tmp_path / "repo"
    (repo / "m" / "1").mkdir(parents=True)
    (repo / "m" / "1" / "model.onnx").write_bytes(b"not read here")
    (repo / "m" / "config.yaml").write_text(alias_bomb(9))
    with pytest.raises(ConfigError, match="config.yaml: more than 1,000,000 values"):
        scan(repo)
    flow = "[&a0 [x, x, x, x, x, x, x, x, x, x]" + "".join(
        f", &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)
    )
    with pytest.raises(ConfigError, match="EDGEROUTE_LINKS"):  # (kept as the string, which is not a list)
        load_router(None, environ={"EDGEROUTE_LINKS": flow + "]"})
    assert safe_yaml("a: &x [1, 2]\nb: *x\n", "ok.yaml") == {"a": [1, 2], "b": [1, 2]}  # ordinary aliases


@pytest.mark.parametrize("bad_path", ["x" * 300, "a\x00b", "/" + "d/" * 3000 + "f"], ids=["long", "nul", "deep"])
def test_a_path_the_system_refuses_is_a_config_mistake_not_a_traceback(tmp_path: Path, bad_path: str) -> None:
    """`Path.is_file()` raises for a name past the system's limit (an OSError traceback from a router
    whose config named such a CA file); every file a config names is checked without raising."""
    router = tmp_path / "router.yaml"
    router.write_text(yaml.safe_dump({"node_tls": {"ca_file": bad_path}}))
    with pytest.raises(ConfigError, match="no such file"):
        load_router(router, environ={})
    node = tmp_path / "node.yaml"
    node.write_text(yaml.safe_dump({"node_id": "n", "model_repository": bad_path}))
    with pytest.raises(ConfigError, match="not a directory"):
        load_node(str(node), environ={})
    quick = (README.parent / "scenarios" / "quickstart.yaml").read_text()
    scenario = quick.replace("\npolicies:", f"\nmodels:\n  mine: {{path: {json.dumps(bad_path)}}}\npolicies:")
    with pytest.raises(ConfigError, match="no such file"):
        parse_scenario(scenario, "s.yaml", tmp_path)


def test_config_files_are_read_within_a_bound(tmp_path: Path) -> None:
    """A path to a device or a huge file is refused after 4 MiB, not read to the end of memory."""
    path = tmp_path / "router.yaml"
    path.write_text("port: 8000\n" + "#" * (4 << 20))
    with pytest.raises(ConfigError, match="larger than 4,194,304 bytes"):
        load_router(path, environ={})
    with pytest.raises(ConfigError, match="larger than"):
        load_router("/dev/zero", environ={})
    secret = tmp_path / "token"
    secret.write_bytes(b"t" * ((4 << 20) + 1))
    with pytest.raises(ConfigError, match="EDGEROUTE_NODE_ADMIN_TOKEN_FILE.*larger than"):
        load_router(None, environ={"EDGEROUTE_NODE_ADMIN_TOKEN_FILE": str(secret)})
    with pytest.raises(ConfigError, match="not valid YAML: nested too deeply"):
        parse_scenario("[" * 50_000 + "]" * 50_000, "deep.yaml")


def test_yaml_syntax_error_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("port: 8000\npolicy: {preset: p2c\n")
    with pytest.raises(ConfigError, match=r"router.yaml \(line \d\): not valid YAML"):
        load_router(path, environ={})


def test_node_model_must_be_in_the_zoo(tmp_path: Path) -> None:
    path = tmp_path / "node.yaml"
    path.write_text("node_id: n1\nmodels:\n  - {name: sensor_mlp}\n  - {name: nosuch}\n")
    with pytest.raises(ConfigError, match=r"node.yaml: models.1 \(line 4\): name 'nosuch' is not a zoo model"):
        load_node(str(path), environ={})
    path.write_text("node_id: n1\nmodels:\n  - {name: cls-a, zoo: nosuch}\n")
    with pytest.raises(ConfigError, match=r"zoo 'nosuch' is not a zoo model"):
        load_node(str(path), environ={})


# ---- the environment -------------------------------------------------------------------------


def test_environment_sets_top_level_and_nested_fields(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("port: 8000\noutlier: {consecutive: 5, base_ms: 500}\n")
    env = {
        "EDGEROUTE_PORT": "9001",
        "EDGEROUTE_KAFKA": "kafka.svc:9092",
        "EDGEROUTE_OUTLIER__CONSECUTIVE": "3",
        "EDGEROUTE_POLICY": "{preset: least_outstanding}",
        "EDGEROUTE_TELEMETRY_KEYS": "a:" + "x" * 32 + ",b:" + "y" * 32,
        "EDGEROUTE_UNRELATED": "ignored",
        "OTHER": "ignored",
    }
    cfg = load_router(path, environ=env)
    assert cfg.port == 9001 and cfg.kafka == "kafka.svc:9092"
    assert cfg.outlier.consecutive == 3 and cfg.outlier.base_ms == 500  # the file's sibling kept
    assert cfg.policy.preset == "least_outstanding"
    assert cfg.telemetry_keys is not None and len(cfg.telemetry_keys) == 2


def test_environment_without_a_file(tmp_path: Path) -> None:
    environ = {"EDGEROUTE_PORT": "7000", "EDGEROUTE_HOST": "0.0.0.0", "EDGEROUTE_ALLOW_ANONYMOUS": "true"}
    cfg = load_router(None, environ=environ)
    assert (cfg.host, cfg.port) == ("0.0.0.0", 7000)


def test_secret_from_a_file(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("{ops: s3cret-token-value, cams: other-token}\n")
    key = tmp_path / "key"
    key.write_text("fleet:" + "k" * 32 + "\n")
    cfg = load_router(
        None,
        environ={
            "EDGEROUTE_AUTH__TOKENS_FILE": str(tokens),
            "EDGEROUTE_AUTH__ADMIN_CLIENTS": "[ops]",
            "EDGEROUTE_TELEMETRY_KEY_FILE": str(key),
        },
    )
    assert cfg.auth is not None and cfg.auth.tokens == {"ops": "s3cret-token-value", "cams": "other-token"}
    assert cfg.auth.admin_clients == ["ops"]
    assert cfg.telemetry_key is not None and cfg.telemetry_key.startswith("fleet:")
    with pytest.raises(ConfigError, match=r"\$EDGEROUTE_AUTH__TOKENS_FILE: cannot read"):
        load_router(None, environ={"EDGEROUTE_AUTH__TOKENS_FILE": str(tmp_path / "missing")})


def test_node_settings_from_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "node.yaml"
    path.write_text("node_id: from-file\nmodels: [{name: echo}]\n")
    cfg: NodeConfig = load_node(
        str(path),
        environ={"EDGEROUTE_NODE_ID": "pod-7", "EDGEROUTE_ENDPOINT": "http://10.1.2.3:8001", "EDGEROUTE_SLOTS": "4"},
    )
    assert (cfg.node_id, cfg.endpoint, cfg.slots) == ("pod-7", "http://10.1.2.3:8001", 4)


def test_a_bad_environment_value_names_its_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"port \(from \$EDGEROUTE_PORT\): .*integer"):
        load_router(None, environ={"EDGEROUTE_PORT": "eighty"})
    with pytest.raises(ConfigError, match=r"outlier.nosuch \(from \$EDGEROUTE_OUTLIER__NOSUCH\)"):
        load_router(None, environ={"EDGEROUTE_OUTLIER__NOSUCH": "1"})


def test_overlay_only_touches_fields_of_the_model() -> None:
    raw, sources = env_overlay({"port": 1}, NodeConfig, {"EDGEROUTE_TRACEBACK": "1", "EDGEROUTE_PORT": "2"})
    assert raw == {"port": "2"} and sources == {("port",): "EDGEROUTE_PORT"}


# ---- the command lines ------------------------------------------------------------------------


def _one_line_exit(capsys: pytest.CaptureFixture[str], code: int | None, expect: str) -> None:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and expect in err, err


def test_router_cli_mistakes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "router.yaml"
    bad.write_text("port: 8000\nmax_attempts: 99\n")
    _one_line_exit(capsys, router_main(["--config", str(bad)]), "router.yaml: max_attempts (line 2)")
    _one_line_exit(capsys, router_main(["--policy", "nosuch", "--kafka", "x:1"]), "unknown preset 'nosuch'")
    with pytest.raises(SystemExit) as info:
        router_main(["--log-level", "verbose"])
    err = capsys.readouterr().err.strip().splitlines()  # argparse: the usage, then one line
    assert info.value.code == 2 and "'verbose' is not a log level" in err[-1] and "Traceback" not in err


def test_command_line_overrides_are_checked_as_the_config_files_values(capsys: pytest.CaptureFixture[str]) -> None:
    """`--port 70000` was bound as port 4464 (70000 mod 65536), `--port -1` was a traceback, and a router
    id or bootstrap of any text was taken: overrides now get the checks the file's values get."""
    node_cfg = '{"node_id": "n", "models": [{"name": "echo"}]}'
    _one_line_exit(capsys, router_main(["--kafka", "h:1", "--port", "70000"]), "port: Input should be less than")
    _one_line_exit(capsys, router_main(["--kafka", "h:1", "--port", "-1"]), "port: Input should be greater than")
    _one_line_exit(capsys, router_main(["--kafka", "h:99999"]), "kafka: Value error, not HOST:PORT")
    _one_line_exit(capsys, router_main(["--kafka", "h:1", "--router-id", "../etc"]), "router_id: String should match")
    _one_line_exit(capsys, node_main(["--config", node_cfg, "--port", "70000"]), "port: Input should be less than")
    _one_line_exit(capsys, node_main(["--config", node_cfg, "--kafka", "a b:1"]), "kafka: Value error, not HOST:PORT")


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("kafka:9092", True),
        ("a:9092, b:9093", True),
        ("[::1]:9092", True),
        ("10.0.0.1:1", True),
        ("kafka", False),
        ("kafka:0", False),
        ("kafka:65536", False),
        ("kafka:", False),
        (":9092", False),
        ("a b:1", False),
        ("h/x:1", False),
        ("::1:9092", False),
        ("", False),
        (",".join(["h:1"] * 65), False),
        ("h:\u0663", False),  # a digit, but not an ASCII one
    ],
)
def test_bootstrap_lists(text: str, ok: bool) -> None:
    from telemetry.process.settings import check_bootstrap

    if ok:
        assert check_bootstrap(text) == text
        assert parse_config({"kafka": text}).kafka == text
    else:
        with pytest.raises(ValueError):
            check_bootstrap(text)
        with pytest.raises(ConfigError, match="kafka"):
            parse_config({"kafka": text})


def test_node_cli_mistakes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _one_line_exit(capsys, node_main(["--config", str(tmp_path / "missing.yaml")]), "missing.yaml: cannot read")
    _one_line_exit(capsys, node_main(["--config", '{"node_id": "n"}']), "models")
    _one_line_exit(capsys, node_main(["--config", "{not json"]), "not valid JSON")


def test_a_live_stack_starts_no_more_node_processes_than_the_machine_holds(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each live node is a process of about 100-150 MB: a simulator-sized topology (`bench sim` uses
    1,000 nodes) replayed live by mistake would exhaust the machine. Refused before anything starts."""
    from scenarios.stack.nodeconfig import NODE_PROCESS_MB, live_node_limit

    limit, why = live_node_limit()
    assert limit >= 4 and ("MB available" in why or why == "memory unknown")
    if "MB available" in why:
        assert limit == max(4, int(why.split(" MB")[0].replace(",", "")) // NODE_PROCESS_MB)
    monkeypatch.setenv("EDGEROUTE_MAX_LIVE_NODES", "2")
    assert live_node_limit() == (2, "EDGEROUTE_MAX_LIVE_NODES")
    needle = "quickstart: 5 live nodes is more than this machine holds (EDGEROUTE_MAX_LIVE_NODES: 2 at most)"
    _one_line_exit(capsys, cli_main(["replay", "quickstart"]), needle)
    _one_line_exit(capsys, cli_main(["up"]), needle)


def test_edgeroute_cli_mistakes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _one_line_exit(capsys, cli_main(["zoo", "nosuch_model"]), "no model 'nosuch_model'")
    _one_line_exit(capsys, cli_main(["replay", str(tmp_path / "nosuch.yaml")]), "no such scenario file")
    _one_line_exit(capsys, cli_main(["bench", "decide", "--nodes", "0"]), "--nodes must be at least 1")
    _one_line_exit(capsys, cli_main(["profile", "nosuch"]), "no zoo model 'nosuch'")


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["replay", "quickstart", "--mode", "sim", "--duration", "-1"], "argument --duration: must be above 0"),
        (["replay", "quickstart", "--mode", "sim", "--duration", "nan"], "argument --duration: not a finite number"),
        (["replay", "quickstart", "--mode", "sim", "--duration", "1e12"], "argument --duration: at most 3600 seconds"),
        (["sweep", "quickstart", "--duration", "abc"], "argument --duration: not a number"),
        (["sweep", "quickstart", "--target", "0"], "argument --target: must be above 0 and at most 1"),
        (["search", "camera-pipeline", "--workflow", "cam-a", "--rate", "inf"], "argument --rate: not a finite"),
        (["search", "camera-pipeline", "--workflow", "cam-a", "--target", "nan"], "argument --target: not a finite"),
        (["bench", "ingest", "--seconds", "-1"], "argument --seconds: must be above 0"),
        (["bench", "ingest", "--interval-ms", "inf"], "argument --interval-ms: not a finite number"),
        (["up", "--port", "70000"], "argument --port: a port is 0 (any free one) to 65535"),
        (["up", "--routers", "0"], "argument --routers: must be at least 1"),
        (["profile", "echo", "--requests", "-3"], "argument --requests: must be at least 1"),
        (["replay", "quickstart", "--nodes", "100000000"], "argument --nodes: at most 10,000 nodes"),
        (["replay", "quickstart", "--router", "notaurl"], "argument --router: not an http(s)://HOST[:PORT] URL"),
        (["replay", "quickstart", "--router", "http://h:99999"], "argument --router: not an http(s)://HOST[:PORT]"),
    ],
)
def test_number_arguments_out_of_range_are_usage_errors(
    args: list[str], expect: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A duration, share or rate that is not a finite number in its range is refused before anything
    runs (a duration of 1e12 s made the report's per-second series exhaust memory; 0, negative or NaN
    ran nothing and reported zeros)."""
    with pytest.raises(SystemExit) as info:
        cli_main(args)
    err = capsys.readouterr().err.strip().splitlines()  # argparse: the usage, then one line
    assert info.value.code == 2 and expect in err[-1] and not any("Traceback" in line for line in err), err


def test_sizes_past_what_the_machine_or_a_scenario_holds_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Each of these ran until the machine gave out (100 routers, 100,000,000 seeds or node counts)."""
    _one_line_exit(capsys, cli_main(["up", "--routers", "100000"]), "--routers 100000: 1 to ")
    _one_line_exit(capsys, cli_main(["sweep", "quickstart", "--nodes", "1-100000000"]), "256 counts at most")
    _one_line_exit(capsys, cli_main(["sweep", "quickstart", "--seeds", "100000000"]), "--seeds must be 1 to 100")
    _one_line_exit(capsys, cli_main(["bench", "sim", "--nodes", "20000"]), "at most 10,000 nodes")
    _one_line_exit(capsys, cli_main(["bench", "sim", "--requests", "100000000"]), "10,000,000 requests")


def test_a_replay_is_planned_within_a_workloads_bounds() -> None:
    from scenarios.replay.common import plan as _plan
    from scenarios.spec.schema import load_scenario

    scenario = load_scenario("quickstart")
    for bad in (0.0, -1.0, float("nan"), 1e12):
        with pytest.raises(ValueError, match="at most 3600 seconds"):
            _plan(scenario, bad)
    assert _plan(scenario, 2.0)[0] == 2.0


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from telemetry.process.version import __version__

    for main in (cli_main, router_main, node_main):
        with pytest.raises(SystemExit) as info:
            main(["--version"])
        assert info.value.code == 0
        assert capsys.readouterr().out.strip() == f"edgeroute {__version__}"


def test_kafka_security_for_stacks_and_replays(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from scenarios.stack.launcher import PASS_ENV
    from telemetry.process.tls import kafka_options, set_kafka_security

    assert "EDGEROUTE_KAFKA_SECURITY" in PASS_ENV, "a stack's nodes and routers get the same settings"
    # and the same Kafka client choice (make test's second pass runs whole stacks on kafka-python)
    assert {"EDGEROUTE_KAFKA_CLIENT", "EDGEROUTE_KAFKA_READER"} <= PASS_ENV
    sasl = (
        "{security_protocol: SASL_PLAINTEXT, sasl_mechanism: SCRAM-SHA-256, sasl_plain_username: u, "
        "sasl_plain_password: p}"
    )
    monkeypatch.setenv("EDGEROUTE_KAFKA_SECURITY", sasl)
    try:
        assert cli_main(["report", "/nonexistent"]) == 2  # any command: the settings apply first
        capsys.readouterr()
        assert kafka_options()["sasl_mechanism"] == "SCRAM-SHA-256"
        # a node or router reads the same variable as its kafka_security setting
        cfg = load_router(None, environ={"EDGEROUTE_KAFKA_SECURITY": sasl})
        assert cfg.kafka_security is not None and cfg.kafka_security.sasl_plain_username == "u"
        monkeypatch.setenv("EDGEROUTE_KAFKA_SECURITY", "{security_protocol: SASL_SSL}")
        _one_line_exit(capsys, cli_main(["report", "/nonexistent"]), "needs sasl_mechanism")
    finally:
        set_kafka_security(None)
