"""The fleet side's shared table reached the way it is in Azure: ``STATE_TABLE_ENDPOINT`` and the Function
app's managed identity (no connection string), through ``DefaultAzureCredential``.

Peers: Azurite over HTTPS (a throwaway CA, trusted through ``REQUESTS_CA_BUNDLE``) with its bearer-token
check on (``--oauth basic``: a JWT within its lifetime, from a Microsoft issuer, for a storage audience), and
a local App Service managed-identity endpoint (``IDENTITY_ENDPOINT`` / ``IDENTITY_HEADER``, what a Function
app gets) that issues such tokens. Real SDK clients (azure-identity, azure-data-tables) throughout.
"""
from __future__ import annotations

import base64
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from benchmarks.peers.azurite_peer import AzuritePeer
from benchmarks.peers.webhook_receiver import ReceivedRequest, Reply, WebhookReceiver
from forwarder.emulator.arm_certs import make_arm_certificate
from tests.azurite import PYTESTMARK, table_name
from tests.fleet import APP_DIR, MASTER_SECRET

sys.path.insert(0, str(APP_DIR.parent / "shared"))
# Appended, as tests/integration/test_platform_events.py does: `function_app` by name stays the remote approver's.
if str(APP_DIR.parent / "platform-events") not in sys.path:
    sys.path.append(str(APP_DIR.parent / "platform-events"))
import fleet_state  # noqa: E402
import pipeline  # noqa: E402
from reconcile_state import TAKEN, state_from_env  # noqa: E402

pytestmark = PYTESTMARK
STORAGE = "https://storage.azure.com"
IDENTITY_SECRET = "identity-header-for-tests"  # what the Functions host puts in IDENTITY_HEADER


def _b64(value: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()


class AppServiceIdentity:
    """The App Service / Functions managed-identity endpoint (api-version 2019-08-01) on 127.0.0.1, on the
    project's WebhookReceiver: a JWT-shaped token per request, for the requested resource unless
    ``audience`` overrides it (a wrong one)."""

    def __init__(self) -> None:
        self.audience: str | None = None
        self.receiver = WebhookReceiver(self._answer).start()
        self.url = self.receiver.url_for("/msi/token")

    @property
    def requests(self) -> list[dict[str, str]]:
        """The query of every token request."""
        return [{k: v[0] for k, v in parse_qs(urlsplit(r.path).query).items()} for r in self.receiver.requests]

    def _answer(self, request: ReceivedRequest) -> Reply:
        query = {k: v[0] for k, v in parse_qs(urlsplit(request.path).query).items()}
        if request.header("X-IDENTITY-HEADER") != IDENTITY_SECRET or "resource" not in query:
            return Reply(400, {"Content-Type": "application/json"}, b'{"error": "invalid_request"}')
        now = int(time.time())
        claims = {"aud": self.audience or query["resource"], "iss": "https://sts.windows.net/tenant-0/",
                  "iat": now - 60, "nbf": now - 60, "exp": now + 3600, "oid": "function-app-identity"}
        token = f'{_b64({"alg": "RS256", "typ": "JWT"})}.{_b64(claims)}.c2lnbmF0dXJl'
        body = {"access_token": token, "expires_on": str(now + 3600), "resource": query["resource"],
                "token_type": "Bearer"}
        return Reply(200, {"Content-Type": "application/json"}, json.dumps(body).encode())

    def close(self) -> None:
        self.receiver.stop()


@pytest.fixture(scope="module")
def secure_azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AzuritePeer, Path]]:
    cert = make_arm_certificate(tmp_path_factory.mktemp("azurite-tls"))
    with AzuritePeer(log=tmp_path_factory.mktemp("azurite") / "azurite.log", tls=(cert.cert, cert.key),
                     oauth=True) as peer:
        yield peer, cert.ca


