"""``sefwd config example``, generated from the definitions the parser uses, so it cannot drift.

The flat sections and their defaults come from ``forwarder.agent.config.SECTIONS``, the environment
rule from ``forwarder.agent.config.ENV_PREFIX``, each built-in sink's keys from its ``OPTIONS``
dict, [approval]'s keys from forwarder.approval.config. This module adds only the prose and
example values; ``render()`` raises if a key has none, so a new key cannot be left out.

The result is shipped as forwarder/agent/example-config.toml (printed by ``sefwd config example``);
regenerate it with ``python -m forwarder.agent.config_example > forwarder/agent/example-config.toml``
(tests/unit/test_config_example.py fails while the two differ).
"""
from __future__ import annotations

import json
import textwrap
from collections.abc import Mapping
from typing import Any

WIDTH = 100

HEADER = """\
scheduled-events-forwarder (sefwd) configuration: every key, generated from the parser's own
definitions (sefwd config example).
|
Found at: --config FILE, else $SEFWD_CONFIG, else /etc/sefwd/config.toml, else built-in defaults
(the values below, with one stdout sink). Environment overrides win over this file: every key of
[imds], [state], [agent], [journal], [delivery], [telemetry] and [probe] as SEFWD_<SECTION>_<KEY> (e.g.
SEFWD_IMDS_ENDPOINT=http://127.0.0.1:8169/vm/web-0 points the agent at an emulator), and the flat
keys of the approval table as SEFWD_APPROVAL_<KEY>; sinks have no environment overrides (their secrets are
read from the variables or files their *_env / *_file options name). An empty variable counts as
unset. Durations: "500ms", "1s", "5m", "1h", "1d" or a number of seconds. Sizes: "64MiB", "10MB",
"4096". Check a file with: sefwd config check --config FILE"""

OPTIONAL_SECTIONS = ("telemetry", "probe")  # off unless configured: shown commented out
SECTION_DOCS: dict[str, str] = {
    "imds": "The Instance Metadata Service, polled for Scheduled Events.",
    "state": "Where the agent keeps its store.",
    "agent": "The agent itself.",
    "journal": "The store of undelivered records (state.db).",
    "delivery": "Retry policy of every sink: capped exponential backoff with full jitter.",
    "telemetry": (
        "The agent's own metrics (off unless a key below is set): polls and their latency, IMDS errors by "
        "status, detection-to-delivery latency, backlog and oldest-undelivered age, dead letters and approvals "
        "per sink/outcome. Needs: pip install 'scheduled-events-forwarder[telemetry]'."
    ),
    "probe": (
        "The maintenance probe (off unless listen or state_file is set): GET/HEAD http://HOST:PORT/maintenance "
        "answers 200 while this VM should take traffic and 503 from the moment an event of event_types "
        "affecting this VM is Scheduled (or from NotBefore - lead) until settle after it ended, for an Azure "
        "Load Balancer or Application Gateway health probe; the same state as JSON in state_file. See "
        "README \"Protect your workload\"."
    ),
}

