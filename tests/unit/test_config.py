"""Config loading: precedence, env overrides, validation problems, example and describe."""
from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest

from forwarder import sinkapi
from forwarder.approval.config import APPROVAL_KEYS, CALLBACK_KEYS, RULE_KEYS
from forwarder.approval.settings import CHANGE_KINDS, ApprovalConfig
from forwarder.agent.config import (
    SECTIONS,
    SUPPORTED_API_VERSIONS,
    Config,
    SinkConfig,
    default_config,
    default_state_dir,
    describe,
    load_config,
    parse_config,
)
from forwarder.common.compat import tomllib
from forwarder.errors import ConfigError
from forwarder.imds.client import ImdsClient
from forwarder.agent.config_example import shipped as _shipped_example

EXAMPLE_CONFIG = _shipped_example()  # forwarder/agent/example-config.toml, what `sefwd config example` prints

HAVE_STDOUT_SINK = importlib.util.find_spec("sinks.stdout") is not None
HAVE_FILE_SINK = importlib.util.find_spec("sinks.file") is not None


class RecordingSink:
    """A third-party-style sink: only its check() matters here."""

    OPTIONS: ClassVar[dict[str, str]] = {"level": "an integer from 1 to 3"}
    seen: ClassVar[list[Mapping[str, Any]]] = []

    @classmethod
    def check(cls, options: Mapping[str, Any]) -> list[str]:
        cls.seen.append(dict(options))
        level = options.get("level", 1)
        return [] if level in (1, 2, 3) else [f"option 'level' must be 1, 2 or 3, got {level!r}"]


class ExplodingSink:
    OPTIONS: ClassVar[dict[str, str]] = {}

    @classmethod
    def check(cls, options: Mapping[str, Any]) -> list[str]:
        raise RuntimeError("boom")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register this module's sinks (and one whose SDK is missing) as sink types."""
    monkeypatch.setitem(sinkapi.BUILTIN_SINKS, "recording", f"{__name__}:RecordingSink")
    monkeypatch.setitem(sinkapi.BUILTIN_SINKS, "exploding", f"{__name__}:ExplodingSink")
    monkeypatch.setitem(sinkapi.BUILTIN_SINKS, "eventhubs", "sefwd_missing_sdk_for_test.eventhubs:EventHubsSink")
    monkeypatch.setitem(sinkapi.BUILTIN_SINKS, "custom", "sefwd_missing_module_for_test:Sink")
    RecordingSink.seen.clear()


def problems_of(data: Mapping[str, Any], env: Mapping[str, str] | None = None, **kw: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, env or {}, "/etc/sefwd/test.toml", **kw)
    return info.value.problems


def parse(data: Mapping[str, Any], env: Mapping[str, str] | None = None, **kw: Any) -> Config:
    kw.setdefault("check_sinks", False)
    return parse_config(data, env or {}, "/etc/sefwd/test.toml", **kw)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# -- defaults and precedence ---------------------------------------------------------------------

def test_default_config_values() -> None:
    config = default_config()
    assert config.source == "built-in defaults"
    assert config.imds.endpoint == "http://169.254.169.254"
    assert config.imds.api_version == "auto"
    assert config.imds.poll_interval == 1.0
    assert config.imds.timeout == 5.0
    assert config.imds.first_call_timeout == 150.0
    assert config.imds.compute_api_version == "2021-02-01"
    assert config.imds.compute_refresh == 3600.0
    assert config.agent.heartbeat == 300.0
    assert config.agent.log_level == "info"
    assert config.agent.drain_timeout == 10.0
    assert config.sinks == (SinkConfig(type="stdout", name="stdout", options={}),)
    assert config.state.dir == default_state_dir({})


def test_no_file_anywhere_gives_defaults(tmp_path: Path) -> None:
    config = load_config(None, env={}, system_path=tmp_path / "absent.toml")
    assert config == default_config()
    assert load_config(None, env={}, system_path=None) == default_config()


