"""The [approval] config table: every problem kind, the seed-sample rules, callback secrets."""
from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import pytest
import trustme

from forwarder.approval.config import parse_approval
from forwarder.approval.policy import SEED_SAMPLE_RULES
from forwarder.approval.settings import ApprovalConfig, CallbackSettings, HookSpec, Rule
from forwarder.common.compat import tomllib
from forwarder.common.signing import generate_secret, parse_secret
from tests.conftest import FIXTURES
from forwarder.agent.config_example import shipped as _shipped_example

EXAMPLE_CONFIG = _shipped_example()  # forwarder/agent/example-config.toml, what `sefwd config example` prints

SEED_SAMPLE_TOML = (FIXTURES / "seed-sample-policy.toml").read_text()
SECRET_A, SECRET_B = generate_secret(), generate_secret()


def ok(raw: dict[str, Any], env: dict[str, str] | None = None, base_dir: Path | None = None) -> ApprovalConfig:
    config, problems = parse_approval(raw, env or {}, base_dir)
    assert problems == []
    return config


def problems_of(raw: Any, env: dict[str, str] | None = None, base_dir: Path | None = None) -> list[str]:
    config, problems = parse_approval(raw, env or {}, base_dir)
    assert problems, "expected problems"
    assert config == ApprovalConfig()  # an invalid section never half-applies
    return problems


def one_problem(raw: Any, env: dict[str, str] | None = None, base_dir: Path | None = None) -> str:
    problems = problems_of(raw, env, base_dir)
    assert len(problems) == 1, problems
    return problems[0]


def callback(**fields: Any) -> dict[str, Any]:
    return {"callback": {"listen": "127.0.0.1:8787", "secret_env": "CB_SECRET", **fields}}


CB_ENV = {"CB_SECRET": SECRET_A}


# -- defaults, flat keys, env ----------------------------------------------------------------------

def test_empty_table_gives_the_safe_defaults() -> None:
    config = ok({})
    assert config == ApprovalConfig()
    assert (config.scope, config.rules, config.hooks, config.callback) == ("self_or_leader", (), {}, None)
    assert (config.hook_timeout, config.hook_output_limit) == (300.0, 4096)


def test_flat_keys_parse() -> None:
    config = ok({"scope": "Leader", "hook_timeout": "90s", "hook_output_limit": "1KiB"})
    assert (config.scope, config.hook_timeout, config.hook_output_limit) == ("leader", 90.0, 1024)


def test_env_overrides_the_flat_keys() -> None:
    env = {"SEFWD_APPROVAL_SCOPE": "any", "SEFWD_APPROVAL_HOOK_TIMEOUT": "10s",
           "SEFWD_APPROVAL_HOOK_OUTPUT_LIMIT": "", "SEFWD_EVENT_ID": "not ours"}
    config = ok({"scope": "self", "hook_output_limit": 100}, env)
    assert (config.scope, config.hook_timeout, config.hook_output_limit) == ("any", 10.0, 100)


def test_env_problems_name_the_variable() -> None:
    problems = problems_of({}, {"SEFWD_APPROVAL_SCOPE": "all", "SEFWD_APPROVAL_HOOK_TIMOUT": "1s"})
    assert len(problems) == 2
    scope, = [p for p in problems if "SCOPE" in p]
    timeout, = [p for p in problems if "TIMOUT" in p]
    assert scope.startswith("environment SEFWD_APPROVAL_SCOPE: must be one of self, leader, any, self_or_leader")
    assert timeout.startswith("unknown environment variable SEFWD_APPROVAL_HOOK_TIMOUT")
    assert "did you mean 'SEFWD_APPROVAL_HOOK_TIMEOUT'" in timeout


def test_the_callback_secret_variable_may_carry_the_approval_prefix() -> None:
    env = {"SEFWD_APPROVAL_SECRET": SECRET_A}
    config = ok(callback(secret_env="SEFWD_APPROVAL_SECRET"), env)
    assert config.callback is not None and config.callback.keys == (parse_secret(SECRET_A),)


