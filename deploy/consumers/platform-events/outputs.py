"""Where the consumer's records go: the agents' Event Hub (as the agents' own records do), or an HTTP endpoint.

``PLATFORM_OUTPUT``: ``eventhubs`` (default; ``EVENTHUB_CONNECTION`` + ``EVENTHUB_NAME``, or
``EVENTHUB_CONNECTION__fullyQualifiedNamespace`` with the app's managed identity) or ``http``
(``PLATFORM_OUTPUT_URL``: a JSON array per POST, e.g. a collector in front of Log Analytics, or a
test). An output raises when the records did not get out, so nothing is marked done.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Callable

import requests

Output = Callable[[list[dict[str, Any]]], None]


class HttpOutput:
    """POST the records as one JSON array; anything but 2xx raises."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        if not url.startswith(("https://", "http://")):
            raise ValueError(f"PLATFORM_OUTPUT_URL must be an http(s) URL, got {url!r}")
        self.url = url
        self.timeout = timeout
        self._session = requests.Session()

    def __call__(self, records: list[dict[str, Any]]) -> None:
        response = self._session.post(self.url, data=json.dumps(records), timeout=self.timeout,
                                      headers={"Content-Type": "application/json"})
        if not 200 <= response.status_code < 300:
            raise RuntimeError(f"{self.url} answered {response.status_code}")


class EventHubsOutput:
    """Send the records to the agents' Event Hub, partitioned by EventId (one batch per call)."""

    def __init__(self, settings: Mapping[str, str]) -> None:
        from azure.eventhub import EventHubProducerClient

        hub = settings.get("EVENTHUB_NAME", "")
        namespace = settings.get("EVENTHUB_CONNECTION__fullyQualifiedNamespace")
        if namespace:
            from azure.identity import DefaultAzureCredential

            self._client = EventHubProducerClient(namespace, hub, DefaultAzureCredential())
        else:
            self._client = EventHubProducerClient.from_connection_string(settings["EVENTHUB_CONNECTION"], eventhub_name=hub)

    def __call__(self, records: list[dict[str, Any]]) -> None:
        from azure.eventhub import EventData

        batch = self._client.create_batch()
        for record in records:
            batch.add(EventData(json.dumps(record)))
        self._client.send_batch(batch)


def output_from_env(settings: Mapping[str, str]) -> Output:
    """The output the app settings name."""
    kind = settings.get("PLATFORM_OUTPUT", "eventhubs").strip().lower()
    if kind == "http":
        return HttpOutput(settings.get("PLATFORM_OUTPUT_URL", ""))
    if kind == "eventhubs":
        return EventHubsOutput(settings)
    raise ValueError(f"PLATFORM_OUTPUT must be eventhubs or http, got {kind!r}")