@pytest.fixture()
def identity(monkeypatch: pytest.MonkeyPatch, secure_azurite: tuple[AzuritePeer, Path]) -> Iterator[AppServiceIdentity]:
    """The environment of a Function app with a managed identity, and nothing else that could sign in."""
    endpoint = AppServiceIdentity()
    for name in ("AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET", "AZURE_FEDERATED_TOKEN_FILE",
                 "MSI_ENDPOINT", "IDENTITY_SERVER_THUMBPRINT", "AZURE_POD_IDENTITY_AUTHORITY_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("IDENTITY_ENDPOINT", endpoint.url)
    monkeypatch.setenv("IDENTITY_HEADER", IDENTITY_SECRET)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(secure_azurite[1]))
    try:
        yield endpoint
    finally:
        endpoint.close()


def _made_by_operator(peer: AzuritePeer, table: str) -> Any:
    """The table as deploy/azure/approver-state leaves it: created, the identity's role on it alone."""
    from azure.data.tables import TableServiceClient

    service = TableServiceClient.from_connection_string(peer.connection_string)
    service.create_table(table)
    return service.get_table_client(table)


def test_the_remote_approver_claims_settles_and_purges_with_the_managed_identity(secure_azurite, identity):
    peer, _ = secure_azurite
    table = table_name()
    admin = _made_by_operator(peer, table)
    settings = pipeline.Settings.from_env({
        "SEFWD_MASTER_SECRET": MASTER_SECRET, "CALLBACK_URL_TEMPLATE": "https://{vm_name}.example.internal:8443/approvals",
        "STATE_BACKEND": "table", "STATE_TABLE_ENDPOINT": peer.endpoint, "STATE_TABLE_NAME": table})
    state = pipeline.open_table_state(settings)
    try:
        claims = state.claims("seen", lease=60, retention=3600)
        assert claims.claim("vm-a|rec-1") and not claims.claim("vm-a|rec-1")
        claims.settle("vm-a|rec-1")
        assert claims.status("vm-a|rec-1") == fleet_state.SETTLED
        assert state.purge(now=time.time() + 3601) == 1  # the purge's query and delete, as the identity too
    finally:
        state.close()
    assert list(admin.list_entities()) == []
    asked = identity.requests
    assert asked and all(q["resource"] == STORAGE and q["api-version"] == "2019-08-01" for q in asked)
    assert len(asked) == 1  # one token, cached for its lifetime across every request


def test_the_platform_events_state_decides_with_the_managed_identity(secure_azurite, identity):
    peer, _ = secure_azurite
    table = table_name()
    admin = _made_by_operator(peer, table)
    state = state_from_env({"STATE_BACKEND": "table", "STATE_TABLE_ENDPOINT": peer.endpoint + "/",
                            "STATE_TABLE_NAME": table})
    try:
        assert state.claim("EV-1", "missed|vm1") == TAKEN
        state.settle("EV-1", "missed|vm1")
        assert state.update("EV-1", "report|vm1", lambda v: {"seen": True}) == {"seen": True}
    finally:
        state.close()
    assert len(list(admin.list_entities())) == 2 and identity.requests


def test_a_token_for_another_audience_is_refused_and_named(secure_azurite, identity):
    """Azurite checks the bearer token (so the tests above prove the identity path): a token for Azure
    Resource Manager is refused, and the error says the authentication failed, without the token."""
    from azure.core.exceptions import HttpResponseError

    peer, _ = secure_azurite
    table = table_name()
    _made_by_operator(peer, table)
    identity.audience = "https://management.azure.com/"
    state = state_from_env({"STATE_BACKEND": "table", "STATE_TABLE_ENDPOINT": peer.endpoint, "STATE_TABLE_NAME": table})
    try:
        with pytest.raises(HttpResponseError) as refused:
            state.claim("EV-1", "missed|vm1")
    finally:
        state.close()
    assert refused.value.status_code in (401, 403)
    assert "audience" in str(refused.value).lower() and "eyJ" not in str(refused.value)