# -- every problem kind ------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, expected", [
    ({"scop": "self"}, "unknown key approval.scop (did you mean 'scope'?)"),
    ({"scope": "selff"}, "approval.scope: must be one of self, leader, any, self_or_leader, got 'selff' (did you mean 'self'?)"),
    ({"scope": 1}, "approval.scope: expected a string, got 1"),
    ({"hook_timeout": "0s"}, "approval.hook_timeout: must be greater than 0s"),
    ({"hook_timeout": "2d"}, "approval.hook_timeout: must be at most 1d"),
    ({"hook_timeout": True}, "approval.hook_timeout: expected a duration"),
    ({"hook_output_limit": "2MiB"}, "approval.hook_output_limit: must be between 0B and 1MiB"),
    ({"hook_output_limit": "lots"}, "approval.hook_output_limit: expected a size"),
    ({"rules": {"action": "approve"}}, "approval.rules must be an array of tables"),
    ({"rules": ["approve"]}, "approval.rules[0] must be a table"),
    ({"rules": [{"event_type": "Freeze"}]}, "approval.rules[0]: missing 'action'"),
    ({"rules": [{"action": "aprove"}]}, "approval.rules[0].action: must be one of approve, hold, ignore, got 'aprove' (did you mean 'approve'?)"),
    ({"rules": [{"action": "hold", "even_type": "Freeze"}]}, "unknown key approval.rules[0].even_type (did you mean 'event_type'?)"),
    ({"rules": [{"action": "hold", "event_type": 5}]}, "approval.rules[0].event_type: expected a string or a non-empty list of strings, got 5"),
    ({"rules": [{"action": "hold", "event_type": []}]}, "approval.rules[0].event_type: expected a string or a non-empty list"),
    ({"rules": [{"action": "hold", "event_source": ["User", ""]}]}, "approval.rules[0].event_source: expected non-empty strings, got ''"),
    ({"rules": [{"action": "hold", "event_type": "freeze"}]}, "approval.rules[0].event_type: IMDS values are case-sensitive: 'freeze' never matches; write 'Freeze'"),
    ({"rules": [{"action": "hold", "event_status": "started"}]}, "approval.rules[0].event_status: IMDS values are case-sensitive"),
    ({"rules": [{"action": "hold", "duration_min": "5"}]}, "approval.rules[0].duration_min: expected an integer, got '5'"),
    ({"rules": [{"action": "hold", "duration_max": True}]}, "approval.rules[0].duration_max: expected an integer, got True"),
    ({"rules": [{"action": "hold", "duration_max": 8.5}]}, "approval.rules[0].duration_max: expected an integer"),
    ({"rules": [{"action": "hold", "duration_min": 9, "duration_max": 8}]}, "approval.rules[0].duration_min: 9 is greater than duration_max 8"),
    ({"rules": [{"action": "hold", "resources_min": -1}]}, "approval.rules[0].resources_min: must be an integer from 0 to 10000, got -1"),
    ({"rules": [{"action": "hold", "resources_min": 3, "resources_max": 2}]}, "approval.rules[0].resources_min: 3 is greater than resources_max 2"),
    ({"rules": [{"action": "hold", "affects_this_vm": "maybe"}]}, "approval.rules[0].affects_this_vm: expected true or false, got 'maybe'"),
    ({"rules": [{"action": "hold", "description": "Live (Migration"}]}, "approval.rules[0].description: invalid regular expression 'Live (Migration'"),
    ({"rules": [{"action": "hold", "description": 3}]}, "approval.rules[0].description: expected a regular expression string"),
    ({"rules": [{"action": "hold", "name": ""}]}, "approval.rules[0].name: expected a non-empty string"),
    ({"rules": [{"action": "hold", "delay": "5s"}]}, "approval.rules[0].delay: only allowed with action = \"approve\" (this rule says 'hold')"),
    ({"rules": [{"action": "ignore", "after_hooks": False}]}, "approval.rules[0].after_hooks: only allowed with action = \"approve\""),
    ({"rules": [{"action": "approve", "delay": "soon"}]}, "approval.rules[0].delay: expected a duration"),
    ({"rules": [{"action": "approve", "after_hooks": 1}]}, "approval.rules[0].after_hooks: expected true or false"),
    ({"rules": [{"action": "approve", "after_hooks": True}]}, "approval.rules[0].after_hooks: true, but [approval.hooks] configures no command"),
    ({"rules": [{"action": "hold", "name": "a"}, {"action": "ignore", "name": "a"}]}, "approval.rules[1].name: duplicate rule name 'a' (also rules[0])"),
    ({"hooks": ["drain.sh"]}, "approval.hooks must be a table"),
    ({"hooks": {"schedule": "drain.sh"}}, "unknown change kind approval.hooks.schedule (did you mean 'scheduled'?)"),
    ({"hooks": {"scheduled": ""}}, "approval.hooks.scheduled: the command must not be empty"),
    ({"hooks": {"scheduled": []}}, "approval.hooks.scheduled: expected a command string"),
    ({"hooks": {"scheduled": ["drain.sh", 5]}}, "approval.hooks.scheduled: expected a command string"),
    ({"hooks": {"scheduled": ["", "x"]}}, "approval.hooks.scheduled: the program (first element) must not be empty"),
    ({"callback": "127.0.0.1:8787"}, "approval.callback must be a table"),
    ({"callback": {"secret_env": "CB_SECRET"}}, "approval.callback: missing 'listen'"),
    (callback(listen="127.0.0.1"), "approval.callback.listen: missing the port"),
    (callback(listen=":8787"), "approval.callback.listen: the host must be explicit"),
    (callback(listen="127.0.0.1:http"), "approval.callback.listen: the port must be a number, got 'http'"),
    (callback(listen="127.0.0.1:65536"), "approval.callback.listen: the port must be 0-65535, got 65536"),
    (callback(listen="::1:8787"), "approval.callback.listen: write an IPv6 address in brackets"),
    (callback(listen="[127.0.0.1]:8787"), "approval.callback.listen: '127.0.0.1' in brackets is not an IPv6 address"),
    (callback(listen="[::1]8787"), "approval.callback.listen: expected \"[ipv6]:port\""),
    (callback(listen="bad host:80"), "approval.callback.listen: 'bad host' is not an IP address or host name"),
    (callback(listen=8787), "approval.callback.listen: expected \"host:port\""),
    (callback(lisen="x"), "unknown key approval.callback.lisen (did you mean 'listen'?)"),
    (callback(max_body="100B"), "approval.callback.max_body: must be between 256B and 1MiB"),
    (callback(max_body="2MiB"), "approval.callback.max_body: must be between 256B and 1MiB"),
    (callback(rate_limit=0), "approval.callback.rate_limit: must be an integer from 1 to 10000, got 0"),
    (callback(rate_limit="30"), "approval.callback.rate_limit: expected an integer"),
    (callback(client_timeout="0s"), "approval.callback.client_timeout: must be greater than 0s"),
    (callback(client_timeout="10m"), "approval.callback.client_timeout: must be at most 5m"),
    (callback(tolerance="500ms"), "approval.callback.tolerance: must be at least 1s"),
    (callback(tolerance="2h"), "approval.callback.tolerance: must be at most 1h"),
    (callback(secret_env=None), "approval.callback: a secret is required: set secret_env"),
    (callback(secret_file="/x"), "approval.callback: secret_env and secret_file are exclusive"),
    (callback(secret_env="MISSING_VAR"), "approval.callback.secret_env: environment variable 'MISSING_VAR' is not set"),
    (callback(secret_env=""), "approval.callback.secret_env: must name an environment variable"),
    (callback(tls_cert=__file__), "approval.callback.tls_key: required with tls_cert (set both or neither)"),
])
def test_each_problem_names_its_key(raw: dict[str, Any], expected: str) -> None:
    problem = one_problem(raw, CB_ENV)
    assert problem.startswith(expected), problem


