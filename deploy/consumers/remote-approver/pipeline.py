"""Records in, approvals out: settings, record authentication, replay cache, de-duplication, leader
targeting, and the webhook receiver."""
from __future__ import annotations

import base64
import json
import logging
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import requests
from standardwebhooks.webhooks import Webhook

import approver_client
import streamauth
from decide import (ALL_EVENT_TYPES, FOLD_ORDER, Deduper, OutcomeFolder, Policy, VmIdentity, authenticated_vm,
                    dedupe_key, record_age, record_outcome, should_approve, target_vm)
from seen_records import SeenRecords

log = logging.getLogger(__name__)

SINGLE = "application/cloudevents+json"
BATCH = "application/cloudevents-batch+json"
PLAIN = "application/json"
MAX_WEBHOOK_BODY = 4 * 1024 * 1024
APP_DIR = Path(__file__).resolve().parent


def dns_label(name: str) -> str:
    """A VM name as a DNS label: lower case, anything but [a-z0-9-] as "-" (``WestNO_0`` -> ``westno-0``)."""
    return re.sub(r"[^a-z0-9-]", "-", name.lower()).strip("-")


def secret_problem(secret: str) -> str | None:
    """Why ``secret`` is not a usable ``whsec_<base64>`` key (the agent wants >= 16 key bytes), or None."""
    if not secret.startswith("whsec_"):
        return "must start with whsec_"
    text = secret[len("whsec_"):]
    try:
        # Pasted secrets often lose their padding; the agent and the standardwebhooks package accept that.
        key = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except ValueError:  # binascii.Error is a ValueError
        return "is not base64 after whsec_"
    return None if len(key) >= 16 else f"is too short ({len(key)} key bytes, need 16 or more)"


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def policy_and_webhook_secrets(env: Mapping[str, str], problems: list[str]) -> tuple[Policy, tuple[str, ...]]:
    """The settings both routes share: the policy and the webhook secrets; problems are appended."""
    webhook_secrets = tuple(env.get("SEFWD_WEBHOOK_SECRET", "").split())
    for position, value in enumerate(webhook_secrets, 1):
        problem = secret_problem(value)
        if problem:
            problems.append(f"SEFWD_WEBHOOK_SECRET: secret #{position} {problem}")
    try:
        policy = Policy.from_settings(env)
    except ValueError as exc:
        problems.append(f"MAX_FREEZE_SECONDS: {exc}")
        policy = Policy()
    unknown = sorted(policy.event_types - ALL_EVENT_TYPES)
    if unknown:
        problems.append(f"APPROVE_EVENT_TYPES: unknown event types {unknown} (known: {sorted(ALL_EVENT_TYPES)})")
    return policy, webhook_secrets


def positive_numbers(env: Mapping[str, str], specs: Iterable[tuple[str, float]], problems: list[str], *,
                     zero_ok: Iterable[str] = ()) -> dict[str, float]:
    """Numeric settings (name, default), each greater than zero (or zero, for those in ``zero_ok``)."""
    numbers: dict[str, float] = {}
    allow_zero = set(zero_ok)
    for name, default in specs:
        try:
            numbers[name] = float(env.get(name, "") or default)
            if numbers[name] < 0 or (numbers[name] == 0 and name not in allow_zero):
                raise ValueError("must be zero or more" if name in allow_zero else "must be greater than zero")
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
            numbers[name] = default
    return numbers


def ca_bundle_setting(env: Mapping[str, str], name: str, problems: list[str]) -> str:
    """A CA bundle path setting; a relative path is a file shipped with the app (e.g. certs/contoso-ca.pem)."""
    ca_bundle = env.get(name, "").strip()
    if ca_bundle:
        ca_bundle = str(APP_DIR / ca_bundle) if not Path(ca_bundle).is_absolute() else ca_bundle
        if not Path(ca_bundle).is_file():
            problems.append(f"{name}: no file {ca_bundle}")
    return ca_bundle


def approver_name(env: Mapping[str, str]) -> str:
    site = env.get("WEBSITE_SITE_NAME", "").strip()
    return env.get("APPROVER_NAME", "").strip() or (f"azure-function:{site}" if site else "remote-approver")


