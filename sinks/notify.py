"""The ``notify`` sink: tell people, on Slack, Teams, PagerDuty, Opsgenie, Discord, e-mail, ... via Apprise.

One Apprise URL per target (``urls``, or ``urls_env`` / ``urls_file`` so the tokens they embed stay out
of the config file). Each record becomes one short message (``sinks.notify_messages``) sent to every
target. The URLs are secrets: they are never logged, shown or stored; targets are named "target 2
(Slack)" in logs, status and dead letters, and Apprise's own log lines (which may quote a URL) are kept
out of the agent's log.

How Apprise's answers map to results (Apprise tells success or failure per target, not why): a target
that failed is looked up in the log lines Apprise captured for that call. An HTTP status there
(``error=503``) decides like every HTTP sink: 408, 429 and 5xx are retried, other 4xx are
permanent (the record goes to dead letters, reason ``http_<status>``). A timeout, a connection error, or
a failure without a status is retried (``timeout`` / ``connection_error`` / ``delivery_failed``).
Targets that already took a record are not sent it again when another target's failure makes the batch
retry (the sink remembers them in memory; after a restart a retried record may reach a target twice).
"""
from __future__ import annotations

import ipaddress
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar
from urllib.parse import parse_qsl, unquote, urlsplit

from forwarder.common.retry import is_retryable_status
from forwarder.common.values import parse_duration
from forwarder.sinkapi import Ok, Record, Reject, Result, Retry, SinkContext
from sinks import check_bool, check_positive_duration, unknown_options
from sinks.azure_common import read_secret_text

log = logging.getLogger(__name__)

EXTRA_HINT = "install it with: pip install 'scheduled-events-forwarder[notify]'"
DEFAULT_TIMEOUT = "15s"
MAX_TARGETS = 20
MAX_REMEMBERED = 1024  # records whose per-target progress is kept across retries (a batch is at most a few hundred)
_STATUS = re.compile(r"error=(\d{3})\b")
_CONNECTION = re.compile(r"connection error|socket exception|connection refused|name or service", re.I)
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


class _HideTargetSecrets(logging.Filter):
    """Masks the notify URLs' tokens in urllib3's debug lines ("POST /services/T0/B0/XXXX" holds them)."""

    def __init__(self) -> None:
        super().__init__()
        # Per open sink, so that a closed sink's tokens leave the list: it holds what the open ones use, however
        # many sinks were made and closed in this process (a replay, a test, a reload).
        self._by_sink: dict[int, frozenset[str]] = {}
        self.secrets: frozenset[str] = frozenset()

    def add(self, owner: object, secrets: set[str]) -> None:
        self._by_sink[id(owner)] = self._by_sink.get(id(owner), frozenset()) | secrets
        self.secrets = frozenset().union(*self._by_sink.values())

    def remove(self, owner: object) -> None:
        self._by_sink.pop(id(owner), None)
        self.secrets = frozenset().union(*self._by_sink.values())

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = self.secrets  # one immutable set, swapped whole: no lock against add/remove
        if secrets:
            text = record.getMessage()
            hidden = text
            for secret in secrets:
                hidden = hidden.replace(secret, "***")
            if hidden != text:
                record.msg, record.args = hidden, ()
        return True


_HIDE = _HideTargetSecrets()


def url_secrets(url: str) -> set[str]:
    """The parts of an Apprise URL that may be tokens: user, password, host and path parts, query values."""
    parts = urlsplit(url)
    words = [parts.username or "", parts.password or "", *(unquote(p) for p in parts.path.split("/"))]
    words += [value for _, value in parse_qsl(parts.query)]
    host = parts.hostname or ""
    if "." not in host and ":" not in host:  # slack://TokenA/..., discord://WebhookId/...: the "host" is a token
        words.append(host)
    return {w for w in words if len(w) >= 6}


def _apprise() -> Any:
    """Import Apprise (the ``[notify]`` extra) and keep its log lines, which may quote URLs, out of ours."""
    try:
        import apprise
        import jinja2  # noqa: F401 - the templates need it; fail here with the same hint
    except ImportError as exc:
        raise ImportError(f"the notify sink needs {exc.name}; {EXTRA_HINT}") from None
    quiet = logging.getLogger("apprise")
    if quiet.propagate:
        quiet.propagate = False
        quiet.addHandler(logging.NullHandler())
    for name in ("urllib3.connectionpool", "urllib3.util.retry"):
        if _HIDE not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_HIDE)
    return apprise