# Per key: the comment, and an example value for keys without a default (shown commented out).
KEY_DOCS: dict[str, dict[str, tuple[str, Any]]] = {
    "imds": {
        "endpoint": ("Base URL of the Instance Metadata Service; may carry a path prefix (the emulator serves "
                     "each VM under /vm/<name>).", None),
        "api_version": ("Scheduled Events api-version: \"auto\" (2024-07-09 where IMDS serves it, which adds "
                        "SpotRebalanceRecommendation; else 2020-07-01, tried again every 6 h), or one of 2017-03-01 "
                        "2017-08-01 2017-11-01 2019-01-01 2019-04-01 2019-08-01 2020-07-01 2024-07-09. Newer versions "
                        "add fields (Description, EventSource, DurationInSeconds). See docs/api-versions.md.", None),
        "poll_interval": ("How often to poll. Events give as little as 30 s notice (Preempt), so keep it short; "
                          "IMDS allows 5 requests per second; the agent keeps all its requests to 4 in any 1.1 s (the "
                          "fifth is for `sefwd approve` / `sefwd once`), and approvals and instance metadata need room beside the polls, hence the "
                          "500ms floor (at most 1h). See docs/imds-transport.md.", None),
        "timeout": ("Deadline of one request: connect, send and the whole answer (a server that drips its "
                    "answer byte by byte is cut off here).", None),
        "first_call_timeout": ("The very first call enables Scheduled Events for the VM and can take up to "
                               "2 minutes; until then `sefwd run` says it is waiting.", None),
        "compute_api_version": ("api-version of /metadata/instance/compute, read for the VM's identity "
                                "(vmId, name, ...).", None),
        "compute_refresh": ("Instance metadata rarely changes: re-read it this rarely.", None),
        "max_body": ("Larger answers are refused without being read (IMDS answers are a few KiB); 64KiB to "
                     "16MiB.", None),
    },
    "state": {
        "dir": ("state.db (records, cursors, dead letters, state; see docs/storage.md). Default: "
                "/var/lib/sefwd as root, else $XDG_STATE_HOME/sefwd or ~/.local/state/sefwd "
                "(%ProgramData%\\sefwd on Windows). A relative path resolves against this file's directory.",
                "/var/lib/sefwd"),
    },
    "agent": {
        "heartbeat": ("Interval of forwarder.heartbeat records, so a silent agent can be told from a dead one; "
                      '"0" turns them off.', None),
        "log_level": ("debug, info, warning or error (logs go to stderr; stdout carries records only).", None),
        "drain_timeout": ("On shutdown, how long sinks may keep delivering the backlog before the agent exits "
                          "(undelivered records stay in state.db and are sent on the next start).", None),
        "heartbeat_file": ("A file rewritten every 30 s in the Azure guest agent's heartbeat format "
                           "(Ready/NotReady and a one-line summary); the VM extension sets it. \"\" (the "
                           "default) writes none.", None),
        "record_key_env": ("Environment variable holding this VM's record key (whsec_..., from `sefwd keys derive "
                           "--purpose record`): every record then carries sefwdauth, which consumers such as the "
                           "remote approver require (docs/security-model.md). Set this or record_key_file; \"\" "
                           "(the default): records are not authenticated.", None),
        "record_key_file": ("File holding this VM's record key (readable by the agent's user only; the VM "
                            "extension writes it from protectedSettings).", None),
        "status_interval": ("A changed status report (`sefwd status`, state.db) is written within this long; "
                            "each rewrite costs about a millisecond of CPU.", None),
        "degraded_after": ("A sink failing this long (or sending records to dead letters) makes the agent "
                           "degraded: `sefwd status` exits 4, /healthz answers 503, sefwd.degraded is 1. "
                           "30 s is the shortest notice a VM gets (Spot/Preempt).", None),
    },
    "journal": {
        "max_size": ("The cap on undelivered records in state.db. Past max_size heartbeats and audits are "
                     "evicted first, scheduledevent.* records last, and every record a sink thereby loses is "
                     "counted (sefwd status, \"evicted_size_cap\").", None),
        "fsync": ("fsync every commit (SQLite synchronous=FULL; false = NORMAL). Turn off only for tests.", None),
    },
    "delivery": {
        "retry_initial": ("First retry delay.", None),
        "retry_max": ("Longest retry delay.", None),
        "retry_after_cap": ("A peer's Retry-After is honoured up to this long.", None),
    },
    "telemetry": {
        "listen": ("Prometheus text on http://HOST:PORT/metrics, and /healthz (503 once IMDS has failed for "
                   "longer than unhealthy_after). A bare port listens on loopback; other hosts must be "
                   "explicit.", "127.0.0.1:9464"),
        "connection_string_env": ("Also export the metrics to Azure Monitor (Application Insights, AppMetrics) "
                                  "every export_interval; the variable holds the connection string.",
                                  "SEFWD_TELEMETRY_CONNECTION_STRING"),
        "connection_string_file": ("... or read it from a file instead (set only one of the two).",
                                   "/etc/sefwd/telemetry-connection-string"),
        "unhealthy_after": ("/healthz answers 503 once IMDS polls have failed this long.", None),
        "export_interval": ("How often metrics are exported to Azure Monitor.", None),
        "credential": ('Entra ID for the export (resources with local auth off): "managed_identity", which '
                       'needs "Monitoring Metrics Publisher" on the Application Insights resource.',
                       "managed_identity"),
        "client_id": ("A user-assigned managed identity for credential (default: the system-assigned one).",
                      "00000000-0000-0000-0000-000000000000"),
    },
    "probe": {
        "listen": ("host:port of the probe; the load balancer probes the VM's own address, so usually "
                   "\"0.0.0.0:PORT\" (a port >= 1024: the service has no capability to bind lower ones).",
                   "0.0.0.0:8080"),
        "path": ("The probe's path; every other path answers 404.", None),
        "event_types": ("Event types that take the VM out of rotation (Freeze, Reboot, Redeploy, Preempt, "
                        "Terminate, SpotRebalanceRecommendation, or [\"*\"] for every type, future ones included). Freeze, a pause of "
                        "seconds with memory kept, is left out by default.", None),
        "lead": ("\"scheduled\": 503 from the moment the event is Scheduled; a duration: from NotBefore - lead "
                 "(a Started event, or one without NotBefore, is 503 at once), so a Redeploy announced days ahead "
                 "does not drain the VM days early.", None),
        "settle": ("After the event ended (left the document), stay 503 this long more: the workload's time to "
                   "come back after a reboot or redeploy.", None),
        "state_file": ("Also write the state, atomically, as JSON here (with written_at and stale_after). "
                       "Default when listen is set: /run/sefwd/maintenance.json as root or when /run/sefwd is "
                       "writable (systemd RuntimeDirectory), else maintenance.json in the state dir.",
                       "/run/sefwd/maintenance.json"),
    },
}

