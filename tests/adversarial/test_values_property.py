"""Properties of the config value toolkit and the redaction rule over arbitrary input (hypothesis)."""
from __future__ import annotations

import math
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.common.logs import redact
from forwarder.common.values import duration, parse_duration, parse_size, size
from tests.conftest import examples

ANY_VALUE = st.one_of(
    st.text(), st.floats(allow_nan=True, allow_infinity=True), st.integers(), st.booleans(), st.none(),
    st.text(alphabet="0123456789.eE+-_ xnaifmshdKMGBi\r\n\t", max_size=30),
    st.lists(st.integers(), max_size=2),
)


@pytest.mark.slow  # a large property run
@settings(max_examples=examples(2000), deadline=None)
@given(ANY_VALUE)
def test_a_duration_is_finite_bounded_or_a_value_error(value):
    try:
        seconds = duration(0.0, 86400.0)(value)
    except ValueError:
        return
    assert isinstance(seconds, float) and math.isfinite(seconds) and 0.0 <= seconds <= 86400.0


@pytest.mark.slow  # a large property run
@settings(max_examples=examples(2000), deadline=None)
@given(ANY_VALUE)
def test_a_size_is_a_bounded_int_or_a_value_error(value):
    try:
        number = size(0, 1024**3)(value)
    except ValueError:
        return
    assert type(number) is int and 0 <= number <= 1024**3


@pytest.mark.slow  # a large property run
@settings(max_examples=examples(1000), deadline=None)
@given(ANY_VALUE)
def test_raw_parsers_raise_only_value_error(value):
    for parse in (parse_duration, parse_size):
        try:
            result = parse(value)
        except ValueError:
            continue
        assert math.isfinite(result) and result >= 0


SECRET_CHARS = string.ascii_letters + string.digits + "-_.~%+/="


@pytest.mark.slow  # a large property run
@settings(max_examples=examples(2000), deadline=None)
@given(
    scheme=st.sampled_from(["http", "https", "sb", "wss"]),
    secret=st.text(alphabet=SECRET_CHARS, min_size=8, max_size=40).map(lambda s: "Zq9" + s),
    name=st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=8).filter(lambda n: n != "api"),
    before=st.text(max_size=40), after=st.text(max_size=40),
    where=st.sampled_from(["query", "userinfo", "request-line"]),
)
def test_redact_hides_query_values_and_userinfo_anywhere_in_a_line(scheme, secret, name, before, after, where):
    if where == "query":
        url = f"{scheme}://host.example/p?{name}={secret}"
    elif where == "userinfo":
        url = f"{scheme}://user:{secret}@host.example/p"
    else:
        url = f'"POST /p?{name}={secret} HTTP/1.1"'
    line = f"{before} {url} {after}"
    shown = redact(line)
    assert secret not in shown
    assert redact(shown) == shown
