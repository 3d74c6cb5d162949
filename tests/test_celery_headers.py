"""Splitting a Celery task message's headers between ext.celery.headers and Envelope headers."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from celery_ext.headers import CELERY_HEADERS, W3C_HEADERS, split_headers, unsaid_headers

FIELDS = frozenset({"task", "id", "retries", "trace_id", "expires"})

names = st.one_of(
    st.sampled_from(sorted(CELERY_HEADERS | W3C_HEADERS)),
    st.sampled_from(["X-Tenant", "x-count", "TraceParent", "BAGGAGE", "custom", "x", "x_"]),
    st.text(max_size=6),
)
values = st.one_of(st.text(max_size=4), st.integers(), st.none(), st.lists(st.integers()),
                   st.sampled_from(["py", "()", "t-1", 0, False, [None, None], (None, None), {}]))
UNSAID = unsaid_headers("t-1")


@given(st.dictionaries(names, values, max_size=12))
def test_split_headers_is_the_mapping_rule(headers: dict[str, Any]) -> None:
    """String headers named x-* or W3C (any case) are Envelope headers; the others,
    less the field headers (and those with their unsaid value and type), are kept; both
    in the message's order."""
    def envelope_header(name: str, value: Any) -> bool:
        lowered = name.lower()
        return isinstance(value, str) and (lowered.startswith("x-") or lowered in W3C_HEADERS)

    def unsaid(name: str, value: Any) -> bool:
        return name in UNSAID and type(value) is type(UNSAID[name]) and value == UNSAID[name]

    kept, envelope = split_headers(headers, FIELDS)
    assert list(envelope.items()) == [(k, v) for k, v in headers.items() if envelope_header(k, v)]
    assert list(kept.items()) == [(k, v) for k, v in headers.items()
                                  if k not in FIELDS and not envelope_header(k, v)]
    compact, same = split_headers(headers, FIELDS, UNSAID)
    assert same == envelope
    assert list(compact.items()) == [(k, v) for k, v in kept.items() if not unsaid(k, v)]


def test_celery_names_are_never_envelope_headers() -> None:
    headers = {"task": "t", "id": "i", "argsrepr": "()", "x-tenant": "acme",
               "tracestate": "k=v", "X-Count": 3}
    kept, envelope = split_headers(headers, FIELDS)
    assert envelope == {"x-tenant": "acme", "tracestate": "k=v"}
    assert kept == {"argsrepr": "()", "X-Count": 3}


def test_unsaid_headers_are_fresh_on_every_call() -> None:
    first = unsaid_headers("t-1")
    first["stamps"]["k"] = "v"
    first["timelimit"][0] = 5
    assert unsaid_headers("t-1")["stamps"] == {} and unsaid_headers("t-1")["timelimit"] == [
        None, None]