def test_a_lone_tls_key_needs_a_cert() -> None:
    assert one_problem(callback(tls_key=__file__), CB_ENV) == \
        "approval.callback.tls_cert: required with tls_key (set both or neither)"


def test_a_non_table_section() -> None:
    assert one_problem("self").startswith("approval must be a table")


def test_several_problems_are_reported_together() -> None:
    problems = problems_of({
        "scope": "everyone",
        "hooks": {"scheduled": "drain.sh", "finished": "undrain.sh"},
        "rules": [
            {"action": "approve", "event_type": "Freeze"},
            {"action": "hold", "duration_min": 5, "duration_max": 1, "description": "(", "colour": "red"},
            {"name": "late", "action": "approve", "delay": -1},
        ],
        "callback": {"listen": "localhost:99999", "secret_env": "NOPE", "tls_cert": "/nonexistent/c.pem"},
    })
    text = "\n".join(problems)
    for expected in (
        "approval.scope:", "approval.hooks.finished", "approval.rules[1].duration_min:",
        "approval.rules[1].description:", "approval.rules[1].colour", "approval.rules[2].delay:",
        "approval.callback.listen: the port must be 0-65535", "approval.callback.secret_env:",
        "approval.callback.tls_key: required with tls_cert", "approval.callback.tls_cert: cannot read",
    ):
        assert expected in text, expected
    assert len(problems) == 10, problems


