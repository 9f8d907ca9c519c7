"""Standard Webhooks signing: the published vector, the reference package both ways, and strictness."""
from __future__ import annotations

import base64
import email.message
from datetime import datetime, timezone

import pytest
from requests.structures import CaseInsensitiveDict
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from forwarder.errors import ConfigError
from forwarder.common.signing import (
    SignatureError,
    generate_secret,
    load_secret,
    parse_secret,
    sign,
    sign_headers,
    verify,
)

VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TS = 1614265330
VECTOR_BODY = b'{"test": 2432232314}'
VECTOR_SIG = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def vector_headers(signature: str = VECTOR_SIG, ts: object = VECTOR_TS, msg_id: str = VECTOR_ID) -> dict[str, str]:
    return {"webhook-id": msg_id, "webhook-timestamp": str(ts), "webhook-signature": signature}


def reason(exc_info: pytest.ExceptionInfo[SignatureError]) -> str:
    return exc_info.value.reason


# -- published vector ---------------------------------------------------------------------------
def test_published_vector_signs_exactly():
    key = parse_secret(VECTOR_SECRET)
    assert sign(key, VECTOR_ID, VECTOR_TS, VECTOR_BODY) == VECTOR_SIG


def test_published_vector_verifies_and_returns_id():
    key = parse_secret(VECTOR_SECRET)
    assert verify(key, vector_headers(), VECTOR_BODY, now=VECTOR_TS + 10) == VECTOR_ID


def test_published_vector_body_change_fails():
    key = parse_secret(VECTOR_SECRET)
    with pytest.raises(SignatureError) as e:
        verify(key, vector_headers(), b'{"test": 2432232315}', now=VECTOR_TS)
    assert reason(e) == "bad_signature"


@pytest.mark.parametrize("field", ["msg_id", "ts"])
def test_published_vector_id_or_timestamp_change_fails(field):
    key = parse_secret(VECTOR_SECRET)
    headers = vector_headers(msg_id="msg_other") if field == "msg_id" else vector_headers(ts=VECTOR_TS + 1)
    with pytest.raises(SignatureError) as e:
        verify(key, headers, VECTOR_BODY, now=VECTOR_TS)
    assert reason(e) == "bad_signature"


# -- the reference package, both directions ------------------------------------------------------
def test_reference_package_verifies_our_headers():
    secret = generate_secret()
    key = parse_secret(secret)
    body = b'{"specversion":"1.0","id":"abc","data":{"x":"\xc3\xa9"}}'
    headers = sign_headers(key, "msg_1", body)
    assert Webhook(secret).verify(body, headers) == {"specversion": "1.0", "id": "abc", "data": {"x": "é"}}


def test_reference_package_rejects_our_headers_with_other_secret():
    key = parse_secret(generate_secret())
    headers = sign_headers(key, "msg_1", b"{}")
    with pytest.raises(WebhookVerificationError):
        Webhook(generate_secret()).verify(b"{}", headers)


def test_we_verify_reference_package_signature():
    secret = generate_secret()
    wh = Webhook(secret)
    ts = 1_700_000_000
    body = b'{"a": [1, 2, 3]}'
    signature = wh.sign("msg_ref", datetime.fromtimestamp(ts, tz=timezone.utc), body.decode())
    headers = vector_headers(signature=signature, ts=ts, msg_id="msg_ref")
    assert verify(parse_secret(secret), headers, body, now=ts) == "msg_ref"


def test_reference_package_agrees_on_published_vector():
    wh = Webhook(VECTOR_SECRET)
    assert wh.sign(VECTOR_ID, datetime.fromtimestamp(VECTOR_TS, tz=timezone.utc), VECTOR_BODY.decode()) == VECTOR_SIG


# -- timestamps ----------------------------------------------------------------------------------
@pytest.mark.parametrize("offset", [-300, -299.5, 0, 299.9, 300])
def test_tolerance_edges_accepted(offset):
    key = parse_secret(VECTOR_SECRET)
    assert verify(key, vector_headers(), VECTOR_BODY, now=VECTOR_TS + offset) == VECTOR_ID


def test_stale_timestamp():
    key = parse_secret(VECTOR_SECRET)
    with pytest.raises(SignatureError) as e:
        verify(key, vector_headers(), VECTOR_BODY, now=VECTOR_TS + 300.001)
    assert reason(e) == "stale_timestamp"


def test_future_timestamp():
    key = parse_secret(VECTOR_SECRET)
    with pytest.raises(SignatureError) as e:
        verify(key, vector_headers(), VECTOR_BODY, now=VECTOR_TS - 301)
    assert reason(e) == "future_timestamp"