def _asset(apprise: Any) -> Any:
    # No persistent store on disk, no key generation, one call at a time (the dispatcher's thread).
    return apprise.AppriseAsset(storage_mode="memory", async_mode=False, pgp_autogen=False, pem_autogen=False)


def scheme_of(url: str) -> str:
    match = _SCHEME.match(url)
    return match.group(1).lower() if match else ""


def _loopback(host: str | None) -> bool:
    if not host:
        return False
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def load_urls(options: Mapping[str, Any]) -> list[str]:
    """The target URLs from ``urls``, ``urls_env`` or ``urls_file`` (one per line or whitespace-separated)."""
    given = [k for k in ("urls", "urls_env", "urls_file") if options.get(k) is not None]
    if len(given) > 1:
        raise ValueError(f"set only one of {', '.join(given)}")
    if not given:
        raise ValueError("set one of urls, urls_env or urls_file (Apprise URLs, e.g. slack://..., workflows://... for "
                         "Teams)")
    if given[0] == "urls":
        value = options["urls"]
        if isinstance(value, str) or not isinstance(value, list) or not all(isinstance(u, str) for u in value):
            raise ValueError("option 'urls' must be a list of strings")
        return [u.strip() for u in value if u.strip()]
    text = read_secret_text(options, "urls") or ""
    return [word for line in text.splitlines() if not line.lstrip().startswith("#") for word in line.split()]


def _target_problems(apprise: Any, index: int, url: str, insecure_http: bool) -> list[str]:
    """Problems of one URL, naming it by position and scheme only (the rest may be a token)."""
    scheme = scheme_of(url)
    where = f"urls[{index}] ({scheme}://...)" if scheme else f"urls[{index}]"
    if not scheme:
        return [f"{where}: not an Apprise URL (expected scheme://..., e.g. slack://, workflows:// "
                "(Teams), mailtos://)"]
    if any(c in url for c in "\r\n\0\t "):
        return [f"{where}: contains whitespace or control characters"]
    plugin = apprise.Apprise.instantiate(url, asset=_asset(apprise))
    if plugin is None:
        if scheme == "msteams":
            return [f"{where}: Teams' Office 365 connectors are retired and Apprise dropped msteams://; add a "
                    "Workflows webhook to the channel and use its https://...logic.azure.com/... URL or workflows://"]
        from apprise.manager_plugins import NotificationManager

        if scheme not in NotificationManager():
            return [f"{where}: unknown Apprise scheme {scheme!r} (see https://github.com/caronc/apprise/wiki)"]
        return [f"{where}: Apprise cannot use this {scheme}:// URL: a token, host or parameter is missing or "
                "malformed (see https://github.com/caronc/apprise/wiki)"]
    problems = []
    if getattr(plugin, "verify_certificate", True) is False:
        problems.append(f"{where}: verify=no turns TLS certificate checks off; remove it (the agent always verifies)")
    if not insecure_http and _plain_to_network(plugin):
        secure = getattr(plugin, "secure_protocol", None)
        better = secure if isinstance(secure, str) else secure[0] if isinstance(secure, (tuple, list)) and secure else ""
        hint = f"use {better}:// " if better else "use a TLS target "
        problems.append(f"{where}: plain http (no TLS) to a host other than loopback: its token or message would "
                        f"cross the network in clear text; {hint}(or set insecure_http = true)")
    return problems


def _plain_to_network(plugin: Any) -> bool:
    """Whether Apprise's plugin will talk without TLS to a host the user named that is not loopback.

    Decided by the plugin, not by a list of schemes: ``secure`` is its own TLS flag for this URL
    (gotify:// False, gotifys:// True; an e-mail URL is secure once STARTTLS/SSL applies). A plugin
    without a plain ``protocol`` (slack://, pagerduty://, discord://, ...) only reaches its service's
    fixed HTTPS endpoint, and one without a host (ntfy://topic, syslog://) uses its built-in
    endpoint, so neither has a plain-http variant a user could pick.
    """
    if getattr(plugin, "secure", False) is True or not getattr(plugin, "protocol", None):
        return False
    host = getattr(plugin, "host", None)
    return bool(host) and not _loopback(str(host))