SINKS_DOC = (
    'Sinks: one [[sinks]] table each. "type" picks the sink; "name" (default: the type) must be unique and '
    'names the sink\'s dead-letter and state directories. "max_age" (optional, e.g. "24h") moves records that '
    "could not be delivered for that long to dead letters. Every other key is an option of that sink type. "
    "Without any [[sinks]] the agent writes to stdout; relative paths in sink options are resolved by the sink, "
    "not by this file's location. The sinks below stdout and file are commented out: uncomment one and fill "
    "in its required keys. No sink option has an environment override. Any sink may have a \"filter\" table: "
    "record_types (scheduledevent, approval, protect, forwarder, or exact types such as approval.refused), changes "
    "(scheduled, started, updated, completed, canceled, ended), event_types (Reboot, Redeploy, Freeze, Preempt, "
    "Terminate, SpotRebalanceRecommendation) and affects_this_vm (true/false); a record is sent only if it matches every key set (the last "
    "three judge scheduled-event records only). Held-back records advance the sink's cursor and are counted in "
    "sefwd status. The notify sink defaults to record_types = [\"scheduledevent\", \"approval\", \"protect\", "
    "\"forwarder.stopped\", \"forwarder.data_lost\"]; filter = {} sends it everything."
)

# Built-in sinks in the order shown; the active ones are uncommented. Per option: an example value.
SINK_ORDER = ("stdout", "file", "webhook", "eventhubs", "loganalytics", "appinsights", "eventgrid", "notify")
ACTIVE_SINKS = {"stdout": "stdout", "file": "events-file"}
SINK_NAMES = {"webhook": "hook", "eventhubs": "hub", "loganalytics": "logs", "appinsights": "insights",
              "eventgrid": "grid", "notify": "people"}