def test_precedence_explicit_then_env_then_system(tmp_path: Path) -> None:
    system = write(tmp_path / "system.toml", '[agent]\nlog_level = "error"\n')
    from_env = write(tmp_path / "env.toml", '[agent]\nlog_level = "warning"\n')
    explicit = write(tmp_path / "explicit.toml", '[agent]\nlog_level = "debug"\n')
    env = {"SEFWD_CONFIG": str(from_env)}

    config = load_config(explicit, env=env, system_path=system, check_sinks=False)
    assert (config.agent.log_level, config.source) == ("debug", str(explicit))
    config = load_config(None, env=env, system_path=system, check_sinks=False)
    assert (config.agent.log_level, config.source) == ("warning", str(from_env))
    config = load_config(None, env={}, system_path=system, check_sinks=False)
    assert (config.agent.log_level, config.source) == ("error", str(system))
    # An empty SEFWD_CONFIG counts as unset.
    config = load_config(None, env={"SEFWD_CONFIG": ""}, system_path=system, check_sinks=False)
    assert config.source == str(system)


def test_missing_explicit_or_env_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.toml", env={}, system_path=None)
    assert "nope.toml" in info.value.problems[0] and "does not exist" in info.value.problems[0]
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"SEFWD_CONFIG": str(tmp_path / "gone.toml")}, system_path=None)
    assert "gone.toml" in info.value.problems[0] and "SEFWD_CONFIG" in info.value.problems[0]


def test_invalid_toml_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.toml", "[imds\nendpoint = \n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={}, system_path=None)
    assert "not valid TOML" in info.value.problems[0]