def test_custom_tolerance():
    key = parse_secret(VECTOR_SECRET)
    assert verify(key, vector_headers(), VECTOR_BODY, now=VECTOR_TS + 30, tolerance=30) == VECTOR_ID
    with pytest.raises(SignatureError) as e:
        verify(key, vector_headers(), VECTOR_BODY, now=VECTOR_TS + 31, tolerance=30)
    assert reason(e) == "stale_timestamp"


@pytest.mark.parametrize("ts", ["", "abc", "1614265330.0", "-1614265330", "+1614265330", "1e9", " ", "0x60383"])
def test_bad_timestamp(ts):
    key = parse_secret(VECTOR_SECRET)
    headers = vector_headers(ts=ts)
    with pytest.raises(SignatureError) as e:
        verify(key, headers, VECTOR_BODY, now=VECTOR_TS)
    assert reason(e) in ("bad_timestamp", "missing_headers")
    if ts.strip():
        assert reason(e) == "bad_timestamp"


def test_sign_headers_uses_now_and_id():
    key = parse_secret(VECTOR_SECRET)
    headers = sign_headers(key, VECTOR_ID, VECTOR_BODY, now=VECTOR_TS + 0.99)
    assert headers == {
        "webhook-id": VECTOR_ID,
        "webhook-timestamp": str(VECTOR_TS),
        "webhook-signature": VECTOR_SIG,
    }


# -- multiple signatures and key rotation --------------------------------------------------------
def test_any_of_several_signatures_matches():
    key = parse_secret(VECTOR_SECRET)
    other = sign(parse_secret(generate_secret()), VECTOR_ID, VECTOR_TS, VECTOR_BODY)
    for value in (f"{other} {VECTOR_SIG}", f"{VECTOR_SIG} {other}", f"v1a,abcd  {VECTOR_SIG}"):
        assert verify(key, vector_headers(signature=value), VECTOR_BODY, now=VECTOR_TS) == VECTOR_ID


def test_rotation_any_of_several_keys():
    old, new = parse_secret(VECTOR_SECRET), parse_secret(generate_secret())
    assert verify([new, old], vector_headers(), VECTOR_BODY, now=VECTOR_TS) == VECTOR_ID
    headers = sign_headers(new, "msg_2", b"x", now=VECTOR_TS)
    assert verify((old, new), headers, b"x", now=VECTOR_TS) == "msg_2"
    with pytest.raises(SignatureError) as e:
        verify([new], vector_headers(), VECTOR_BODY, now=VECTOR_TS)
    assert reason(e) == "bad_signature"


def test_only_other_versions_is_bad_signature():
    key = parse_secret(VECTOR_SECRET)
    with pytest.raises(SignatureError) as e:
        verify(key, vector_headers(signature=VECTOR_SIG.replace("v1,", "v2,")), VECTOR_BODY, now=VECTOR_TS)
    assert reason(e) == "bad_signature"


def test_no_keys_is_bad_secret():
    with pytest.raises(SignatureError) as e:
        verify([], vector_headers(), VECTOR_BODY, now=VECTOR_TS)
    assert reason(e) == "bad_secret"
    with pytest.raises(SignatureError) as e:
        verify(b"", vector_headers(), VECTOR_BODY, now=VECTOR_TS)
    assert reason(e) == "bad_secret"