SINK_EXTRAS = {"eventhubs": "eventhubs", "loganalytics": "loganalytics", "appinsights": "appinsights",
               "eventgrid": "eventgrid", "notify": "notify"}
# A filter table shown under a sink's options (what a chat channel wants).
SINK_FILTERS: dict[str, dict[str, Any]] = {
    "notify": {"record_types": ["scheduledevent", "approval.refused", "approval.failed", "forwarder.data_lost"],
               "changes": ["scheduled", "started", "completed", "canceled", "ended"],
               "event_types": ["Reboot", "Redeploy", "Preempt", "Terminate"]},
}
SINK_EXAMPLES: dict[str, dict[str, Any]] = {
    "stdout": {"pretty": False},
    "file": {"path": "/var/log/sefwd/events.jsonl", "max_size": "64MiB", "backups": 5, "fsync": False},
    "webhook": {
        "url": "https://receiver.example.com/sefwd", "url_env": "SEFWD_WEBHOOK_URL",
        "url_file": "/etc/sefwd/webhook.url", "timeout": "10s",
        "headers": {"X-Team": "ops"}, "headers_env": {"Authorization": "SEFWD_WEBHOOK_AUTHORIZATION"},
        "headers_file": {"x-functions-key": "/etc/sefwd/function.key"}, "batch_size": 1,
        "secret_env": "SEFWD_WEBHOOK_SECRET", "secret_file": "/etc/sefwd/webhook.secret",
        "insecure_http": False, "ca_file": "/etc/sefwd/ca.pem", "mode": "structured", "handshake": False,
        "origin": "vm-0.example.com",
    },
    "eventhubs": {
        "connection_string_env": "SEFWD_EVENTHUBS_CONNECTION_STRING",
        "connection_string_file": "/etc/sefwd/eventhubs-connection-string",
        "fully_qualified_namespace": "mynamespace.servicebus.windows.net", "eventhub": "scheduled-events",
        "credential": "managed_identity", "client_id": "00000000-0000-0000-0000-000000000000",
        "mode": "structured", "max_batch": 100, "timeout": "10s", "transport": "amqp",
        "http_proxy": {"host": "proxy.example.com", "port": 3128, "credentials_env": "SEFWD_PROXY_CREDENTIALS"},
        "ca_file": "/etc/sefwd/ca.pem", "custom_endpoint_address": "gateway.example.com:5671",
    },
    "loganalytics": {
        "endpoint": "https://my-dcr-abcd.norwayeast-1.ingest.monitor.azure.com",
        "rule_id": "dcr-00000000000000000000000000000000", "stream": "Custom-SefwdEvents",
        "credential": "managed_identity", "client_id": "00000000-0000-0000-0000-000000000000",
        "audience": "https://monitor.azure.com", "ca_file": "/etc/sefwd/ca.pem", "timeout": "30s",
        "max_batch": 500,
    },
    "appinsights": {
        "connection_string_env": "SEFWD_APPINSIGHTS_CONNECTION_STRING",
        "connection_string_file": "/etc/sefwd/appinsights-connection-string",
        "credential": "managed_identity", "client_id": "00000000-0000-0000-0000-000000000000",
        "role_name": "scheduled-events-forwarder", "batch_size": 100, "timeout": "10s",
        "ca_file": "/etc/sefwd/ca.pem",
    },
    "eventgrid": {
        "endpoint": "https://my-topic.norwayeast-1.eventgrid.azure.net/api/events", "topic": "scheduled-events",
        "key_env": "SEFWD_EVENTGRID_KEY", "key_file": "/etc/sefwd/eventgrid.key",
        "credential": "managed_identity", "client_id": "00000000-0000-0000-0000-000000000000",
        "max_batch": 100, "timeout": "10s", "ca_file": "/etc/sefwd/ca.pem",
    },
    "notify": {
        "urls": ["workflows://prod-01.westus.logic.azure.com:443/WORKFLOW/SIGNATURE"],
        "urls_env": "SEFWD_NOTIFY_URLS", "urls_file": "/etc/sefwd/notify.urls", "format": "text",
        "templates": {"scheduled": {"title": "{{ what }} of {{ vm }} {{ when_relative }} ({{ when_utc }})"}},
        "timeout": "15s", "insecure_http": False,
    },
}