def test_file_values_are_parsed(tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", """
[imds]
endpoint = "http://127.0.0.1:8080/vm/web-0/"
api_version = "2019-08-01"
poll_interval = "500ms"
timeout = 2
first_call_timeout = 1.5
compute_refresh = "1d"
[agent]
heartbeat = "0"
log_level = "WARN"
drain_timeout = "2m"
""")
    config = load_config(path, env={}, system_path=None)
    # A trailing slash is dropped so the client can append /metadata/... to the prefix.
    assert config.imds.endpoint == "http://127.0.0.1:8080/vm/web-0"
    assert config.imds.api_version == "2019-08-01"
    assert config.imds.poll_interval == 0.5
    assert config.imds.timeout == 2.0
    assert config.imds.first_call_timeout == 1.5
    assert config.imds.compute_refresh == 86400.0
    assert config.agent.heartbeat == 0.0
    assert config.agent.log_level == "warning"
    assert config.agent.drain_timeout == 120.0


def test_relative_state_dir_resolves_against_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    path = write(conf_dir / "c.toml", '[state]\ndir = "state"\n')
    monkeypatch.chdir(tmp_path)
    assert load_config(path, env={}, system_path=None).state.dir == conf_dir / "state"
    # From the environment there is no file to be relative to: the working directory is used.
    config = load_config(path, env={"SEFWD_STATE_DIR": "from-env"}, system_path=None)
    assert config.state.dir == tmp_path / "from-env"


def test_sink_options_keep_relative_paths_and_exclude_type_and_name() -> None:
    config = parse({"sinks": [{"type": "file", "path": "out/events.jsonl", "backups": 2}, {"type": "stdout", "name": "tty"}]})
    assert config.sinks[0] == SinkConfig(type="file", name="file", options={"path": "out/events.jsonl", "backups": 2})
    assert config.sinks[1] == SinkConfig(type="stdout", name="tty", options={})


# -- environment overrides -------------------------------------------------------------------------

def test_env_overrides_win_over_the_file(tmp_path: Path) -> None:
    path = write(tmp_path / "c.toml", '[imds]\nendpoint = "http://10.0.0.1"\npoll_interval = "5s"\n')
    env = {
        "SEFWD_IMDS_ENDPOINT": "http://127.0.0.1:9999/vm/a",
        "SEFWD_IMDS_API_VERSION": "2017-11-01",
        "SEFWD_IMDS_POLL_INTERVAL": "750ms",
        "SEFWD_STATE_DIR": str(tmp_path / "st"),
        "SEFWD_AGENT_HEARTBEAT": "0",
        "SEFWD_AGENT_LOG_LEVEL": "debug",
    }
    config = load_config(path, env=env, system_path=None)
    assert config.imds.endpoint == "http://127.0.0.1:9999/vm/a"
    assert config.imds.api_version == "2017-11-01"
    assert config.imds.poll_interval == 0.75
    assert config.state.dir == tmp_path / "st"
    assert config.agent.heartbeat == 0.0
    assert config.agent.log_level == "debug"


def test_env_overrides_apply_without_a_file(tmp_path: Path) -> None:
    config = load_config(None, env={"SEFWD_IMDS_TIMEOUT": "7"}, system_path=None)
    assert config.imds.timeout == 7.0
    assert config.source == "built-in defaults"


def test_other_sefwd_variables_and_empty_values_are_ignored() -> None:
    env = {
        "SEFWD_EVENT_ID": "x",
        "SEFWD_METRICS_MODE": "auto",  # no such section: not an override
        "SEFWD_APPROVAL_SCOPE": "",
        "SEFWD_SOMETHING": "1",
        "SEFWD_IMDS_TIMEOUT": "",
        "PATH": "/bin",
    }
    assert parse({}, env) == parse({})


def test_env_problems_name_the_variable() -> None:
    problems = problems_of({}, {
        "SEFWD_IMDS_POLL_INTERVAL": "10ms",
        "SEFWD_IMDS_POLL_INTERVALL": "1s",
        "SEFWD_AGENT_LOG_LEVEL": "loud",
    })
    assert len(problems) == 3
    text = "\n".join(problems)
    assert "environment SEFWD_IMDS_POLL_INTERVAL: must be at least 500ms" in text
    assert "unknown environment variable SEFWD_IMDS_POLL_INTERVALL" in text
    assert "did you mean 'SEFWD_IMDS_POLL_INTERVAL'" in text
    assert "environment SEFWD_AGENT_LOG_LEVEL" in text


def test_file_problems_name_the_key() -> None:
    (problem,) = problems_of({"imds": {"poll_interval": "10ms"}})
    assert problem.startswith("imds.poll_interval: must be at least 500ms")


# -- every problem kind ------------------------------------------------------------------------------

def test_unknown_section_and_top_level_key() -> None:
    problems = problems_of({"imsd": {"endpoint": "http://x"}, "poll_interval": "1s", "zzz": 3})
    assert "unknown section [imsd] (did you mean 'imds'?)" in problems
    assert "unknown top-level key 'poll_interval' (did you mean 'imds.poll_interval'?)" in problems
    assert "unknown top-level key 'zzz'" in problems


def test_approval_section_is_parsed_and_its_problems_join_the_others() -> None:
    config = parse({"approval": {"scope": "self", "rules": [{"event_source": "User", "action": "approve"}]}},
                   {"SEFWD_APPROVAL_HOOK_TIMEOUT": "30s"})
    assert config.approval.scope == "self" and config.approval.hook_timeout == 30.0
    assert [(r.name, r.action, r.event_source) for r in config.approval.rules] == [("rules[0]", "approve", ("User",))]
    assert "approval: scope self, 1 rule(s) (rules[0]), hooks: none, callback: off" in describe(config)
    problems = problems_of({"imds": {"timeout": "0"}, "approval": {"scope": "everyone", "rules": [{"action": "go"}]}},
                           {"SEFWD_APPROVAL_SCOPES": "any"})
    assert len(problems) == 4, problems
    assert any(p.startswith("approval.scope: must be one of") for p in problems)
    assert any(p.startswith("approval.rules[0].action: must be one of") for p in problems)
    assert any("SEFWD_APPROVAL_SCOPES" in p and "did you mean 'SEFWD_APPROVAL_SCOPE'" in p for p in problems)


def test_unknown_key_suggests_a_close_match() -> None:
    (problem,) = problems_of({"imds": {"pol_interval": "1s"}})
    assert problem == "unknown key imds.pol_interval (did you mean 'poll_interval'?)"


def test_section_must_be_a_table() -> None:
    (problem,) = problems_of({"agent": "info"})
    assert problem.startswith("agent must be a table")


@pytest.mark.parametrize("data, expected", [
    ({"imds": {"endpoint": 5}}, "imds.endpoint: expected a string, got 5"),
    ({"imds": {"api_version": 20200701}}, "imds.api_version: expected a string"),
    ({"agent": {"log_level": True}}, "agent.log_level: expected a string"),
    ({"state": {"dir": ["a"]}}, "state.dir: expected a string"),
    ({"imds": {"timeout": True}}, "imds.timeout: expected a duration"),
    ({"agent": {"heartbeat": [1]}}, "agent.heartbeat: expected a duration"),
])
def test_wrong_types(data: dict[str, Any], expected: str) -> None:
    (problem,) = problems_of(data)
    assert problem.startswith(expected)


@pytest.mark.parametrize("value", ["fast", "1 week", "-1s", "5x", ""])
def test_bad_durations(value: str) -> None:
    (problem,) = problems_of({"agent": {"drain_timeout": value}})
    assert problem.startswith("agent.drain_timeout: ")


@pytest.mark.parametrize("value, seconds", [("500ms", 0.5), ("0.5", 0.5), (1, 1.0), ("1h", 3600.0), ("30m", 1800.0)])
def test_poll_interval_accepted(value: Any, seconds: float) -> None:
    assert parse({"imds": {"poll_interval": value}}).imds.poll_interval == pytest.approx(seconds)


@pytest.mark.parametrize("value, words", [("499ms", "at least 500ms"), (0, "at least 500ms"), ("61m", "at most 1h"), ("2h", "at most 1h")])
def test_poll_interval_bounds(value: Any, words: str) -> None:
    (problem,) = problems_of({"imds": {"poll_interval": value}})
    assert words in problem


@pytest.mark.parametrize("key", ["timeout", "first_call_timeout", "compute_refresh"])
def test_zero_timeouts_are_rejected(key: str) -> None:
    (problem,) = problems_of({"imds": {key: "0s"}})
    assert f"imds.{key}: must be greater than" in problem


def test_unsupported_api_version_lists_the_supported() -> None:
    (problem,) = problems_of({"imds": {"api_version": "2023-01-01"}})
    assert "unsupported api-version '2023-01-01'" in problem
    assert all(v in problem for v in SUPPORTED_API_VERSIONS)


def test_every_supported_api_version_is_accepted() -> None:
    for version in SUPPORTED_API_VERSIONS:
        assert parse({"imds": {"api_version": version}}).imds.api_version == version


def test_bad_compute_api_version() -> None:
    (problem,) = problems_of({"imds": {"compute_api_version": "latest"}})
    assert problem.startswith("imds.compute_api_version:")


@pytest.mark.parametrize("endpoint", ["169.254.169.254", "ftp://host", "http://", "http://h?x=1", "http://h:99999"])
def test_bad_endpoints(endpoint: str) -> None:
    (problem,) = problems_of({"imds": {"endpoint": endpoint}})
    assert problem.startswith("imds.endpoint:")


@pytest.mark.parametrize("endpoint, base", [
    ("http://169.254.169.254", "http://169.254.169.254"),
    (" http://127.0.0.1:8080/vm/a/metadata/ ", "http://127.0.0.1:8080/vm/a"),
    ("https://[::1]:9/x/", "https://[::1]:9/x"),
])
def test_config_and_client_share_one_endpoint_rule(endpoint: str, base: str) -> None:
    # One function (imds.validate_endpoint) owns the rule: the config holds what the client uses.
    config = parse_config({"imds": {"endpoint": endpoint}}, {}, "x")
    assert config.imds.endpoint == base
    with ImdsClient.from_config(config.imds) as client:
        assert client.endpoint == base


@pytest.mark.parametrize("endpoint", ["http://h\u0085/", "http://admin:pw@h", "http://h/#x", 5])
def test_an_endpoint_the_config_refuses_the_client_refuses(endpoint: Any) -> None:
    (problem,) = problems_of({"imds": {"endpoint": endpoint}})
    assert problem.startswith("imds.endpoint:")
    with pytest.raises(ConfigError, match="imds endpoint"):
        ImdsClient(endpoint, "2020-07-01")


def test_bad_log_level() -> None:
    (problem,) = problems_of({"agent": {"log_level": "verbose"}})
    assert problem == "agent.log_level: must be one of debug, info, warning, error, got 'verbose'"


def test_empty_state_dir() -> None:
    (problem,) = problems_of({"state": {"dir": " "}})
    assert problem == "state.dir: must not be empty"


def test_duplicate_sink_names() -> None:
    (problem,) = problems_of({"sinks": [{"type": "stdout"}, {"type": "file", "name": "stdout", "path": "x"}]},
                             check_sinks=False)
    assert problem.startswith("sinks[1]: duplicate sink name 'stdout' (also sinks[0])")


def test_sink_without_type_and_other_sink_shape_problems() -> None:
    problems = problems_of({"sinks": [{"name": "a"}, {"type": 3}, "stdout", {"type": "stdout", "name": "../x"}]},
                           check_sinks=False)
    assert problems[0].startswith("sinks[0]: missing 'type'")
    assert problems[1].startswith("sinks[1]: 'type' must be a non-empty string")
    assert problems[2].startswith("sinks[2] must be a table")
    assert problems[3].startswith("sinks[3]: 'name' must be")
    assert len(problems) == 4


def test_sinks_must_be_a_non_empty_array_of_tables() -> None:
    assert problems_of({"sinks": {"type": "stdout"}})[0].startswith("sinks must be an array of tables")
    assert problems_of({"sinks": []})[0].startswith("sinks is empty")


def test_unknown_sink_type(registry: None) -> None:
    (problem,) = problems_of({"sinks": [{"type": "kafka", "name": "k"}]})
    assert problem.startswith("sinks[0] (k): unknown sink type 'kafka'")
    # Without check_sinks the registry is not consulted at all.
    assert parse({"sinks": [{"type": "kafka"}]}).sinks[0].type == "kafka"


def test_missing_sdk_names_the_pip_extra(registry: None) -> None:
    problems = problems_of({"sinks": [{"type": "eventhubs"}, {"type": "custom"}]})
    assert problems[0].startswith("sinks[0] (eventhubs): sink type 'eventhubs' cannot be loaded")
    assert problems[0].endswith("pip install 'scheduled-events-forwarder[eventhubs]'")
    assert problems[1].startswith("sinks[1] (custom): sink type 'custom' cannot be loaded")
    assert "pip install" not in problems[1]


def test_sink_check_problems_are_prefixed(registry: None) -> None:
    problems = problems_of({"sinks": [{"type": "recording", "level": 2}, {"type": "recording", "name": "r2", "level": 9}]})
    assert problems == ["sinks[1] (r2): option 'level' must be 1, 2 or 3, got 9"]
    # check() sees the options without type and name.
    assert RecordingSink.seen == [{"level": 2}, {"level": 9}]


def test_a_raising_check_is_a_problem_not_a_crash(registry: None) -> None:
    problems = problems_of({"sinks": [{"type": "exploding"}, {"type": "recording", "level": 0}]})
    assert problems[0] == "sinks[0] (exploding): checking the options failed: RuntimeError: boom"
    assert problems[1].startswith("sinks[1] (recording): option 'level'")


@pytest.mark.skipif(not HAVE_STDOUT_SINK, reason="sinks/stdout.py is not written yet")
def test_stdout_sink_check_integration() -> None:
    assert parse({"sinks": [{"type": "stdout", "pretty": True}]}, check_sinks=True).sinks[0].options == {"pretty": True}
    problems = problems_of({"sinks": [{"type": "stdout", "pretty": "yes", "colour": 1}]})
    assert any(p.startswith("sinks[0] (stdout): ") and "pretty" in p for p in problems)
    assert any(p.startswith("sinks[0] (stdout): ") and "colour" in p for p in problems)


@pytest.mark.skipif(not HAVE_FILE_SINK, reason="sinks/file.py is not written yet")
@pytest.mark.parametrize("size, ok", [("64MiB", True), ("10MB", True), (4096, True), ("64XB", False), ("lots", False)])
def test_file_sink_sizes(tmp_path: Path, size: Any, ok: bool) -> None:
    data = {"sinks": [{"type": "file", "name": "f", "path": str(tmp_path / "e.jsonl"), "max_size": size}]}
    if ok:
        assert parse(data, check_sinks=True).sinks[0].options["max_size"] == size
    else:
        (problem,) = problems_of(data)
        assert problem.startswith("sinks[0] (f): option 'max_size'")


def test_every_problem_is_reported_at_once(registry: None) -> None:
    data = {
        "imds": {"endpoint": "ftp://x", "api_version": "1999-01-01", "poll_interval": "1ms", "polling": 1},
        "agent": {"log_level": "chatty", "heartbeat": "often"},
        "bogus": {},
        "sinks": [{"type": "stdout"}, {"type": "stdout"}, {"name": "no-type"}, {"type": "nope"}],
    }
    problems = problems_of(data, {"SEFWD_AGENT_DRAIN_TIMEOUT": "soon", "SEFWD_STATE_DIRECTORY": "/x"})
    text = "\n".join(problems)
    for fragment in [
        "imds.endpoint:", "imds.api_version:", "imds.poll_interval:", "unknown key imds.polling",
        "agent.log_level:", "agent.heartbeat:", "unknown section [bogus]", "duplicate sink name",
        "sinks[2]: missing 'type'", "unknown sink type 'nope'", "environment SEFWD_AGENT_DRAIN_TIMEOUT",
        "unknown environment variable SEFWD_STATE_DIRECTORY",
    ]:
        assert fragment in text, fragment
    assert len(problems) == 12
    assert str(ConfigError(problems)).count("\n  - ") == 12


# -- default state dir -----------------------------------------------------------------------------

def test_default_state_dir_variants() -> None:
    assert default_state_dir({"HOME": "/home/u"}, is_root=True, windows=False) == Path("/var/lib/sefwd")
    assert default_state_dir({"XDG_STATE_HOME": "/xdg", "HOME": "/home/u"}, is_root=False, windows=False) == Path("/xdg/sefwd")
    assert default_state_dir({"HOME": "/home/u"}, is_root=False, windows=False) == Path("/home/u/.local/state/sefwd")
    # A relative XDG_STATE_HOME is invalid per the XDG spec and ignored.
    assert default_state_dir({"XDG_STATE_HOME": "rel", "HOME": "/home/u"}, is_root=False, windows=False) == Path(
        "/home/u/.local/state/sefwd"
    )
    windows = default_state_dir({"ProgramData": "D:\\PD"}, windows=True)
    assert str(windows).startswith("D:\\PD") and windows.name == "sefwd"


def test_default_state_dir_uses_the_injected_env_when_not_root() -> None:
    config = parse({}, {"XDG_STATE_HOME": "/xdg"})
    assert config.state.dir == default_state_dir({"XDG_STATE_HOME": "/xdg"})


# -- example and describe ------------------------------------------------------------------------------

def test_example_config_parses_and_shows_every_key() -> None:
    data = tomllib.loads(EXAMPLE_CONFIG)
    config = parse_config(data, {}, "/etc/sefwd/config.toml", check_sinks=False)
    for section, keys in SECTIONS.items():
        if section in ("telemetry", "probe"):  # off by default: shown commented out, every key still appears
            assert all(re.search(rf"^#\s*{key}\b", EXAMPLE_CONFIG, re.M) for key in keys), section
            continue
        assert set(data[section]) == set(keys), section
    # [approval]'s nested tables are shown commented out; every key still appears.
    assert config.approval == ApprovalConfig()
    for key in (*APPROVAL_KEYS, *RULE_KEYS, *CALLBACK_KEYS, *CHANGE_KINDS):
        assert re.search(rf"\b{key}\b", EXAMPLE_CONFIG), key
    # The example shows the defaults (state.dir shows the root default, the service's case).
    defaults = default_config()
    assert config.imds == defaults.imds and config.agent == defaults.agent
    assert config.state.dir == Path("/var/lib/sefwd")
    by_type = {s.type: s for s in config.sinks}
    assert by_type["stdout"].options == {"pretty": False}
    assert by_type["file"].options == {
        "path": "/var/log/sefwd/events.jsonl", "max_size": "64MiB", "backups": 5, "fsync": False,
    }


@pytest.mark.skipif(not (HAVE_STDOUT_SINK and HAVE_FILE_SINK), reason="sinks/stdout.py or sinks/file.py missing")
def test_example_sink_options_pass_the_sink_checks() -> None:
    parse_config(tomllib.loads(EXAMPLE_CONFIG), {}, "/etc/sefwd/config.toml", check_sinks=True)


def test_describe_summarises_and_redacts_secrets() -> None:
    config = parse({
        "imds": {"endpoint": "http://127.0.0.1:8080/vm/a", "poll_interval": "500ms"},
        "agent": {"heartbeat": 0},
        "sinks": [
            {"type": "stdout", "pretty": True},
            {
                "type": "webhook", "name": "hook",
                "url": "https://user:pw1@example.com/hook?code=sig123",
                "secret_env": "HOOK_SECRET_VAR", "api_key": "k-123", "password": "p-123",
                "connection_string": "Endpoint=sb://x;SharedAccessKey=s-123", "token": "t-123",
                "headers": {"Authorization": "Bearer b-123", "X-Team": "ops"},
                "batch_size": 10,
            },
        ],
    })
    text = describe(config)
    for secret in ("pw1", "sig123", "k-123", "p-123", "s-123", "t-123", "b-123"):
        assert secret not in text, secret
    # A variable's name is not a secret: it says where the secret comes from, and whether it is set.
    for shown in ("secret_env=HOOK_SECRET_VAR (not set)", "http://127.0.0.1:8080/vm/a", "500ms", "heartbeat off", "hook (type webhook)",
                  "pretty=true", "batch_size=10", 'X-Team="ops"', "example.com/hook", "/etc/sefwd/test.toml"):
        assert shown in text, shown