# -- malformed headers ---------------------------------------------------------------------------
@pytest.mark.parametrize("missing", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_missing_header(missing):
    key = parse_secret(VECTOR_SECRET)
    headers = vector_headers()
    del headers[missing]
    with pytest.raises(SignatureError) as e:
        verify(key, headers, VECTOR_BODY, now=VECTOR_TS)
    assert reason(e) == "missing_headers"
    assert missing in str(e.value)


@pytest.mark.parametrize(
    "signature",
    [
        "v1",  # no comma
        "v1,",  # empty
        "v1,not base64!!",
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE",  # padding is required
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1O=",  # 31 bytes
        "v1,g0hM9SsE-OTPJTGt_tmIKtSyZlE3uFJELVlNIOLJ1OE=",  # urlsafe alphabet is not the standard
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=AA",  # trailing garbage
        "V1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",  # version is case-sensitive
        "g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",  # no version
    ],
)
def test_malformed_signature_is_bad_signature(signature):
    key = parse_secret(VECTOR_SECRET)
    with pytest.raises(SignatureError) as e:
        verify(key, vector_headers(signature=signature), VECTOR_BODY, now=VECTOR_TS)
    assert reason(e) == "bad_signature"


def test_headers_are_case_insensitive_in_any_mapping():
    key = parse_secret(VECTOR_SECRET)
    upper = {k.upper(): v for k, v in vector_headers().items()}
    assert verify(key, upper, VECTOR_BODY, now=VECTOR_TS) == VECTOR_ID
    assert verify(key, CaseInsensitiveDict(vector_headers()), VECTOR_BODY, now=VECTOR_TS) == VECTOR_ID
    msg = email.message.Message()
    for k, v in vector_headers().items():
        msg[k.title()] = v
    assert verify(key, msg, VECTOR_BODY, now=VECTOR_TS) == VECTOR_ID


def test_repeated_signature_headers_are_combined_and_conflicting_ids_refused():
    key = parse_secret(VECTOR_SECRET)
    other = sign(parse_secret(generate_secret()), VECTOR_ID, VECTOR_TS, VECTOR_BODY)
    msg = email.message.Message()
    msg["webhook-id"] = VECTOR_ID
    msg["webhook-timestamp"] = str(VECTOR_TS)
    msg["webhook-signature"] = other
    msg["webhook-signature"] = VECTOR_SIG
    assert verify(key, msg, VECTOR_BODY, now=VECTOR_TS) == VECTOR_ID
    msg["webhook-id"] = "msg_other"
    with pytest.raises(SignatureError) as e:
        verify(key, msg, VECTOR_BODY, now=VECTOR_TS)
    assert reason(e) == "missing_headers"


# -- secrets -------------------------------------------------------------------------------------
def test_generate_secret_round_trips_and_is_random():
    a, b = generate_secret(), generate_secret()
    assert a.startswith("whsec_") and a != b
    assert len(parse_secret(a)) == 32
    assert Webhook(a)._whsecret == parse_secret(a)


def test_parse_secret_accepts_missing_padding():
    raw = bytes(range(20))  # 20 bytes → base64 ends with one '='
    text = base64.b64encode(raw).decode()
    assert text.endswith("=")
    assert parse_secret("whsec_" + text.rstrip("=")) == raw
    assert parse_secret("  whsec_" + text + "\n") == raw


@pytest.mark.parametrize(
    "secret, fragment",
    [
        ("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "must start with 'whsec_'"),
        ("whsec_", "too short"),
        ("whsec_" + base64.b64encode(b"x" * 15).decode(), "too short"),
        ("whsec_not*base64", "not valid base64"),
        ("whsec_" + base64.urlsafe_b64encode(b"\xfb" * 24).decode(), "not valid base64"),
    ],
)
def test_parse_secret_rejects(secret, fragment):
    with pytest.raises(SignatureError) as e:
        parse_secret(secret)
    assert reason(e) == "bad_secret"
    assert fragment in str(e.value)
    # The secret itself never appears in the message (it ends up in logs).
    body = secret.removeprefix("whsec_")
    if len(body) > 4:
        assert body not in str(e.value)


def test_parse_secret_minimum_length_is_16_bytes():
    assert len(parse_secret("whsec_" + base64.b64encode(b"k" * 16).decode())) == 16


def test_load_secret_none_when_unset():
    assert load_secret({}, env={}) is None
    assert load_secret({"secret_env": None}, env={}) is None


def test_load_secret_from_env():
    assert load_secret({"secret_env": "HOOK"}, env={"HOOK": VECTOR_SECRET + "\n"}) == parse_secret(VECTOR_SECRET)


def test_load_secret_from_file_strips_whitespace(tmp_path):
    path = tmp_path / "secret"
    path.write_text(f"\n  {VECTOR_SECRET}  \n")
    assert load_secret({"secret_file": str(path)}, env={}) == parse_secret(VECTOR_SECRET)


def test_load_secret_other_prefix(tmp_path):
    path = tmp_path / "cb"
    path.write_text(VECTOR_SECRET)
    assert load_secret({"callback_secret_file": str(path)}, env={}, prefix="callback_secret") == parse_secret(
        VECTOR_SECRET
    )
    assert load_secret({"secret_file": str(path)}, env={}, prefix="callback_secret") is None


def test_load_secret_errors(tmp_path):
    bad = tmp_path / "bad"
    bad.write_text("whsec_c2hvcnQ=")  # "short"
    cases = [
        ({"secret_env": "A", "secret_file": "/x"}, {"A": VECTOR_SECRET}, "exclusive"),
        ({"secret_env": "NOPE"}, {}, "'NOPE' is not set"),
        ({"secret_env": ""}, {}, "must name an environment variable"),
        ({"secret_file": str(tmp_path / "missing")}, {}, "cannot read"),
        ({"secret_file": str(tmp_path)}, {}, "cannot read"),
        ({"secret_file": str(bad)}, {}, "too short"),
        ({"secret_env": "A"}, {"A": "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}, "must start with 'whsec_'"),
    ]
    for options, env, fragment in cases:
        with pytest.raises(ConfigError) as e:
            load_secret(options, env=env)
        assert fragment in str(e.value), (options, str(e.value))
        assert "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw" not in str(e.value)
