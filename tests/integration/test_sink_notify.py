"""The notify sink: readable messages through Apprise's own json:// and form:// targets to real local
receivers, retry and dead letters like any sink, URL checks for each documented service that never echo
a token, and templates that cannot be hijacked by what a record carries."""
from __future__ import annotations

import logging
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest

from forwarder.agent.config import parse_config
from forwarder.common.retry import Backoff
from forwarder.delivery.dispatcher import Dispatcher
from forwarder.emulator import Emulator
from forwarder.errors import ConfigError
from forwarder.sinkapi import Ok, Record, Reject, Retry, SinkContext
from forwarder.store.database import Store
from sinks.notify import NotifySink
from tests.agent import ROOT, AgentProcess, dead_letters, wait_until, write_config
from tests.peers.http_peer import HttpPeer, Response

FAST = Backoff(initial=0.01, maximum=0.05)


def iso(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def event_record(n: int, change: str = "scheduled", *, event_type: str = "Reboot", minutes: float = 4,
                 description: str = "Virtual machine is going to be restarted.", **data: Any) -> Record:
    not_before = datetime.now(timezone.utc) + timedelta(minutes=minutes, seconds=20)
    body = {
        "EventId": f"EVT-{n}", "EventType": event_type, "ResourceType": "VirtualMachine", "Resources": ["web-1"],
        "EventStatus": "Scheduled", "NotBefore": iso(not_before), "Description": description,
        "EventSource": "Platform", "DurationInSeconds": -1, "AffectsThisVm": True,
        "Vm": {"Name": "web-1", "VmId": "abc"}, **data,
    }
    return Record.from_dict({"specversion": "1.0", "id": f"rec-{n}-{change}", "source": "/subscriptions/s/vm/web-1",
                             "type": f"scheduledevent.{change}", "subject": f"EVT-{n}", "time": iso(datetime.now(timezone.utc)),
                             "data": body})


def target(peer: HttpPeer, path: str, scheme: str = "json") -> str:
    return f"{scheme}://{peer.url.split('://', 1)[1].rstrip('/')}{path}"


def make(tmp_path: Path, urls: list[str], **options: Any) -> NotifySink:
    return NotifySink({"urls": urls, "timeout": "5s", **options}, SinkContext(name="people", state_dir=tmp_path))


@pytest.fixture
def peer():
    with HttpPeer() as p:
        yield p


# -- what people read -------------------------------------------------------------------------------

def test_json_and_form_targets_get_a_short_readable_message(peer, tmp_path):
    sink = make(tmp_path, [target(peer, "/chat"), target(peer, "/mail", "form")])
    record = event_record(1)
    assert sink.send([record]) == Ok()
    chat, mail = sorted(peer.wait_for(2), key=lambda r: r.path)
    message = chat.json()
    assert message["title"] == "Reboot of web-1 scheduled in 4 min"
    assert message["type"] == "warning"
    when = record.to_dict()["data"]["NotBefore"][:19].replace("T", " ")
    body = message["message"]
    assert f"Reboot of web-1 is scheduled for {when} UTC (in 4 min): the VM restarts" in body
    assert "What to do: take the VM out of rotation" in body and "sefwd approve EVT-1" in body
    form = parse_qs(mail.body.decode())
    assert form["title"] == [message["title"]] and form["message"] == [body]


def test_each_change_reads_in_its_own_words_and_endings_carry_outcome_and_evidence(peer, tmp_path):
    sink = make(tmp_path, [target(peer, "/chat")])
    batch = [
        event_record(2, "started", event_type="Freeze", EventStatus="Started", DurationInSeconds=9),
        event_record(3, "updated", event_type="Preempt", ChangedFields=["NotBefore"]),
        event_record(4, "completed", Outcome="completed", Evidence={"Used": ["seen_started", "rebooted"]}),
        event_record(5, "canceled", event_type="Redeploy", Outcome="canceled",
                     Evidence={"Used": ["gone_before_notbefore", "no_approval"]}),
        event_record(6, "ended", event_type="Terminate", Outcome="unknown", Evidence={"Used": []}),
    ]
    assert sink.send(batch) == Ok()
    got = [r.json() for r in peer.wait_for(5)]
    assert [m["title"] for m in got] == [
        "Freeze of web-1 started", "Spot eviction of web-1 changed", "Reboot of web-1 completed",
        "Redeploy of web-1 canceled", "Deletion of web-1 ended (outcome unknown)"]
    assert "Expected impact: about 9 s" in got[0]["message"]
    assert "changed: NotBefore" in got[1]["message"] and "(in 4 min)" in got[1]["message"]
    assert "Evidence: seen Started, the VM rebooted." in got[2]["message"] and got[2]["type"] == "success"
    assert "Evidence: gone well before NotBefore, not approved." in got[3]["message"]
    assert "cannot tell whether it ran" in got[4]["message"]


def test_templates_override_title_and_body_per_kind(peer, tmp_path):
    templates = {"default": {"title": "[{{ vm }}] {{ kind }}"},
                 "scheduled": {"body": "{{ what }} {{ when_relative }}; default was: {{ event_id }}"}}
    sink = make(tmp_path, [target(peer, "/chat")], templates=templates)
    assert sink.send([event_record(7), event_record(8, "completed", Outcome="completed")]) == Ok()
    first, second = (r.json() for r in peer.wait_for(2))
    assert first["title"] == "[web-1] scheduled" and first["message"] == "Reboot in 4 min; default was: EVT-7"
    assert second["title"] == "[web-1] completed" and second["message"].startswith("Reboot of web-1 completed.")


@pytest.mark.parametrize("fmt, expected", [
    ("text", "<img src=x onerror=alert(1)> {{ 7*7 }} {% if 1 %}x{% endif %}"),
    ("markdown", "&lt;img src=x onerror=alert(1)&gt; {{ 7*7 }} {% if 1 %}x{% endif %}"),
    ("html", "&lt;img src=x onerror=alert(1)&gt; {{ 7*7 }} {% if 1 %}x{% endif %}"),
])
def test_a_record_field_holding_template_code_or_html_is_inert(peer, tmp_path, fmt, expected):
    hostile = "<img src=x onerror=alert(1)> {{ 7*7 }} {% if 1 %}x{% endif %}"
    sink = make(tmp_path, [target(peer, "/chat")], format=fmt,
                templates={"scheduled": {"title": "{{ data.Description }}", "body": "{{ data.Description }}"}})
    assert sink.send([event_record(9, description=hostile)]) == Ok()
    message = peer.wait_for(1)[0].json()
    assert message["title"] == expected
    assert "49" not in message["message"] and "{{ 7*7 }}" in message["message"]


def test_a_template_reaching_for_python_internals_falls_back_to_the_built_in_message(peer, tmp_path):
    sink = make(tmp_path, [target(peer, "/chat")],
                templates={"scheduled": {"body": "{{ record.__class__.__mro__[1].__subclasses__() }}"}})
    assert sink.send([event_record(10)]) == Ok()
    body = peer.wait_for(1)[0].json()["message"]
    assert "subclasses" not in body and "class" not in body
    assert body.startswith("Reboot of web-1 is scheduled for")


# -- retry, dead letters, no duplicates ----------------------------------------------------------

def test_5xx_and_429_are_retried_other_4xx_rejected_and_a_dead_target_retried(peer, tmp_path):
    sink = make(tmp_path, [target(peer, "/chat")])
    peer.queue(Response(503), Response(429, {"Retry-After": "1"}), Response(400, body=b"no such channel"))
    assert sink.send([event_record(11)]) == Retry(reason="http_503")
    assert sink.send([event_record(11)]) == Retry(reason="http_429")
    rejected = sink.send([event_record(11)])
    assert isinstance(rejected, Reject) and rejected.reason == "http_400"
    assert rejected.detail == "target 1 (JSON) answered HTTP 400"
    down = make(tmp_path, ["json://127.0.0.1:1/x"], timeout="2s")
    assert down.send([event_record(12)]) == Retry(reason="connection_error")


def test_a_target_that_took_a_message_does_not_get_it_again_when_another_fails(peer, tmp_path):
    sink = make(tmp_path, [target(peer, "/a"), target(peer, "/b")])
    peer.queue(Response(200), path="/a")
    peer.queue(Response(502), Response(200), path="/b")
    record = event_record(13)
    assert sink.send([record]) == Retry(reason="http_502")
    assert sink.send([record]) == Ok()
    assert [r.path for r in peer.wait_for(3)] == ["/a", "/b", "/b"]


def test_progress_of_records_never_retried_is_forgotten_oldest_first(peer, tmp_path, monkeypatch):
    # A long run must not keep every record a retry ever touched (one that was dead-lettered or evicted
    # instead is never sent again): the sink remembers at most MAX_REMEMBERED, the oldest go first.
    monkeypatch.setattr("sinks.notify.MAX_REMEMBERED", 3)
    sink = make(tmp_path, [target(peer, "/a"), target(peer, "/b")])
    peer.queue(*[Response(502)] * 5, path="/b")
    records = [event_record(20 + n) for n in range(5)]
    for record in records:
        assert sink.send([record]) == Retry(reason="http_502")  # /a took it, /b did not
    peer.wait_for(10)
    assert sink.send([records[-1]]) == Ok()  # remembered: only /b gets it again
    assert sink.send([records[0]]) == Ok()  # forgotten: /a gets it a second time (at least once, as always)
    paths = [(r.path, r.json()["message"].split("EVT-")[-1][:2]) for r in peer.wait_for(13)]
    assert paths[10:] == [("/b", "24"), ("/a", "20"), ("/b", "20")]


def test_a_closed_sink_takes_its_tokens_off_the_redaction_list(peer, tmp_path):
    from sinks.notify import _HIDE

    first = make(tmp_path, [target(peer, "/hooks/FIRSTSECRET11")])
    second = make(tmp_path, [target(peer, "/hooks/SECONDSECRET22")])
    assert {"FIRSTSECRET11", "SECONDSECRET22"} <= _HIDE.secrets
    first.close()
    assert "FIRSTSECRET11" not in _HIDE.secrets and "SECONDSECRET22" in _HIDE.secrets
    second.close()
    assert "SECONDSECRET22" not in _HIDE.secrets


def test_through_the_dispatcher_retries_then_delivers_in_order_and_dead_letters_a_refused_one(peer, tmp_path):
    sink = make(tmp_path, [target(peer, "/chat")])
    peer.queue(Response(503), Response(200), Response(404, body=b"channel gone"), Response(200))
    store = Store.open(tmp_path / "state", fsync=False)
    dispatcher = Dispatcher(store, {"people": sink}, backoff=FAST)
    dispatcher.start()
    try:
        store.commit([event_record(14), event_record(15), event_record(16)])
        wait_until(lambda: dispatcher.workers["people"].cursor == store.next_index, 30, "the cursor past all three records")
    finally:
        dispatcher.close(5)
    titles = [r.json()["title"] for r in peer.wait_for(4)]
    assert len(titles) == 4 and all(t == "Reboot of web-1 scheduled in 4 min" for t in titles)
    (dead,) = store.dead_letters("people")
    assert dead.reason == "http_404" and dead.record.id == "rec-15-scheduled"
    assert dispatcher.snapshot()["sinks"]["people"]["retries"] >= 1
    store.close()


def test_the_agent_notifies_from_the_emulator_retries_and_dead_letters(peer, tmp_path):
    with Emulator(vms=["web-1"]) as emu:
        peer.queue(Response(500), Response(200), Response(410))
        url_file = tmp_path / "urls"
        url_file.write_text(f"# the team channel\n{target(peer, '/hooks/T0KEN5ECRET99')}\n")
        sinks = (f'[[sinks]]\ntype = "file"\nname = "file"\npath = "{tmp_path / "out.jsonl"}"\n'
                 f'[[sinks]]\ntype = "notify"\nname = "people"\nurls_file = "{url_file}"\n')
        config = write_config(tmp_path / "config.toml", emu.url, tmp_path / "state", sinks=sinks,
                              extra='[delivery]\nretry_initial = "100ms"\nretry_max = "300ms"\n')
        agent = AgentProcess(config, tmp_path / "agent.log")
        try:
            first = emu.schedule(type="Reboot", resources=["web-1"], start_after=600)
            wait_until(lambda: len(peer.requests) >= 2, 30, "the first message, after one 500")
            second = emu.schedule(type="Freeze", resources=["web-1"], start_after=600)
            wait_until(lambda: dead_letters(config, "people"), 30, "the 410 in dead letters")
            assert agent.terminate() == 0
        finally:
            if agent.alive():
                agent.kill()
    delivered = peer.requests[1].json()
    assert delivered["title"].startswith("Reboot of web-1 scheduled") and first in delivered["message"]
    (dead,) = dead_letters(config, "people")
    assert dead["reason"] == "http_410" and dead["record"]["subject"] == second
    assert "T0KEN5ECRET99" not in agent.logs() and "T0KEN5ECRET99" not in str(dead)
    # What was left at SIGTERM (the agent's own "stopped" notice) went out in the drain: the sink's stop is
    # the end of delivery, not the agent's stop (it used to refuse every send and wait out drain_timeout).
    assert "not delivered before shutdown" not in agent.logs()
    assert len(peer.requests) == 4 and "stopped" in peer.requests[3].json()["title"].lower(), peer.requests[3].json()


# -- URLs: one per documented service, checked without echoing a token ---------------------------

VALID = {
    "slack": "slack://T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7FQ",
    "teams workflows": "workflows://prod-01.westus.logic.azure.com:443/7e0d1a2b3c4d5e6f7a8b9c0d1e2f3a4b/SiGnAtUrE0123456789",
    "teams workflows (https)": ("https://prod-01.westus.logic.azure.com:443/workflows/643e69f83c8944438d68119179a10a64/"
                                "triggers/manual/paths/invoke?api-version=2016-06-01&sp=%2Ftriggers%2Fmanual%2Frun"
                                "&sv=1.0&sig=KODuebWbDGYFr0z0eu6Rj8aUKz7108W3wrNJZxFE5A"),
    "pagerduty": "pagerduty://a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6@0123456789abcdefABCD",
    "opsgenie": "opsgenie://0123456789abcdef0123456789abcdef",
    "discord": "discord://123456789012345678/AbCdEfghIJklmnoPQRstuVWXyz0123456789",
    "e-mail": "mailtos://alerts:Pa55wordSecret@smtp.example.com?to=oncall@example.com",
}
INVALID = {
    "slack (a token missing)": ("slack://T1JJ3T3L2/SECRETTOKENB", "SECRETTOKENB", "slack://"),
    "teams connector (retired)": ("msteams://team/SECRETTOKENA/SECRETTOKENB/SECRETTOKENC", "SECRETTOKENA", "Workflows"),
    "workflows (no signature)": ("workflows://prod-01.westus.logic.azure.com/SECRETWORKFLOW", "SECRETWORKFLOW", "workflows://"),
    "pagerduty (no integration key)": ("pagerduty://@SECRETAPIKEY99", "SECRETAPIKEY99", "pagerduty://"),
    "opsgenie (bad key)": ("opsgenie://SECRET KEY", "SECRET", "whitespace"),
    "discord (no token)": ("discord://SECRETWEBHOOKID", "SECRETWEBHOOKID", "discord://"),
    "e-mail (no host)": ("mailtos://alerts:SECRETPASSWORD@", "SECRETPASSWORD", "mailtos://"),
    "unknown scheme": ("sluck://SECRETTOKENX/Y/Z", "SECRETTOKENX", "unknown Apprise scheme 'sluck'"),
    "tls checks off": (VALID["slack"] + "?verify=no", "TIiajkdnlazkcOXrIdevi7FQ", "verify=no"),
    "plain http elsewhere": ("json://hooks.example.com/SECRETPATH", "SECRETPATH", "plain http"),
}


# One scheme of each Apprise family that has a plain (no TLS) variant: with a non-loopback host each is
# refused unless insecure_http = true, and its TLS variant or a loopback host is accepted. Decided by the
# plugin's own ``secure`` flag, not by a list of schemes (the review found gotify:// passing and its token
# crossing the network in clear text).
PLAIN_FAMILIES = {
    "gotify": ("gotify://10.20.30.40/SECRETGOTIFYTOK", "gotifys://"),
    "ntfy": ("ntfy://SECRETUSER:SECRETPASS@10.20.30.40/topic", "ntfys://"),
    "mattermost": ("mmost://10.20.30.40/SECRETMATTERMOSTTOKEN0123", "mmosts://"),
    "rocket.chat": ("rocket://SECRETUSER:SECRETPASS@10.20.30.40/room", "rockets://"),
    "apprise api": ("apprise://10.20.30.40/SECRETAPPRISEKEY", "apprises://"),
    "matrix": ("matrix://SECRETUSER:SECRETPASS@10.20.30.40/#room", "matrixs://"),
    "signal api": ("signal://10.20.30.40/+12345678901", "signals://"),
    "json": ("json://hooks.example.com/SECRETPATH", "jsons://"),
    "form": ("form://hooks.example.com/SECRETPATH", "forms://"),
    "xml": ("xml://hooks.example.com/SECRETPATH", "xmls://"),
    "e-mail without tls": ("mailto://alerts:SECRETPASSWORD@example.com?smtp=smtp.example.com", "mailtos://"),
}


@pytest.mark.parametrize("family", sorted(PLAIN_FAMILIES))
def test_plain_http_to_the_network_is_refused_by_the_plugins_own_tls_flag(family):
    url, secure = PLAIN_FAMILIES[family]
    (problem,) = _check([url])
    assert "plain http (no TLS)" in problem and f"use {secure}" in problem and "SECRET" not in problem, problem
    assert _check([url], insecure_http=True) == []  # the operator's explicit choice
    tls = secure + url.partition("://")[2]
    assert _check([tls]) == [], tls
    loopback = url.replace("10.20.30.40", "127.0.0.1").replace("hooks.example.com", "[::1]").replace(
        "@example.com?smtp=smtp.example.com", "@localhost")
    assert _check([loopback]) == [], loopback


def test_targets_without_a_plain_variant_are_not_refused():
    """A plugin with no plain protocol reaches only its service's HTTPS endpoint; no host: its default one."""
    for url in (VALID["slack"], VALID["discord"], "ntfy://topic", "pagerduty://integration@SECRETAPIKEY99"):
        assert _check([url]) == [], url


def _check(urls: list[str], **options: Any) -> list[str]:
    data = {"sinks": [{"type": "notify", "name": "people", "urls": urls, **options}],
            "state": {"dir": "/tmp/unused-sefwd-state"}}
    try:
        parse_config(data, {}, "test.toml")
    except ConfigError as exc:
        return exc.problems
    return []


@pytest.mark.parametrize("service", sorted(VALID))
def test_config_check_accepts_each_documented_service(service):
    assert _check([VALID[service]]) == []


@pytest.mark.parametrize("case", sorted(INVALID))
def test_config_check_rejects_a_bad_url_clearly_without_echoing_its_secret(case):
    url, secret, hint = INVALID[case]
    problems = _check([VALID["discord"], url])
    assert len(problems) == 1, problems
    assert problems[0].startswith("sinks[0] (people): urls[1]") and hint in problems[0]
    assert secret not in problems[0]


def test_config_check_lists_every_problem_at_once_and_show_hides_the_urls(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(
        '[[sinks]]\ntype = "notify"\nname = "people"\nformat = "rtf"\n'
        f'urls = ["{VALID["slack"]}", "discord://SECRETWEBHOOKID"]\n'
        'templates = { scheduled = { body = "{{ what " }, weekly = { title = "x" } }\n'
        'filter = { changes = ["sheduled"] }\n')
    done = subprocess.run([sys.executable, "-m", "forwarder", "config", "check", "--config", str(config)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    for fragment in ("option 'format' must be one of text, markdown, html", "urls[1] (discord://...)",
                     "templates.scheduled.body': template error", "unknown kind 'weekly'",
                     "filter.changes: unknown name 'sheduled' (did you mean 'scheduled'?)"):
        assert fragment in out
    assert "SECRETWEBHOOKID" not in out and "TIiajkdnlazkcOXrIdevi7FQ" not in out
    config.write_text(f'[[sinks]]\ntype = "notify"\nname = "people"\nurls = ["{VALID["slack"]}"]\n')
    done = subprocess.run([sys.executable, "-m", "forwarder", "config", "check", "--config", str(config)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TIiajkdnlazkcOXrIdevi7FQ" not in done.stdout + done.stderr
    assert "filter: record_types=approval,forwarder.data_lost,forwarder.stopped,protect,scheduledevent" in done.stdout


def test_urls_from_an_environment_variable_or_a_file(peer, tmp_path, monkeypatch):
    monkeypatch.setenv("SEFWD_TEST_NOTIFY_URLS", f"{target(peer, '/one')}\n{target(peer, '/two', 'form')}")
    from_env = NotifySink({"urls_env": "SEFWD_TEST_NOTIFY_URLS"}, SinkContext(name="p", state_dir=tmp_path))
    assert from_env.send([event_record(20)]) == Ok()
    assert sorted(r.path for r in peer.wait_for(2)) == ["/one", "/two"]
    assert "set only one of urls, urls_env" in NotifySink.check({"urls": [], "urls_env": "X"})[0]
    assert NotifySink.check({"urls_env": "SEFWD_TEST_NOTIFY_UNSET"}) == [
        "environment variable SEFWD_TEST_NOTIFY_UNSET (from urls_env) is not set"]
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n")
    assert NotifySink.check({"urls_file": str(empty)}) == ["no Apprise URL given (the list, variable or file is empty)"]


def test_secrets_in_urls_never_reach_logs_or_dead_letters(peer, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    url = target(peer, "/hooks/PATHSECRET77?+X-Token=HEADERSECRET88").replace("json://", "json://user:PASSSECRET66@")
    sink = make(tmp_path, [url])
    peer.queue(Response(401, body=b"bad token"))
    result = sink.send([event_record(21)])
    assert isinstance(result, Reject) and result.reason == "http_401"
    request = peer.wait_for(1)[0]
    assert request.path == "/hooks/PATHSECRET77" and request.header("x-token") == "HEADERSECRET88"
    # Apprise's own lines quote URLs: the sink keeps them out of the agent's log (pytest attaches to them anyway).
    assert logging.getLogger("apprise").propagate is False
    text = "\n".join(r.getMessage() for r in caplog.records if not r.name.startswith("apprise")) + result.detail
    for secret in ("PATHSECRET77", "HEADERSECRET88", "PASSSECRET66"):
        assert secret not in text
    assert "target 1 (JSON)" in text


def test_a_missing_extra_is_a_config_problem_naming_it():
    script = ("import sys; sys.modules['apprise'] = None\n"
              "from sinks.notify import NotifySink\n"
              "print(NotifySink.check({'urls': ['slack://a/b/c']}))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "the notify sink needs apprise; install it with: pip install 'scheduled-events-forwarder[notify]'" in done.stdout



def test_a_target_that_does_not_answer_in_time_is_retried(peer, tmp_path):
    sink = make(tmp_path, [target(peer, "/slow")], timeout="1s")
    peer.queue(Response(hang=True))
    try:
        assert sink.send([event_record(30)]) == Retry(reason="timeout")
    finally:
        peer.release()


def test_approvals_and_agent_trouble_read_as_such(peer, tmp_path):
    sink = make(tmp_path, [target(peer, "/chat")])
    vm = {"Name": "web-1"}
    refused = Record.from_dict({"id": "a1", "type": "approval.refused", "time": iso(datetime.now(timezone.utc)),
                                "data": {"EventId": "EVT-31", "Outcome": "refused", "Actor": "callback",
                                         "Reason": "bad_signature", "Detail": "signature does not match", "Vm": vm}})
    lost = Record.from_dict({"id": "f1", "type": "forwarder.data_lost", "time": "2026-11-26T01:02:03.000Z",
                             "data": {"Reason": "store_damaged", "Detail": "state.db set aside", "Vm": vm}})
    assert sink.send([refused, lost]) == Ok()
    first, second = (r.json() for r in peer.wait_for(2))
    assert first["title"] == "Approval refused for EVT-31 on web-1" and first["type"] == "failure"
    assert first["message"] == "callback: refused (bad_signature).\nsignature does not match"
    assert second["title"] == "sefwd on web-1: data lost" and second["type"] == "failure"
    assert "2026-11-26 01:02:03 UTC" in second["message"] and "Reason: store_damaged" in second["message"]