def master_keys(env: Mapping[str, str], problems: list[str]) -> tuple[bytes, ...]:
    """SEFWD_MASTER_SECRET: the fleet master(s), the first signs; required by both routes."""
    masters: list[bytes] = []
    for position, value in enumerate(env.get("SEFWD_MASTER_SECRET", "").split(), 1):
        problem = secret_problem(value)
        if problem:
            problems.append(f"SEFWD_MASTER_SECRET: secret #{position} {problem}")
        else:
            masters.append(streamauth.master_key(value))
    if not env.get("SEFWD_MASTER_SECRET", "").strip():
        problems.append("SEFWD_MASTER_SECRET is required (the fleet master secret: records are verified "
                        "with it, and per-VM callback secrets derived; `sefwd keys new-master`)")
    return tuple(masters)


def state_settings(env: Mapping[str, str], problems: list[str]) -> dict[str, Any]:
    """STATE_BACKEND (``sqlite``: one instance; ``table``: Azure Table Storage, any number) and its settings."""
    found = fleet_state_module().table_settings(env, problems, default_table="sefwdapprover")
    lease = positive_numbers(env, (("STATE_LEASE_SECONDS", 600.0),), problems)["STATE_LEASE_SECONDS"]
    return {"state_backend": found["backend"], "state_table_connection": found["connection"],
            "state_table_endpoint": found["endpoint"], "state_table_name": found["table"], "state_lease": lease}


def fleet_state_module() -> Any:
    """deploy/consumers/shared/fleet_state.py: copied beside this app when published, else from the repository."""
    try:
        import fleet_state
    except ImportError:
        sys.path.append(str(APP_DIR.parent / "shared"))
        import fleet_state
    return fleet_state


@dataclass(frozen=True)
class TrustSettings:
    """What both routes share: who is trusted (the fleet master), the policy, the replay cache, staleness."""

    policy: Policy = field(default_factory=Policy)
    masters: tuple[bytes, ...] = field(default=(), repr=False)  # the fleet master(s): the first signs approvals
    webhook_secrets: tuple[str, ...] = field(default=(), repr=False)
    seen_records_path: Path = Path("seen-records.db")
    record_max_age: float = 3600.0
    approver_name: str = "remote-approver"
    dry_run: bool = False
    state_backend: str = "sqlite"  # "table": claims, keys and folds in Azure Table Storage (fleet_state.py)
    state_table_connection: str = field(default="", repr=False)
    state_table_endpoint: str = ""
    state_table_name: str = "sefwdapprover"
    state_lease: float = 600.0  # seconds a claim of a killed instance stays its owner's before another takes it over
    managed_identity_client_id: str | None = None  # a user-assigned identity; None: system-assigned/default chain

    @staticmethod
    def shared_from_env(env: Mapping[str, str], problems: list[str]) -> dict[str, Any]:
        """The shared settings as keyword arguments; problems are appended."""
        masters = master_keys(env, problems)
        policy, webhook_secrets = policy_and_webhook_secrets(env, problems)
        numbers = positive_numbers(env, (("RECORD_MAX_AGE_SECONDS", 3600.0),), problems)
        # Durable across restarts; under /home on Azure Functions (persisted, shared by the instances
        # of Premium and Dedicated plans).
        seen = env.get("SEEN_RECORDS_PATH", "").strip() or str(Path(env.get("HOME", ".")) / "data" / "sefwd-approver"
                                                                 / "seen-records.db")
        return {"policy": policy, "masters": masters, "webhook_secrets": webhook_secrets,
                "seen_records_path": Path(seen), "record_max_age": numbers["RECORD_MAX_AGE_SECONDS"],
                "approver_name": approver_name(env), "dry_run": _flag(env.get("DRY_RUN")),
                "managed_identity_client_id": env.get("AZURE_CLIENT_ID", "").strip() or None,
                **state_settings(env, problems)}


