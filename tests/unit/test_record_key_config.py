"""[agent] record_key_env / record_key_file: this VM's record key, from a secret place only."""
from __future__ import annotations

import pytest

from forwarder.agent.config import describe, parse_config
from forwarder.common.signing import generate_secret, parse_secret
from forwarder.errors import ConfigError


def test_the_record_key_comes_from_an_env_var_or_a_file_and_is_never_shown(tmp_path):
    secret = generate_secret()
    by_env = parse_config({"agent": {"record_key_env": "VM_KEY"}}, {"VM_KEY": secret}, "built-in defaults")
    assert by_env.agent.record_key == parse_secret(secret) and secret not in repr(by_env)
    key_file = tmp_path / "record.key"
    key_file.write_text(secret + "\n")
    by_file = parse_config({}, {"SEFWD_AGENT_RECORD_KEY_FILE": str(key_file)}, "built-in defaults")
    assert by_file.agent.record_key == parse_secret(secret)
    assert parse_config({}, {}, "built-in defaults").agent.record_key is None  # off by default
    # `sefwd config check` says which it is, never the key.
    assert "records authenticated (sefwdauth)" in describe(by_env) and secret not in describe(by_env)
    assert "records not authenticated" in describe(parse_config({}, {}, "built-in defaults"))


def test_every_record_key_problem_is_listed():
    with pytest.raises(ConfigError) as info:
        parse_config({"agent": {"record_key_env": "NOT_SET", "record_key_file": "/nonexistent"}}, {}, "built-in defaults")
    assert any("exclusive" in p for p in info.value.problems)
    with pytest.raises(ConfigError) as info:
        parse_config({"agent": {"record_key_env": "VM_KEY"}}, {"VM_KEY": "whsec_c2hvcnQ="}, "built-in defaults")
    (problem,) = info.value.problems
    assert problem.startswith("[agent]") and "too short" in problem and "c2hvcnQ" not in problem