# -- rules ------------------------------------------------------------------------------------------

def test_seed_sample_config_parses_into_the_seed_sample_rules() -> None:
    config = ok(tomllib.loads(SEED_SAMPLE_TOML)["approval"])
    assert config.rules == SEED_SAMPLE_RULES


def test_rule_fields_parse() -> None:
    config = ok({
        "hooks": {"scheduled": ["/usr/local/bin/drain.sh", "--graceful"], "completed": "/usr/local/bin/undrain.sh"},
        "rules": [
            {"name": " every-field ", "event_type": ["Reboot", "Redeploy"], "event_source": "User",
             "event_status": ["Scheduled"], "duration_min": -1, "duration_max": 8, "affects_this_vm": True,
             "resources_min": 1, "resources_max": 1, "description": "Live Migration", "action": "approve",
             "delay": "30s", "after_hooks": True},
            {"action": "hold"},
            {"event_type": "Hibernate", "action": "ignore"},  # future types pass
        ],
    })
    assert config.hooks == {"scheduled": HookSpec(("/usr/local/bin/drain.sh", "--graceful")),
                            "completed": HookSpec("/usr/local/bin/undrain.sh")}
    first, second, third = config.rules
    assert first == Rule(
        name="every-field", action="approve", event_type=("Reboot", "Redeploy"), event_source=("User",),
        event_status=("Scheduled",), duration_min=-1, duration_max=8, affects_this_vm=True, resources_min=1,
        resources_max=1, description=re.compile("Live Migration"), delay=30.0, after_hooks=True,
    )
    assert second == Rule(name="rules[1]", action="hold")
    assert third.event_type == ("Hibernate",)


def test_problems_in_a_rule_keep_counting_rules_by_position() -> None:
    problems = problems_of({"rules": [{"action": "hold"}, {"action": "nope"}, {"action": "hold", "duration_min": "x"}]})
    assert [p.split(":")[0] for p in problems] == ["approval.rules[1].action", "approval.rules[2].duration_min"]


# -- callback ---------------------------------------------------------------------------------------

def test_callback_with_defaults() -> None:
    config = ok(callback(), CB_ENV)
    assert config.callback == CallbackSettings(host="127.0.0.1", port=8787, keys=(parse_secret(SECRET_A),))
    assert (config.callback.max_body, config.callback.rate_limit) == (16 * 1024, 30)
    assert (config.callback.client_timeout, config.callback.tolerance) == (5.0, 300.0)


def test_tls_files_that_do_not_load_are_refused(tmp_path: Path) -> None:
    ca = trustme.CA()
    first, second = ca.issue_cert("127.0.0.1"), ca.issue_cert("127.0.0.1")
    first.cert_chain_pems[0].write_to_path(str(tmp_path / "a.crt"))
    second.private_key_pem.write_to_path(str(tmp_path / "b.key"))
    (tmp_path / "junk.crt").write_text("not a certificate")
    for cert, key in (("a.crt", "b.key"), ("junk.crt", "b.key")):
        problem = one_problem(callback(tls_cert=cert, tls_key=key), CB_ENV, base_dir=tmp_path)
        assert problem.startswith("approval.callback.tls_cert: cannot load") and "PEM" in problem
        assert "PRIVATE KEY" not in problem


def test_callback_every_key(tmp_path: Path) -> None:
    cert = trustme.CA().issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    cert.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    config = ok(callback(listen="[::1]:0", tls_cert="tls.crt", tls_key=str(tmp_path / "tls.key"), max_body="1KiB",
                         rate_limit=5, client_timeout="2s", tolerance="1m"), CB_ENV, base_dir=tmp_path)
    cb = config.callback
    assert cb is not None
    assert (cb.host, cb.port, cb.tls_cert, cb.tls_key) == ("::1", 0, tmp_path / "tls.crt", tmp_path / "tls.key")
    assert (cb.max_body, cb.rate_limit, cb.client_timeout, cb.tolerance) == (1024, 5, 2.0, 60.0)