@dataclass(frozen=True)
class Settings(TrustSettings):
    """The app settings of the callback route (see README.md: "App settings")."""

    callback_url_template: str = ""
    callback_urls: Mapping[str, str] = field(default_factory=dict)  # lower-case resourceId or VM name -> URL
    verify: bool | str = True
    timeout: float = 5.0
    attempts: int = 3

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        """Read and check every setting; raises ValueError listing all problems at once."""
        problems: list[str] = []
        template = env.get("CALLBACK_URL_TEMPLATE", "").strip()
        urls: dict[str, str] = {}
        raw_map = env.get("CALLBACK_URLS", "").strip()
        if raw_map:
            try:
                parsed = json.loads(raw_map)
                if not isinstance(parsed, dict) or not all(isinstance(v, str) for v in parsed.values()):
                    raise ValueError("not an object of strings")
                urls = {str(k).lstrip("_").lower(): v for k, v in parsed.items()}
            except ValueError as exc:
                problems.append(f"CALLBACK_URLS must be a JSON object {{vm name: url}}: {exc}")
        if not template and not urls:
            problems.append("CALLBACK_URL_TEMPLATE is required (e.g. https://{vm_name}.contoso.internal:8787/approvals)")
        elif template:
            try:
                template.format(vm_name="vm", vm_lower="vm", vm_dns="vm")
            except (KeyError, IndexError, ValueError) as exc:
                problems.append(f"CALLBACK_URL_TEMPLATE: only {{vm_name}}, {{vm_lower}}, {{vm_dns}} are allowed: {exc!r}")
        if env.get("SEFWD_CALLBACK_SECRET", "").strip():
            # One secret shared by every VM let an approval captured for one VM approve on another.
            problems.append("SEFWD_CALLBACK_SECRET (one callback secret for all VMs) is no longer used: set "
                            "SEFWD_MASTER_SECRET and give each VM its derived callback secret (README: Migration)")
        shared = cls.shared_from_env(env, problems)
        numbers = positive_numbers(env, (("CALLBACK_TIMEOUT_SECONDS", 5.0), ("CALLBACK_ATTEMPTS", 3.0)), problems)
        ca_bundle = ca_bundle_setting(env, "CALLBACK_CA_BUNDLE", problems)
        if problems:
            raise ValueError("remote approver settings: " + "; ".join(problems))
        return cls(
            **shared, callback_url_template=template, callback_urls=urls,
            verify=ca_bundle or True, timeout=numbers["CALLBACK_TIMEOUT_SECONDS"],
            attempts=int(numbers["CALLBACK_ATTEMPTS"]),
        )

    def callback_url(self, vm: VmIdentity) -> str:
        """The approval endpoint of the authenticated ``vm``: CALLBACK_URLS (by resourceId, then by
        name) first, else the template with every component percent-escaped, so no name can add a
        host, a path, a query or a fragment (``attacker.host/#`` stays one label)."""
        explicit = self.callback_urls.get(vm.resource_id.lower()) or self.callback_urls.get(vm.name.lower())
        if explicit:
            return explicit
        if not self.callback_url_template:
            raise LookupError(f"no callback URL for VM {vm.name!r} (not in CALLBACK_URLS, no CALLBACK_URL_TEMPLATE)")
        return self.callback_url_template.format(vm_name=quote(vm.name, safe=""), vm_lower=quote(vm.name.lower(), safe=""),
                                                 vm_dns=quote(dns_label(vm.name), safe=""))

    def callback_secret(self, vm: VmIdentity) -> str:
        """The ``whsec_`` secret ``vm``'s callback verifies: derived for it from the (first) master."""
        return streamauth.callback_secret(self.masters[0], vm.resource_id)


def open_table_state(settings: TrustSettings) -> Any:
    """fleet_state.TableState for STATE_BACKEND=table: a connection string (the table is created if
    missing), else the managed identity, whose role is on the table alone: the table must exist
    (deploy/azure/approver-state creates it)."""
    module = fleet_state_module()
    if settings.state_table_connection:
        return module.TableState.open(connection_string=settings.state_table_connection,
                                      table=settings.state_table_name)
    from azure.identity import DefaultAzureCredential

    credential = DefaultAzureCredential(managed_identity_client_id=settings.managed_identity_client_id)
    return module.TableState.open(endpoint=settings.state_table_endpoint, credential=credential,
                                  table=settings.state_table_name, create=False)


ApproveFn = Callable[..., dict[str, Any]]
# An approval to send: (EventId, note) -> {"ok", "final", "http_status", "reason"}; never raises.
SendFn = Callable[[str, str], dict[str, Any]]


