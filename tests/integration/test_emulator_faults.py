"""Fault injection of the IMDS emulator, observed by a real HTTP client on loopback."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tests.agent import poll_until as wait_until
import requests

from forwarder.emulator import Emulator, SpecError

SE = "/metadata/scheduledevents"
H = {"Metadata": "true"}
P = {"api-version": "2020-07-01"}




@pytest.fixture
def http() -> Iterator[requests.Session]:
    s = requests.Session()
    s.trust_env = False
    yield s
    s.close()


@pytest.fixture
def emu() -> Iterator[Emulator]:
    with Emulator(vms=["a", "b"], rate_limit=None) as e:
        yield e


def get(http: requests.Session, base: str, **kw: object) -> requests.Response:
    return http.get(base + SE, params=P, headers=H, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("status", [500, 410, 503])
def test_status_burst_then_normal(emu: Emulator, http: requests.Session, status: int) -> None:
    emu.inject_fault("status", status=status, count=2)
    codes = [get(http, emu.url).status_code for _ in range(3)]
    assert codes == [status, status, 200]
    assert emu.stats()["requests"]["a"]["by_status"] == {str(status): 2, "200": 1}


def test_429_fault_carries_retry_after(emu: Emulator, http: requests.Session) -> None:
    emu.inject_fault("status", status=429, retry_after=7)
    r = get(http, emu.url)
    assert (r.status_code, r.headers["Retry-After"]) == (429, "7")
    emu.inject_fault("status", status=429)
    assert get(http, emu.url).headers["Retry-After"] == "1"  # a default, so clients can honour one
    emu.inject_fault("status", status=500)
    assert "Retry-After" not in get(http, emu.url).headers


def test_slow_response(emu: Emulator, http: requests.Session) -> None:
    emu.inject_fault("slow", delay=0.5)
    t0 = time.monotonic()
    r = get(http, emu.url)
    assert r.status_code == 200 and time.monotonic() - t0 >= 0.5
    with pytest.raises(requests.Timeout):
        emu.inject_fault("slow", delay="1s")
        get(http, emu.url, timeout=0.2)


def test_hang_outlasts_the_client_timeout(emu: Emulator, http: requests.Session) -> None:
    emu.inject_fault("hang", delay=2)
    with pytest.raises(requests.ReadTimeout):
        get(http, emu.url, timeout=0.3)
    assert get(http, emu.url, timeout=5).status_code == 200  # on a fresh connection


def test_hang_then_close_without_answer(emu: Emulator, http: requests.Session) -> None:
    emu.inject_fault("hang", delay=0.3)
    t0 = time.monotonic()
    with pytest.raises(requests.ConnectionError):
        get(http, emu.url, timeout=5)
    assert time.monotonic() - t0 >= 0.3
    assert emu.stats()["requests"]["a"]["by_status"]["hang"] == 1


def test_hang_until_stop_is_released_by_stop(http: requests.Session) -> None:
    emu = Emulator(rate_limit=None).start()
    emu.inject_fault("hang")  # no delay: hold until the emulator stops
    outcome: list[BaseException | int] = []

    def client() -> None:
        try:
            outcome.append(get(http, emu.url, timeout=10).status_code)
        except requests.RequestException as exc:
            outcome.append(exc)

    t = threading.Thread(target=client)
    t.start()
    assert wait_until(lambda: emu.stats()["faults_pending"] == [])  # the request is being held
    t0 = time.monotonic()
    emu.stop()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - t0 < 5
    assert isinstance(outcome[0], requests.ConnectionError)


def test_drop_closes_the_connection(emu: Emulator, http: requests.Session) -> None:
    emu.inject_fault("drop")
    with pytest.raises(requests.ConnectionError):
        get(http, emu.url, timeout=5)


def test_malformed_json(emu: Emulator, http: requests.Session) -> None:
    emu.inject_fault("malformed")
    r = get(http, emu.url)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/json")
    with pytest.raises(ValueError):
        r.json()


def test_html_error_page(emu: Emulator, http: requests.Session) -> None:
    emu.inject_fault("html", status=502, count=1)
    emu.inject_fault("html")
    r = get(http, emu.url)
    assert r.status_code == 502 and r.headers["Content-Type"].startswith("text/html") and "<html>" in r.text
    r = get(http, emu.url)
    assert r.status_code == 200 and r.text.lstrip().startswith("<!DOCTYPE html>")


def test_faults_are_scoped_by_vm_path_and_method(emu: Emulator, http: requests.Session) -> None:
    emu.inject_fault("status", status=500, vm="b")
    emu.inject_fault("status", status=503, path="token")
    emu.inject_fault("status", status=500, method="POST")
    assert get(http, emu.url).status_code == 200  # VM a, GET
    assert get(http, emu.vm_url("b")).status_code == 500
    token = http.get(emu.url + "/metadata/identity/oauth2/token",
                     params={"api-version": "2018-02-01", "resource": "x"}, headers=H)
    assert token.status_code == 503
    assert http.post(emu.url + SE, params=P, headers=H, data="{}").status_code == 500
    assert emu.stats()["faults_pending"] == []


def test_fault_on_any_path(emu: Emulator, http: requests.Session) -> None:
    emu.inject_fault("status", status=500, path="any", count=2)
    assert http.get(emu.url + "/metadata/versions", headers=H).status_code == 500
    assert http.get(emu.url + "/metadata/instance/compute", params={"api-version": "2021-02-01"},
                    headers=H).status_code == 500
    assert get(http, emu.url).status_code == 200


def test_invalid_fault_specs_are_refused(emu: Emulator) -> None:
    for kind, opts in (("nope", {}), ("slow", {}), ("status", {"status": 42}), ("status", {"count": 0}),
                       ("status", {"path": "elsewhere"}), ("status", {"colour": "red"})):
        with pytest.raises(SpecError):
            emu.inject_fault(kind, **opts)
