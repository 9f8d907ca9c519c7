""""Protect your workload" stays true: the README's copy-paste block and the notify and filter configs of
docs/protect.md pass the real config check, and the page's sample message is what the notify sink renders."""
from __future__ import annotations

from datetime import datetime, timezone

from forwarder.agent.config import parse_config
from forwarder.common.compat import tomllib
from sinks.notify_messages import MessageRenderer
from tests.conftest import ROOT


def _section(title: str, path: str = "docs/protect.md", level: str = "##") -> str:
    text = (ROOT / path).read_text()
    return text.split(f"{level} {title}\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]


def _blocks(text: str, lang: str) -> list[str]:
    return [part.split("```", 1)[0] for part in text.split(f"```{lang}\n")[1:]]


def test_the_copy_paste_configs_pass_config_check(tmp_path, monkeypatch):
    # The sink reads urls_env from the process environment, as the service does.
    monkeypatch.setenv("SEFWD_NOTIFY_URLS", "slack://T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7FQ "
                       "workflows://prod-01.westus.logic.azure.com:443/7e0d1a2b3c4d5e6f7a8b9c0d1e2f3a4b/SiGnAtUrE0123")
    blocks = [*_blocks(_section("Tell people: the notify sink"), "toml"),
              *_blocks(_section("Send each sink only what it needs: filters"), "toml")]
    assert len(blocks) == 2
    for block in blocks:
        data = tomllib.loads(block)
        data["state"] = {"dir": str(tmp_path / "state")}
        for sink in data["sinks"]:
            if sink["type"] == "file":
                sink["path"] = str(tmp_path / "events.jsonl")
        config = parse_config(data, {}, "docs/protect.md")
        assert all(s.filter is not None for s in config.sinks if s.type != "file")


def test_the_readme_block_passes_config_check(tmp_path, monkeypatch):
    monkeypatch.setenv("SEFWD_NOTIFY_URLS", "slack://T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7FQ")
    blocks = _blocks(_section("Protect your workload", "README.md"), "toml")
    assert len(blocks) == 1, "the README keeps protection in one copy-paste block"
    data = tomllib.loads(blocks[0])
    data["state"] = {"dir": str(tmp_path / "state")}
    data["sinks"][0]["path"] = str(tmp_path / "events.jsonl")
    config = parse_config(data, {}, "README.md")
    assert config.probe is not None and config.probe.listen
    # One hold per VM (issue 28): the drain and its undo are [protect]'s, not per-change hooks.
    assert config.protect is not None and config.protect.leave is not None and not config.approval.hooks
    assert [rule.name for rule in config.approval.rules] == ["drain-then-approve"]
    assert {sink.type for sink in config.sinks} == {"file", "notify"}


def test_the_sample_message_is_what_the_sink_renders():
    sample = _blocks(_section("Tell people: the notify sink"), "")[0].strip().splitlines()
    now = datetime(2026, 11, 26, 1, 19, 0, tzinfo=timezone.utc)
    record = {"type": "scheduledevent.scheduled", "time": "2026-11-26T01:19:00Z", "data": {
        "EventId": "602d9444-...", "EventType": "Reboot", "Resources": ["web-1"], "AffectsThisVm": True,
        "NotBefore": "2026-11-26T01:23:00Z", "EventSource": "Platform", "DurationInSeconds": -1,
        "Vm": {"Name": "web-1"}}}
    message = MessageRenderer(None, clock=lambda: now).render(record)
    assert [message.title, *message.body.splitlines()] == sample