@dataclass(frozen=True)
class Delivery:
    """Where one approval for an authenticated VM goes, and how."""

    target: str  # what the outcome reports (the VM name; for ARM "<resource type>/<name>")
    where: str  # for logs: the callback URL or the ARM path
    send: SendFn


class Route(Protocol):
    """How an approval reaches the VM; every trust decision is RemoteApprover's, never the route's."""

    name: str

    def delivery(self, vm: VmIdentity) -> Delivery:
        """The delivery to the authenticated ``vm`` (built only from its identity); LookupError if none."""
        ...


class CallbackRoute:
    """APPROVAL_ROUTE=callback: a signed approval to the VM's own callback, with its derived secret."""

    name = "callback"

    def __init__(self, settings: Settings, session: requests.Session, approve: ApproveFn) -> None:
        self.settings = settings
        self.session = session
        self._approve = approve

    def delivery(self, vm: VmIdentity) -> Delivery:
        url = self.settings.callback_url(vm)

        def send(event_id: str, note: str) -> dict[str, Any]:
            return self._approve(url, self.settings.callback_secret(vm), [event_id], self.settings.approver_name, note,
                                 resource_id=vm.resource_id, timeout=self.settings.timeout, session=self.session,
                                 verify=self.settings.verify, attempts=self.settings.attempts)
        return Delivery(vm.name, url, send)