APPROVAL_DOC = (
    "Approving an event (POST StartRequests to IMDS) lets Azure start it early for EVERY VM in its Resources. "
    "Nothing is approved unless rules, `sefwd approve` or the callback say so; every attempt becomes an "
    "approval.* record."
)
APPROVAL_FLAT: dict[str, tuple[str, Any]] = {
    "scope": ('Which events this VM may approve: "self" (Resources is this VM alone), "leader" (this VM is the '
              'first of the sorted Resources), "any", or "self_or_leader" (either of the first two).',
              "self_or_leader"),
    "hook_timeout": ("Hooks are killed (with their process group) after this long.", "5m"),
    "hook_output_limit": ("Bytes of a hook's stdout+stderr kept in the audit record (redacted like a log line).",
                          "4KiB"),
    "dry_run": ("true: plan, audit and log every hook run and approval (marked DryRun), perform none "
                "(also: sefwd run --dry-run).", False),
    "deadline_margin": ("A hook for an event still to come is gone (SIGKILL to its process group) this long "
                        "before NotBefore, whatever hook_timeout says; SEFWD_DEADLINE tells it when SIGTERM comes.",
                        "5s"),
    "workers": ("Actions (hook runs, approvals) running at once; more wait in the store, never in the poll loop "
                "(no environment override).", 8),
    "hook_env": ("Hooks inherit only PATH, HOME, LANG, LC_ALL, TZ and TMPDIR from the agent, plus the variables "
                 "named here (no environment override); never the agent's secrets.", []),
}
HOOKS_DOC = (
    "A command per change kind ({kinds}; ended = gone with an unknown outcome; see data.Outcome and "
    "data.Evidence): a list runs without a shell, a string runs with /bin/sh -c. The record is on stdin as "
    "JSON; the event is in SEFWD_EVENT_ID, SEFWD_EVENT_TYPE, SEFWD_EVENT_STATUS, SEFWD_EVENT_SOURCE, "
    "SEFWD_EVENT_RESOURCES, SEFWD_EVENT_NOT_BEFORE, SEFWD_EVENT_DURATION, SEFWD_EVENT_DESCRIPTION, "
    "SEFWD_CHANGE, SEFWD_AFFECTS_THIS_VM, SEFWD_RECORD_ID and SEFWD_RECORD_TYPE; its time is in SEFWD_DEADLINE "
    "(RFC 3339) and SEFWD_SECONDS_LEFT. A table sets when and for which events: command, at "
    "(\"notbefore - 2m\": not earlier than that; at once when the notice is shorter), event_types and "
    "affects_this_vm (default true: only events whose Resources name this VM, or name none; false: every VM's). "
    "Hooks for completed, canceled and ended are undo hooks: they run to completion once per event, again after "
    "a crash. To take this VM out of service and back, use [protect] above (one drain per hold, however many "
    "events overlap); these per-change hooks are for notifications and the like."
)
HOOKS_EXAMPLE: dict[str, Any] = {
    "scheduled": {"command": ["/usr/local/bin/tell-the-team.sh"], "event_types": ["Reboot", "Redeploy", "Preempt"]},
    "completed": {"command": "/usr/local/bin/tell-the-team.sh", "affects_this_vm": False},
}
RULES_DOC = (
    "Rules: the first that matches an event decides; without rules nothing is approved automatically (events "
    "start at NotBefore). Keys: {keys}. Every match key is optional (left out = any): event_type, "
    "event_source, event_status (a string or a list; case-sensitive IMDS values), duration_min / duration_max "
    "(DurationInSeconds, inclusive; an event without it never matches a duration bound), affects_this_vm "
    "(true/false), resources_min / resources_max (how many Resources), description (a Python regex, "
    "searched). action: approve, hold or ignore; approve may add delay (\"30s\": wait, re-check the event, "
    "then approve), at (\"notbefore - 2m\": not earlier than that) and after_hooks (true: approve only if this "
    "change's hook exits 0); event_types is another spelling of event_type. Right before posting, the event must "
    "still be unchanged and matched by the rule, else the approval is superseded. name (default "
    "\"rules[<i>]\") appears in the audit records. These four reproduce the advanced sample of Microsoft's "
    "Scheduled Events documentation:"
)
RULES_EXAMPLE: tuple[dict[str, Any], ...] = (
    {"name": "log-started", "event_status": "Started", "action": "ignore"},
    {"name": "user-initiated", "event_source": "User", "action": "approve"},
    {"name": "short-freeze", "event_type": "Freeze", "duration_min": 0, "duration_max": 8, "action": "approve"},
    {"name": "everything-else", "action": "hold"},
)
RULES_MORE = ('Other match keys look like: resources_max = 1, affects_this_vm = true, event_type = ["Reboot", '
              '"Redeploy"], description = "Live Migration"; approve rules may add delay = "30s" or '
              "after_hooks = true.")