class NotifySink:
    """Sends each record as a short message to every Apprise target."""

    OPTIONS: ClassVar[dict[str, str]] = {
        "urls": "Apprise URLs, one per target (they hold tokens: prefer urls_env or urls_file)",
        "urls_env": "environment variable holding the Apprise URLs (whitespace- or newline-separated)",
        "urls_file": "file holding the Apprise URLs, one per line (# comments allowed)",
        "format": 'message format: "text" (default), "markdown" or "html"',
        "templates": "table of title/body templates per kind (default, scheduled, started, updated, completed, "
                     "canceled, ended, approval, forwarder); jinja2, sandboxed",
        "timeout": f"longest wait for one target per message (default {DEFAULT_TIMEOUT})",
        "insecure_http": "allow a target without TLS (gotify://, ntfy://, json://, mailto:// without STARTTLS, ...) "
                         "to a non-loopback host (default false)",
    }
    max_batch = 10

    def __init__(self, options: Mapping[str, Any], context: SinkContext) -> None:
        problems = self.check(options)
        if problems:
            raise ValueError("; ".join(problems))
        from sinks.notify_messages import MessageRenderer

        apprise = _apprise()
        self.name = context.name
        self._stop = context.stop
        self.timeout = parse_duration(options.get("timeout", DEFAULT_TIMEOUT))
        self.format = str(options.get("format", "text"))
        self._renderer = MessageRenderer(options.get("templates"), self.format)
        self._targets: list[tuple[str, Any]] = []
        for index, url in enumerate(load_urls(options), 1):
            _HIDE.add(self, url_secrets(url))
            plugin = apprise.Apprise.instantiate(url, asset=_asset(apprise))
            one = apprise.Apprise(asset=_asset(apprise))
            one.add(plugin)
            self._targets.append((f"target {index} ({getattr(plugin, 'service_name', None) or scheme_of(url)})", one))
        # record id -> targets that took it / refused it, kept across a retry of the same records; bounded
        # (MAX_REMEMBERED, oldest first out): a record dead-lettered or evicted while retried is never sent again.
        self._done: dict[str, set[int]] = {}
        self._refused: dict[str, dict[int, Reject]] = {}
        self._lock = threading.Lock()

    @classmethod
    def check(cls, options: Mapping[str, Any]) -> list[str]:
        """Every problem with ``options``; the URLs are parsed by Apprise and never echoed."""
        try:  # jinja2 comes with the extra: name it rather than "No module named 'jinja2'"
            from sinks.notify_messages import FORMATS, template_problems
        except ImportError as exc:
            return unknown_options(options, cls.OPTIONS) + [f"the notify sink needs {exc.name}; {EXTRA_HINT}"]

        problems = unknown_options(options, cls.OPTIONS)
        problems += check_positive_duration(options, "timeout")
        problems += check_bool(options, "insecure_http")
        fmt = options.get("format")
        if fmt is not None and fmt not in FORMATS:
            problems.append(f"option 'format' must be one of {', '.join(FORMATS)}, got {fmt!r}")
        try:
            apprise = _apprise()
        except ImportError as exc:
            return problems + [str(exc)]
        problems += template_problems(options.get("templates"))
        try:
            urls = load_urls(options)
        except ValueError as exc:
            return problems + [str(exc)]
        if not urls:
            problems.append("no Apprise URL given (the list, variable or file is empty)")
        elif len(urls) > MAX_TARGETS:
            problems.append(f"at most {MAX_TARGETS} URLs per notify sink, got {len(urls)}")
        for index, url in enumerate(urls):
            problems += _target_problems(apprise, index, url, options.get("insecure_http") is True)
        return problems

    @classmethod
    def describe_options(cls, options: Mapping[str, Any]) -> dict[str, str]:
        """How ``sefwd config check`` shows the URL option: where the URLs come from and their schemes, never a URL."""
        for key in ("urls", "urls_env", "urls_file"):
            if options.get(key) is None:
                continue
            source = "" if key == "urls" else f"{options[key]} "
            try:
                urls = load_urls(options)
            except ValueError:
                return {key: f"{source}(not set)" if key == "urls_env" else f"{source}(unreadable)"}
            schemes = ", ".join(sorted({scheme_of(u) or "?" for u in urls}))
            state = "" if key == "urls" else ("set, " if key == "urls_env" else "read, ")
            count = f"{len(urls)} target{'s' if len(urls) != 1 else ''}"
            return {key: f"{source}({state}{count}" + (f": {schemes})" if urls else ")")}
        return {}

    def send(self, batch: Sequence[Record]) -> Result:
        """One message per record to every target not yet reached; never raises."""
        with self._lock:
            try:
                return self._send(batch)
            except Exception as exc:  # an Apprise or template bug must not reach the dispatcher; no URL in the text
                log.error("sink %r: unexpected %s while notifying; records kept, will retry", self.name, type(exc).__name__)
                return Retry(reason="internal_error")

    def _send(self, batch: Sequence[Record]) -> Result:
        refused: list[Reject] = []
        for record in batch:
            done = self._done.setdefault(record.id, set())
            rejects = self._refused.setdefault(record.id, {})
            message = None
            for index, (label, target) in enumerate(self._targets):
                if index in done or index in rejects:
                    continue
                if self._stop.is_set():
                    return Retry(reason="stopping")
                if message is None:
                    message = self._renderer.render(record.to_dict())
                result = self._notify(label, target, message)
                if isinstance(result, Ok):
                    done.add(index)
                elif isinstance(result, Reject):
                    rejects[index] = result
                else:
                    self._forget_oldest()
                    return result  # keep the order: later records wait for this one
            refused += rejects.values()
        if not refused or len(batch) == 1:
            # A refusal in a batch keeps what each target took: the dispatcher sends the records one by one next.
            for record in batch:
                self._done.pop(record.id, None)
                self._refused.pop(record.id, None)
        self._forget_oldest()
        if refused:
            first = refused[0]
            return Reject(reason=first.reason, detail="; ".join(r.detail for r in refused))
        return Ok()

    def _forget_oldest(self) -> None:
        """Keep at most MAX_REMEMBERED records' progress: the oldest are records the dispatcher gave up on."""
        for table in (self._done, self._refused):
            while len(table) > MAX_REMEMBERED:
                del table[next(iter(table))]  # dicts keep insertion order: the oldest first

    def _notify(self, label: str, target: Any, message: Any) -> Result:
        answer = target.notify(body=message.body, title=message.title, notify_type=message.notify_type,
                               body_format=self.format, timeout=self.timeout)
        if answer:
            return Ok()
        status_name = getattr(getattr(answer, "status", None), "name", "FAILURE")
        text = "\n".join(getattr(entry, "message", "") for entry in _logs(answer))
        if status_name == "TIMEOUT":
            log.warning("sink %r: %s did not answer within %gs; will retry", self.name, label, self.timeout)
            return Retry(reason="timeout")
        found = _STATUS.search(text)
        if found:
            status = int(found.group(1))
            if is_retryable_status(status):
                log.warning("sink %r: %s answered %d; will retry", self.name, label, status)
                return Retry(reason=f"http_{status}")
            log.error("sink %r: %s refused the message with %d", self.name, label, status)
            return Reject(reason=f"http_{status}", detail=f"{label} answered HTTP {status}")
        reason = "connection_error" if _CONNECTION.search(text) else "delivery_failed"
        log.warning("sink %r: %s failed (%s); will retry", self.name, label, reason.replace("_", " "))
        return Retry(reason=reason)

    def close(self) -> None:
        """Forget the targets and their tokens (Apprise opens a connection per message: nothing else to release)."""
        self._targets = []
        self._done.clear()
        self._refused.clear()
        _HIDE.remove(self)


def _logs(answer: Any) -> list[Any]:
    """The log entries Apprise captured for one call (WARNING and above)."""
    logs = getattr(answer, "logs", None)
    try:
        return list(logs() if callable(logs) else logs or [])
    except Exception:  # an older result object: no logs to read, the failure is retried
        return []