class RemoteApprover:
    """Act only on authenticated records, each once; approve an event only on the VM that sent the
    record, and only when that VM is named in the event and is its leader. The one decision path of
    both routes: the route only delivers."""

    def __init__(self, settings: TrustSettings, *, route: Route | None = None, deduper: Deduper | None = None,
                 seen: SeenRecords | None = None, session: requests.Session | None = None,
                 approve: ApproveFn = approver_client.approve) -> None:
        self.settings = settings
        # Retention beyond the max age: a record older than that is refused as stale before the lookup.
        retention = 2 * settings.record_max_age + 600
        self.state: Any = None
        self.seen: Any
        self.deduper: Any
        self.outcomes: Any
        if settings.state_backend == "table" and seen is None and deduper is None:
            # Every instance of the app shares these: each record, key and fold is decided once fleet-wide.
            self.state = open_table_state(settings)
            self.seen = self.state.claims("seen", lease=settings.state_lease, retention=retention)
            self.deduper = self.state.claims("dedupe", lease=settings.state_lease, retention=Deduper.ttl)
            self.outcomes = self.state.folds("outcome", retention=OutcomeFolder.ttl)
        else:
            self.deduper = deduper or Deduper()
            self.seen = seen or SeenRecords(settings.seen_records_path, retention=retention)
            self.outcomes = OutcomeFolder()
        self.untrusted = 0  # records refused for a missing or wrong sefwdauth (also logged)
        if route is None:
            if not isinstance(settings, Settings):
                raise TypeError("the callback route needs the callback Settings")
            # One pooled session per function instance; requests' Session is safe for this use.
            route = CallbackRoute(settings, session or requests.Session(), approve)
        self.route = route

    def handle(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Decide one record; returns what happened (also logged)."""
        raw = record.get("data")
        data: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
        outcome: dict[str, Any] = {"id": record.get("id"), "type": record.get("type"), "EventId": data.get("EventId"),
                                   "route": self.route.name}
        vm = authenticated_vm(record, self.settings.masters)
        if vm is None:
            # Forged, altered, signed with another VM's key, unsigned, or not from a VM: nobody vouches for it.
            self.untrusted += 1
            log.warning("untrusted record %.80r from %.200r: no valid sefwdauth for its source (ignored)",
                        record.get("id"), record.get("source"))
            outcome.update(decision="untrusted", reason="unauthenticated")
            return outcome
        outcome["vm"] = vm.resource_id
        terminal = record_outcome(record)
        if terminal is not None:
            return self._fold(record, data, vm, terminal, outcome)
        approve, reason = should_approve(record, self.settings.policy)
        outcome["reason"] = reason
        if not approve:
            outcome["decision"] = "skip"
            return outcome
        refusal = self._scope_problem(record, vm)
        if refusal is not None:
            outcome.update(decision="skip", reason=refusal)
            return outcome
        key = dedupe_key(vm, record)
        outcome["eventkey"] = key
        seen_key = f"{vm.resource_id.lower()}|{record.get('id')}"
        if not self.seen.claim(seen_key):
            outcome["decision"] = "replayed"
            return outcome
        if not self.deduper.claim(key):
            outcome["decision"] = "duplicate"
            return outcome
        try:
            delivery = self.route.delivery(vm)
        except LookupError as exc:
            log.error("%s", exc)
            self.seen.release(seen_key)
            self.deduper.release(key)
            outcome.update(decision="failed", target=vm.name, detail=str(exc))
            return outcome
        outcome["target"] = delivery.target
        if self.settings.dry_run:
            log.info("DRY_RUN: would approve %s (%s) via %s %s", data.get("EventId"), reason, self.route.name,
                     delivery.where)
            self.seen.settle(seen_key)
            self.deduper.settle(key)
            outcome["decision"] = "dry_run"
            return outcome
        try:
            answer = delivery.send(str(data["EventId"]), f"{reason} (record {record.get('id')})")
        except BaseException:  # a bug or an interruption: the claim must not outlive it in this process
            self.deduper.release(key)
            self.seen.release(seen_key)
            raise
        if answer.get("final", True):
            self.seen.settle(seen_key)  # acted on for good (a kill before this line: the next copy takes over)
            self.deduper.settle(key)
        else:
            # Unreachable, throttled or 5xx after every attempt: forget the keys so a redelivery or
            # the VM's next record tries again. The event still proceeds at NotBefore.
            self.deduper.release(key)
            self.seen.release(seen_key)
        outcome.update(
            decision="approved" if answer.get("ok") else "refused" if answer.get("final", True) else "failed",
            answer=answer.get("reason"), http_status=answer.get("http_status"),
        )
        return outcome

    def _fold(self, record: Mapping[str, Any], data: Mapping[str, Any], vm: VmIdentity, terminal: str,
              outcome: dict[str, Any]) -> dict[str, Any]:
        """A terminal record moves only its own VM's outcome of an event that names that VM."""
        event_id = data.get("EventId")
        resources = data.get("Resources")
        if not isinstance(event_id, str) or not event_id:
            outcome.update(decision="skip", reason="no_event_id")
        elif not isinstance(resources, list) or not vm.named_in(resources):
            outcome.update(decision="skip", reason="not_this_vm")
        else:
            # Keyed by the authenticated VM: another VM's report about this EventId can never
            # overwrite, pre-empt or weaken this VM's (one VM's lie moves only its own row).
            key = f"{vm.resource_id.lower()}|{event_id.lower()}"
            value, changed = self.outcomes.fold(key, terminal, FOLD_ORDER[terminal])
            outcome.update(decision="outcome" if changed else "duplicate", reason=f"outcome_{value}",
                           eventkey=key, outcome=value)
        return outcome

    def purge(self) -> int:
        """Delete the shared table's rows past their retention (``STATE_BACKEND=table``: a timer calls this
        hourly; the SQLite file purges itself as it claims); returns how many went."""
        return int(self.state.purge()) if self.state is not None else 0

    def close(self) -> None:
        """Close the shared state (table client or SQLite file)."""
        if self.state is not None:
            self.state.close()
        else:
            self.seen.close()

    def _scope_problem(self, record: Mapping[str, Any], vm: VmIdentity) -> str | None:
        """Why the authenticated ``vm`` may not have this event approved through us, or None.

        A VM speaks only for itself: it must be named in the event's Resources (the approval is
        sent to it, and IMDS lets any VM in Resources approve the event anyway), and it must be the
        event's leader, so exactly one VM's record of a shared event leads to an approval.
        """
        age = record_age(record)
        if age is None or age > self.settings.record_max_age or age < -300:
            return "stale_record"
        raw = record.get("data")
        resources = raw.get("Resources") if isinstance(raw, Mapping) else None
        if not isinstance(resources, list) or not vm.named_in(resources):
            return "not_this_vm"
        if target_vm(record).lower() != vm.name.lower():
            return "not_the_leader"
        return None

    def handle_many(self, records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        outcomes = [self.handle(record) for record in records]
        for o in outcomes:
            if o["decision"] not in ("skip", "untrusted"):
                log.info("record %s %s event %s: %s (%s) via %s target=%s http=%s", o.get("id"), o.get("type"),
                         o.get("EventId"), o["decision"], o["reason"], o["route"], o.get("target"),
                         o.get("http_status"))
        return outcomes


def parse_records(body: bytes, content_type: str) -> list[dict[str, Any]]:
    """CloudEvents in structured mode: one object, or an array for the batch content type."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media not in (SINGLE, BATCH, PLAIN):
        raise TypeError(f"unsupported content type {media!r}")
    parsed = json.loads(body)
    if media == SINGLE and not isinstance(parsed, dict):
        raise ValueError(f"{SINGLE} must be one JSON object")
    if media == BATCH and not isinstance(parsed, list):
        raise ValueError(f"{BATCH} must be a JSON array")
    records = parsed if isinstance(parsed, list) else [parsed]
    if not all(isinstance(r, dict) for r in records):
        raise ValueError("every record must be a JSON object")
    return records


def verify_webhook(body: bytes, headers: Mapping[str, str], secrets: Iterable[str]) -> bool:
    """Standard Webhooks check against any of ``secrets`` (two during a rotation)."""
    lowered = {k.lower(): v for k, v in headers.items()}
    for secret in secrets:
        try:
            Webhook(secret).verify(body, lowered, json_parse=False)
            return True
        except Exception:  # noqa: BLE001 - the package raises several types for malformed headers
            continue
    return False


def handle_webhook(approver: RemoteApprover, body: bytes, headers: Mapping[str, str]) -> tuple[int, dict[str, Any]]:
    """A request of the sefwd webhook sink -> (HTTP status, JSON answer)."""
    if not approver.settings.webhook_secrets:
        log.error("SEFWD_WEBHOOK_SECRET is not set: refusing every webhook request")
        return 500, {"error": "webhook_secret_not_configured"}
    if len(body) > MAX_WEBHOOK_BODY:
        return 413, {"error": "body_too_large"}
    if not verify_webhook(body, headers, approver.settings.webhook_secrets):
        log.warning("webhook request refused: bad or missing Standard Webhooks signature")
        return 401, {"error": "bad_signature"}
    return handle_records_request(approver, body, headers)


def handle_records_request(approver: RemoteApprover, body: bytes, headers: Mapping[str, str]) -> tuple[int, dict[str, Any]]:
    """Records posted by a caller the Functions host authenticated (the webhook after its signature
    check; the Logic App with the function key on ``approve``) -> (HTTP status, JSON answer).

    The caller is never trusted for the records: each is decided by ``approver.handle_many``, the
    same code the Event Hubs trigger runs, so only records whose ``sefwdauth`` verifies act, each
    once. The answer holds one outcome per record: ``decision``, ``reason``, and for an
    authenticated record ``vm`` (the resource ID its key was derived for) and ``target``.
    """
    if len(body) > MAX_WEBHOOK_BODY:
        return 413, {"error": "body_too_large"}
    content_type = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
    try:
        records = parse_records(body, content_type)
    except TypeError as exc:
        return 415, {"error": "unsupported_media_type", "detail": str(exc)}
    except ValueError as exc:
        return 400, {"error": "malformed_body", "detail": str(exc)}
    # Always 200 for a valid request, even when an approval failed: a non-2xx would make the sink
    # retry and stall this VM's record stream behind an approver problem. Failures are logged and
    # in the answer, and the next copy of the record (from another VM, or a later update) gets
    # another chance.
    outcomes = approver.handle_many(records)
    return 200, {"received": len(records), "outcomes": outcomes}


def records_from_event_bodies(bodies: Iterable[bytes]) -> list[dict[str, Any]]:
    """Event Hubs event bodies (one CloudEvents JSON each, or an array) -> records; bad ones logged."""
    records: list[dict[str, Any]] = []
    for body in bodies:
        try:
            parsed = json.loads(body)
        except ValueError as exc:
            log.warning("skipping an event that is not JSON: %s", exc)
            continue
        for item in parsed if isinstance(parsed, list) else [parsed]:
            if isinstance(item, dict):
                records.append(item)
            else:
                log.warning("skipping an event that is not a JSON object")
    return records