CALLBACK_DOC = ('The signed remote-approval endpoint (off unless this table exists): POST /approvals with '
                '{"StartRequests":[{"EventId":"..."}]}, signed the Standard Webhooks way.')
CALLBACK_ALTERNATIVES = ("secret_file",)
CALLBACK_KEYS_DOC: dict[str, tuple[str, Any]] = {
    "listen": ('host:port ("[::1]:8787" for IPv6); any address may be used, the signature protects it.',
               "127.0.0.1:8787"),
    "secret_env": ("An environment variable holding whsec_... secrets; several, space-separated, are all "
                   "accepted (key rotation).", "SEFWD_CALLBACK_SECRET"),
    "secret_file": ("... or a file holding them instead (set only one of the two):",
                    "/etc/sefwd/callback.secret"),
    "tls_cert": ("HTTPS: tls_cert and tls_key, both or neither.", "/etc/sefwd/tls.crt"),
    "tls_key": ("The private key of tls_cert.", "/etc/sefwd/tls.key"),
    "max_body": ("Larger request bodies are refused (413).", "16KiB"),
    "rate_limit": ("Requests per minute per client address (429 beyond).", 30),
    "client_timeout": ("Slow clients are dropped after this long.", "5s"),
    "tolerance": ("Accepted clock difference of webhook-timestamp, both ways.", "5m"),
}


