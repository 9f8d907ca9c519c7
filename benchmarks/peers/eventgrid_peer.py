"""An Event Grid publishing peer: HTTPS on loopback (trustme CA), enforcing the service's contract.

Two targets, like the service:

* a custom topic with the CloudEvents 1.0 input schema: ``POST /api/events?api-version=2018-01-01``,
  the key in ``aeg-sas-key``;
* a namespace topic (``namespace_topic="orders"``): ``POST /topics/orders:publish?api-version=2024-06-01``,
  the key as ``Authorization: SharedAccessKey <key>``;

either one also takes ``Authorization: Bearer <token>`` when ``token_validator`` accepts the token
(403 while ``authorized`` is False: the identity lacks "EventGrid Data Sender"). In the service's
order: path (404), method (405), api-version (400), credentials (401), scripted answers
(``queue``: 429 + Retry-After, 500, slow...), size (413 above 1 MB per request or per event),
content type (400 unless ``application/cloudevents-batch+json``), then each event (400 unless a
CloudEvents 1.0 object with id, source, type; ``event_rule`` may refuse more). Accepted events are
stored in arrival order (``events``) and answered 200.

Built on the Logs Ingestion peer's HTTPS server, queue and request log; only the contract differs.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from benchmarks.peers.logs_ingestion import LogsIngestionPeer, _Verdict, error_body, refuse_method_or_version

TOPIC_PATH = "/api/events"
TOPIC_API_VERSION = "2018-01-01"
NAMESPACE_API_VERSION = "2024-06-01"
MAX_BYTES = 1024 * 1024
BATCH_CONTENT_TYPE = "application/cloudevents-batch+json"
KEY = "test-topic-key-0123456789abcdef"


class EventGridPeer(LogsIngestionPeer):
    """The peer; a context manager. ``events`` holds the accepted CloudEvents, in arrival order."""

    def __init__(
        self,
        *,
        key: str | None = KEY,
        namespace_topic: str | None = None,
        token_validator: Callable[[str], bool] | None = None,
        max_body: int = MAX_BYTES,
    ) -> None:
        super().__init__(token_validator=token_validator or (lambda token: False), max_body=max_body)
        self.key = key
        self.namespace_topic = namespace_topic
        self.max_event = MAX_BYTES
        # Says why the service would refuse one event (the whole request gets 400), or None.
        self.event_rule: Callable[[dict[str, Any]], str | None] | None = None

    @property
    def topic_endpoint(self) -> str:
        """What to configure as ``endpoint``: the topic's /api/events URL, or the namespace's base URL."""
        return self.url if self.namespace_topic else self.url + TOPIC_PATH

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.rows

    def event_ids(self) -> list[str]:
        return [e["id"] for e in self.rows]

    def sent_ids(self) -> list[str]:
        """The id of every event in every request that parsed, accepted or not."""
        ids = []
        for upload in self.uploads:
            try:
                ids += [e["id"] for e in json.loads(upload.body)]
            except (ValueError, TypeError, KeyError):
                pass
        return ids

    def _authorized(self, headers: Mapping[str, str]) -> _Verdict | None:
        """None when the request may publish, else the 401/403 answer."""
        auth = headers.get("authorization") or ""
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            with self._lock:
                self._tokens.append(value.strip())
            if not self.token_validator(value.strip()):
                return _Verdict(401, error_body("Unauthorized", "The token is not valid for this topic"))
            if not self.authorized:
                return _Verdict(403, error_body("Forbidden", "The principal does not have the EventGrid Data Sender role"))
            return None
        if self.namespace_topic:
            given = value.strip() if scheme == "SharedAccessKey" else None
        else:
            given = headers.get("aeg-sas-key")
        if self.key is None or given != self.key:
            return _Verdict(401, error_body("Unauthorized", "The request authorization key is not authorized"))
        return None

    def _decide(self, method: str, path: str, query: str, headers: Mapping[str, str], wire: bytes) -> _Verdict:
        expected = f"/topics/{self.namespace_topic}:publish" if self.namespace_topic else TOPIC_PATH
        version = NAMESPACE_API_VERSION if self.namespace_topic else TOPIC_API_VERSION
        if path != expected:
            return _Verdict(404, error_body("NotFound", f"no such topic: {path}"), decoded=wire)
        refused = refuse_method_or_version(method, query, version, "BadRequest", wire)
        if refused is not None:
            return refused
        refused = self._authorized(headers)
        if refused is not None:
            return _Verdict(refused.status, refused.body, decoded=wire)
        with self._lock:
            scripted = self._queue.popleft() if self._queue else None
        if scripted is not None and scripted.status != 0:
            return _Verdict(scripted.status, scripted.payload(), dict(scripted.headers), decoded=wire, delay=scripted.delay)
        delay = scripted.delay if scripted is not None else 0.0
        if len(wire) > self.max_body:
            return _Verdict(413, error_body("PayloadTooLarge", f"The request is {len(wire)} bytes; the limit is {self.max_body}"),
                            decoded=wire)
        if not (headers.get("content-type") or "").lower().startswith(BATCH_CONTENT_TYPE):
            return _Verdict(400, error_body("BadRequest", f"Content-Type must be {BATCH_CONTENT_TYPE}"), decoded=wire)
        try:
            events = json.loads(wire)
        except ValueError:
            return _Verdict(400, error_body("BadRequest", "The body is not valid JSON"), decoded=wire)
        if not isinstance(events, list):
            return _Verdict(400, error_body("BadRequest", "The body must be a JSON array of CloudEvents"), decoded=wire)
        for index, event in enumerate(events):
            if len(json.dumps(event).encode()) > self.max_event:
                return _Verdict(413, error_body("PayloadTooLarge", f"event {index} is larger than {self.max_event} bytes"),
                                decoded=wire)
            why = _invalid(event) or (self.event_rule(event) if self.event_rule else None)
            if why:
                return _Verdict(400, error_body("BadRequest", f"event {index}: {why}"), decoded=wire)
        return _Verdict(200, b"" if not self.namespace_topic else {}, rows=events, decoded=wire, delay=delay)


def _invalid(event: Any) -> str | None:
    if not isinstance(event, dict):
        return "not an object"
    if event.get("specversion") != "1.0":
        return f"specversion must be 1.0, got {event.get('specversion')!r}"
    for name in ("id", "source", "type"):
        if not isinstance(event.get(name), str) or not event[name]:
            return f"required attribute {name!r} is missing or empty"
    return None