def test_tls_files_must_be_readable_files(tmp_path: Path) -> None:
    (tmp_path / "tls.crt").write_text("cert")
    problems = problems_of(callback(tls_cert="tls.crt", tls_key="missing.key"), CB_ENV, base_dir=tmp_path)
    assert problems == [f"approval.callback.tls_key: cannot read {str(tmp_path / 'missing.key')!r}: No such file or directory"]
    problem = one_problem(callback(tls_cert=str(tmp_path), tls_key="tls.crt"), CB_ENV, base_dir=tmp_path)
    assert problem == f"approval.callback.tls_cert: {str(tmp_path)!r} is a directory"


def test_secret_from_a_file_relative_to_the_config(tmp_path: Path) -> None:
    (tmp_path / "callback.secret").write_text(SECRET_B + "\n")
    config = ok(callback(secret_env=None, secret_file="callback.secret"), base_dir=tmp_path)
    assert config.callback is not None and config.callback.keys == (parse_secret(SECRET_B),)


def test_rotation_keys_from_env_and_file(tmp_path: Path) -> None:
    config = ok(callback(), {"CB_SECRET": f"  {SECRET_A} {SECRET_B}\n"})
    assert config.callback is not None
    assert config.callback.keys == (parse_secret(SECRET_A), parse_secret(SECRET_B))
    (tmp_path / "keys").write_text(f"{SECRET_B}\n{SECRET_A}\n")
    config = ok(callback(secret_env=None, secret_file=str(tmp_path / "keys")))
    assert config.callback is not None
    assert config.callback.keys == (parse_secret(SECRET_B), parse_secret(SECRET_A))


@pytest.mark.parametrize("value, expected", [
    ("", "environment variable 'CB_SECRET' is empty"),
    ("not-a-secret", "environment variable 'CB_SECRET': secret must start with 'whsec_'"),
    (f"{SECRET_A} whsec_" + base64.b64encode(b"short").decode(), "(secret 2 of 2): secret is too short"),
    (f"whsec_!!!! {SECRET_A}", "(secret 1 of 2): secret after 'whsec_' is not valid base64"),
], ids=["empty", "no-prefix", "second-too-short", "first-not-base64"])  # ids without the random secret: xdist workers must agree
def test_bad_secrets_are_named_without_showing_them(value: str, expected: str) -> None:
    problem = one_problem(callback(), {"CB_SECRET": value})
    assert problem.startswith("approval.callback.secret_env: ") and expected in problem, problem
    assert SECRET_A not in problem and SECRET_A[6:] not in problem


def test_unreadable_secret_file(tmp_path: Path) -> None:
    problem = one_problem(callback(secret_env=None, secret_file="nope.secret"), base_dir=tmp_path)
    assert problem.startswith("approval.callback.secret_file: cannot read") and "nope.secret" in problem


# -- the example config --------------------------------------------------------------------------------

def test_the_commented_example_parses_once_uncommented(tmp_path: Path) -> None:
    """Uncommenting the example's [approval] tables gives the seed-sample rules, hooks and a callback."""
    section = EXAMPLE_CONFIG[EXAMPLE_CONFIG.index("[approval]"):]
    lines = []
    for line in section.splitlines():
        if re.match(r"^# (\[.*\]|[a-z_]+ = .*)$", line):
            line = line[2:]
        lines.append(line)
    cert = trustme.CA().issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    cert.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    text = "\n".join(lines).replace("/etc/sefwd/", f"{tmp_path}/")
    raw = tomllib.loads(text)["approval"]
    assert set(raw) == {"scope", "dry_run", "hook_timeout", "hook_output_limit", "deadline_margin", "workers", "hook_env",
                        "hooks", "rules", "callback"}
    config = ok(raw, {"SEFWD_CALLBACK_SECRET": SECRET_A})
    assert config.rules == SEED_SAMPLE_RULES
    # Per-change hooks are for notifications now ([protect] drains and undoes: test_protect_config).
    assert config.hooks == {"scheduled": HookSpec(("/usr/local/bin/tell-the-team.sh",),
                                                  event_types=("Reboot", "Redeploy", "Preempt")),
                            "completed": HookSpec("/usr/local/bin/tell-the-team.sh", affects_this_vm=False)}
    assert config.hook_env == () and config.deadline_margin == 5.0 and not config.dry_run and config.workers == 8
    assert config.callback == CallbackSettings(host="127.0.0.1", port=8787, keys=(parse_secret(SECRET_A),),
                                               tls_cert=tmp_path / "tls.crt", tls_key=tmp_path / "tls.key")
