"""`sefwd config example` is generated from the parser's definitions and loads with the real parser."""
from __future__ import annotations

import re

from forwarder.agent.config import SECTIONS, parse_config
from forwarder.agent.config_example import SINK_ORDER, render, shipped
from forwarder.common.compat import tomllib
from forwarder.delivery.filters import parse_filter
from forwarder.sinkapi import load_sink_factory


def test_shipped_example_is_what_the_generator_makes_now():
    # On failure: python -m forwarder.agent.config_example > forwarder/agent/example-config.toml
    assert shipped() == render(), "forwarder/agent/example-config.toml is stale: regenerate it (see the comment)"


def test_example_loads_with_the_real_parser_and_passes_config_check():
    config = parse_config(tomllib.loads(shipped()), {}, "/etc/sefwd/config.toml", check_sinks=True)
    assert [s.type for s in config.sinks] == ["stdout", "file"]  # the others are commented out


def test_every_key_of_every_section_and_built_in_sink_appears_with_its_env_rule():
    text = shipped()
    for section, keys in SECTIONS.items():
        assert f"SEFWD_{section.upper()}_<KEY>" in text, section
        for key in keys:
            assert re.search(rf"^(# )?{key} = ", text, re.M), (section, key)
    assert "SEFWD_APPROVAL_<KEY>" in text
    for type_name in SINK_ORDER:
        assert re.search(rf'^(# )?type = "{type_name}"$', text, re.M), type_name
        for option in load_sink_factory(type_name).OPTIONS:
            assert re.search(rf"^(# )?{option} = ", text, re.M), (type_name, option)


def test_each_commented_sink_passes_its_own_check_once_uncommented():
    """The commented sinks are examples a person can uncomment: each one's options are valid keys."""
    text = shipped()
    blocks = re.findall(r"^# \[\[sinks\]\]\n((?:# .*\n)+)", text, re.M)
    assert len(blocks) == len(SINK_ORDER) - 2
    for block in blocks:
        lines = [line[2:] for line in block.splitlines() if not line.startswith("# #")]
        entry = tomllib.loads("\n".join(lines))
        cls = load_sink_factory(entry.pop("type"))
        entry.pop("name")
        if "filter" in entry:
            assert parse_filter(entry.pop("filter"), "example")[1] == []
        assert set(entry) == set(cls.OPTIONS)