def toml_value(value: Any) -> str:
    """One TOML value (strings, booleans, integers, lists and inline tables of those)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML form for {value!r}")


def _comment(text: str, prefix: str = "# ") -> list[str]:
    return textwrap.wrap(text, WIDTH - len(prefix), initial_indent=prefix, subsequent_indent=prefix,
                         break_on_hyphens=False, break_long_words=False)


def _checked(what: str, defined: Any, documented: Any) -> None:
    missing, extra = set(defined) - set(documented), set(documented) - set(defined)
    if missing or extra:
        raise KeyError(f"config example of {what} is out of date: undocumented {sorted(missing)}, "
                       f"no longer defined {sorted(extra)}; edit forwarder/agent/config_example.py")


def _sections() -> list[str]:
    from forwarder.agent.config import ENV_PREFIX, SECTIONS

    _checked("the sections", SECTIONS, KEY_DOCS)
    out: list[str] = []
    for section, keys in SECTIONS.items():
        docs = KEY_DOCS[section]
        _checked(f"[{section}]", keys, docs)
        optional = section in OPTIONAL_SECTIONS
        lead = "# " if optional else ""
        out.append("")
        out += _comment(SECTION_DOCS[section])
        out += _comment(f"Environment: {ENV_PREFIX}{section.upper()}_<KEY> overrides any key below "
                        f"(e.g. {ENV_PREFIX}{section.upper()}_{next(iter(keys)).upper()}).")
        out.append(f"{lead}[{section}]")
        for key, spec in keys.items():
            doc, example = docs[key]
            out += _comment(doc, f"{lead}# ")
            if spec.default is None:
                if example is None:
                    raise KeyError(f"[{section}] {key} has no default and no example value")
                # A computed default (state.dir) is shown as its usual value.
                out.append(f"{lead}{key} = {toml_value(example)}")
            else:
                out.append(f"{lead}{key} = {toml_value(spec.default)}")
    return out


def _sink_classes() -> dict[str, Any]:
    from forwarder.sinkapi import load_sink_factory

    return {name: load_sink_factory(name) for name in SINK_ORDER}


def _sinks() -> list[str]:
    from forwarder.sinkapi import available_sinks

    builtin = {name for name, target in available_sinks().items() if target.startswith("sinks.")}
    _checked("the built-in sinks", builtin, SINK_EXAMPLES)
    out = [""] + _comment(SINKS_DOC)
    for type_name, cls in _sink_classes().items():
        examples = SINK_EXAMPLES[type_name]
        _checked(f"sink {type_name!r}", cls.OPTIONS, examples)
        active = type_name in ACTIVE_SINKS
        lead = "" if active else "# "
        doc = (cls.__doc__ or type_name).strip().splitlines()[0].replace("``", "")
        extra = SINK_EXTRAS.get(type_name)
        out.append("")
        out += _comment(f"{type_name}: {doc}" + (f" Needs: pip install 'scheduled-events-forwarder[{extra}]'."
                                                 if extra else ""))
        out.append(f"{lead}[[sinks]]")
        out.append(f"{lead}type = {toml_value(type_name)}")
        out.append(f"{lead}name = {toml_value(ACTIVE_SINKS.get(type_name) or SINK_NAMES[type_name])}")
        for key, description in cls.OPTIONS.items():
            out += _comment(description[:1].upper() + description[1:] + ".", f"{lead}# ")
            out.append(f"{lead}{key} = {toml_value(examples[key])}")
        if type_name in SINK_FILTERS:
            out += _comment("Only what this sink's readers need (see filter above):", f"{lead}# ")
            out.append(f"{lead}filter = {toml_value(SINK_FILTERS[type_name])}")
    return out


PROTECT_DOC = (
    "This VM's hold (off unless this table exists; docs/approvals.md#protect-this-vm): while events of "
    "event_types name this VM in Resources (or name none), it is held: enter runs once (not earlier than "
    "NotBefore - at; it must be over deadline_margin before NotBefore), and leave runs once after the last of "
    "them ended and settle passed, never before enter is over, never for a hold whose enter never ran. "
    "Overlapping events make one hold. Both run again after a crash (make them idempotent, as the "
    "deploy/hooks recipes are), with SEFWD_TRANSITION, SEFWD_HOLD_ID, SEFWD_HOLD_EVENTS, SEFWD_HOLD_DIR (a "
    "directory to note what enter did, so leave undoes only that), SEFWD_DEADLINE and SEFWD_SECONDS_LEFT. "
    "An approval rule with after_hooks = true waits for enter. Records: protect.entered, protect.left, "
    "protect.missed (a failed or late drain, an event that started first, a failed leave). Environment: "
    "SEFWD_PROTECT_AT, SEFWD_PROTECT_SETTLE, SEFWD_PROTECT_DEADLINE_MARGIN and SEFWD_PROTECT_TIMEOUT override "
    "those keys (the commands come from this file only)."
)
PROTECT_EXAMPLE: dict[str, Any] = {
    "enter": ["/usr/local/lib/sefwd/k8s-drain.sh"],
    "leave": ["/usr/local/lib/sefwd/k8s-uncordon.sh"],
    "at": "notbefore - 5m",
    "event_types": ["Reboot", "Redeploy", "Preempt", "Terminate"],
    "settle": "30s",
    "deadline_margin": "5s",
    "timeout": "1h",
    "hook_env": ["KUBECONFIG", "NODE_NAME"],
}


def _protect() -> list[str]:
    from forwarder.protect.settings import PROTECT_KEYS, parse_protect

    _checked("[protect]", PROTECT_KEYS, PROTECT_EXAMPLE)
    if parse_protect(PROTECT_EXAMPLE)[1]:
        raise ValueError(f"the [protect] example is invalid: {parse_protect(PROTECT_EXAMPLE)[1]}")
    out = [""] + _comment(PROTECT_DOC) + ["# [protect]"]
    out += [f"# {key} = {toml_value(value)}" for key, value in PROTECT_EXAMPLE.items()]
    return out


def _approval() -> list[str]:
    from forwarder.approval.config import APPROVAL_ENV_KEYS, APPROVAL_KEYS, CALLBACK_KEYS, ENV_PREFIX, RULE_KEYS
    from forwarder.approval.settings import CHANGE_KINDS

    flat = [key for key in APPROVAL_KEYS if key not in ("hooks", "rules", "callback")]
    _checked("[approval]", flat, APPROVAL_FLAT)
    _checked("[approval] overrides", set(APPROVAL_ENV_KEYS) - set(flat), ())
    _checked("[approval.callback]", CALLBACK_KEYS, CALLBACK_KEYS_DOC)
    _checked("[approval.hooks]", CHANGE_KINDS, dict.fromkeys(CHANGE_KINDS))
    out = ["", "[approval]"]
    out += _comment(APPROVAL_DOC + f" Environment: {ENV_PREFIX}<KEY> overrides the keys of this table "
                    f"(e.g. {ENV_PREFIX}{APPROVAL_ENV_KEYS[0].upper()}); the tables below have no overrides.")
    for key in flat:
        doc, value = APPROVAL_FLAT[key]
        out += _comment(doc)
        out.append(f"{key} = {toml_value(value)}")
    out.append("")
    out += _comment(HOOKS_DOC.format(kinds=", ".join(CHANGE_KINDS)))
    out.append("# [approval.hooks]")
    out += [f"# {kind} = {toml_value(cmd)}" for kind, cmd in HOOKS_EXAMPLE.items()]
    out.append("")
    out += _comment(RULES_DOC.format(keys=", ".join(RULE_KEYS)))
    for rule in RULES_EXAMPLE:
        _checked("a rule example", set(rule) - set(RULE_KEYS), {})
        out.append("# [[approval.rules]]")
        out += [f"# {k} = {toml_value(v)}" for k, v in rule.items()]
    out += _comment(RULES_MORE)
    out.append("")
    out += _comment(CALLBACK_DOC)
    out.append("# [approval.callback]")
    for key in CALLBACK_KEYS:
        doc, value = CALLBACK_KEYS_DOC[key]
        out += _comment(doc, "# # ")
        # An alternative to the key above is shown commented twice: uncommenting the table keeps it off.
        out.append(f"{'# # ' if key in CALLBACK_ALTERNATIVES else '# '}{key} = {toml_value(value)}")
    return out


def render() -> str:
    """The whole example config (what forwarder/agent/example-config.toml must hold)."""
    lines: list[str] = []
    for i, paragraph in enumerate(HEADER.split("\n|\n")):
        lines += (["#"] if i else []) + _comment(paragraph.replace("\n", " "))
    lines += _sections() + _sinks() + _protect() + _approval()
    return "\n".join(lines) + "\n"


def shipped() -> str:
    """The example config shipped with the package (printed by ``sefwd config example``)."""
    from importlib.resources import files

    return files("forwarder.agent").joinpath("example-config.toml").read_text(encoding="utf-8")


if __name__ == "__main__":
    import sys

    sys.stdout.write(render())
