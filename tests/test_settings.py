"""Transport options: every key is an option of the right type, kombu's own, or refused.

Pure logic: nothing here talks to Redis (tests/test_transport_options.py runs the
same rules through real connections and workers).
"""

from __future__ import annotations

import inspect
import re
import socket
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

import kombu
import pytest
from celery.app.defaults import DEFAULTS as CELERY_DEFAULTS
from kombu.transport import redis as stock_redis
from kombu.transport import virtual

import kombu_envelope.kombu.transport
from kombu_envelope.errors import InvalidTransportOption
from kombu_envelope.settings import (
    DEFAULT_LEASE_MS,
    KOMBU_OPTIONS,
    STOCK_REDIS_OPTIONS,
    Settings,
    _accepts,
    _describe,
    option_names,
)
from kombu_envelope.store.client import RedisEndpoint, connection_kwargs, new_client

ROOT = Path(__file__).resolve().parent.parent
OPERATIONS = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")

#: Options of kombu's redis:// transport with the same name and meaning here.
SAME_AS_STOCK = ("socket_timeout", "socket_connect_timeout", "socket_keepalive",
                 "socket_keepalive_options", "retry_on_timeout", "health_check_interval",
                 "client_name", "max_connections")


def refusal(options: dict[str, Any]) -> InvalidTransportOption:
    with pytest.raises(InvalidTransportOption) as excinfo:
        Settings.from_transport_options(options)
    return excinfo.value


# ------------------------------------------------------------ known options


def test_every_field_is_an_option_and_its_default_passes_the_checks() -> None:
    defaults = Settings()
    options = {f.name: getattr(defaults, f.name) for f in fields(Settings)}
    assert option_names() == list(options)
    assert Settings.from_transport_options(options) == defaults
    assert Settings.from_transport_options(None) == defaults


def test_options_set_the_fields_of_their_name() -> None:
    settings = Settings.from_transport_options(
        {"key_prefix": "billing", "lease_ms": 5000, "gzip_min_bytes": None,
         "max_delay_s": 60, "socket_timeout": 2.5})
    assert (settings.key_prefix, settings.lease_ms, settings.gzip_min_bytes) == (
        "billing", 5000, None)
    assert (settings.max_delay_s, settings.socket_timeout) == (60, 2.5)


# ---------------------------------------------------------- unknown options


def test_a_misspelt_option_names_itself_the_closest_option_and_every_option() -> None:
    error = refusal({"key_prefix": "billing", "lease_sm": 5000})
    assert error.options == ["lease_sm"]
    message = str(error)
    assert "transport option 'lease_sm': unknown option (did you mean 'lease_ms'?)" in message
    for name in option_names():
        assert name in message


def test_an_unknown_option_with_no_close_name_lists_every_option() -> None:
    message = str(refusal({"confirm_publish": True}))
    assert "'confirm_publish': unknown option; the options of envelope:// are " in message
    assert "did you mean" not in message


def test_every_unknown_option_is_named_at_once() -> None:
    assert refusal({"lease_sm": 1, "visibility_timeout": 10, "blok_ms": 5}).options == [
        "lease_sm", "visibility_timeout", "blok_ms"]


# ------------------------------------------------------------- wrong types


@pytest.mark.parametrize(("option", "value", "rule"), [
    ("lease_ms", "abc", "must be an integer, not 'abc'"),
    ("lease_ms", True, "must be an integer, not True"),
    ("lease_ms", None, "must be an integer, not None"),
    ("block_ms", 1.5, "must be an integer, not 1.5"),
    ("max_delay_s", "60", "must be a number, not '60'"),
    ("socket_timeout", False, "must be a number or None, not False"),
    ("gzip_min_bytes", "8k", "must be an integer or None, not '8k'"),
    ("key_prefix", 3, "must be a string, not 3"),
    ("message_adapter", b"pkg:Adapter", "must be a string or None, not b'pkg:Adapter'"),
    ("socket_keepalive", "yes", "must be true or false, not 'yes'"),
    ("max_connections", "10", "must be an integer or None, not '10'"),
    ("connection_kwargs", [("ssl", True)], "must be a dict, not [('ssl', True)]"),
])
def test_a_value_of_the_wrong_type_names_the_option_and_its_type(
    option: str, value: Any, rule: str
) -> None:
    error = refusal({option: value})
    assert error.options == [option]
    assert str(error) == f"transport option {option!r}: {rule}"


@pytest.mark.parametrize(("hint", "good", "bad", "described"), [
    (float | None, [0, 2.5, None], [True, "1"], "a number or None"),
    (tuple[int, ...], [(1, 2)], [[1, 2]], "a tuple"),
    (Literal["fast", "slow"], ["fast"], ["medium", None], "'fast' or 'slow'"),
    (Literal["off"] | int, ["off", 3], ["on", 1.5], "'off' or an integer"),
])
def test_the_type_check_follows_the_field_annotation(
    hint: Any, good: list[Any], bad: list[Any], described: str
) -> None:
    """What a field added later (a duration, a mode) is checked with."""
    assert all(_accepts(hint, value) for value in good)
    assert not any(_accepts(hint, value) for value in bad)
    assert _describe(hint) == described


def test_settings_made_directly_are_checked_too() -> None:
    with pytest.raises(InvalidTransportOption, match="'lease_ms': must be an integer"):
        Settings(lease_ms="30000")  # type: ignore[arg-type]


def test_every_wrong_type_is_named_at_once() -> None:
    assert refusal({"lease_ms": "1", "block_ms": "2"}).options == ["lease_ms", "block_ms"]


# --------------------------------------------- kombu's own and redis:// options


def test_options_kombu_reads_itself_are_left_to_it() -> None:
    settings = Settings.from_transport_options(
        {name: 1 for name in KOMBU_OPTIONS} | {"lease_ms": 5000})
    assert settings.lease_ms == 5000


def test_kombu_options_cover_what_kombu_puts_into_transport_options() -> None:
    """Producer.publish(retry=True) copies its retry_policy (arguments of
    Connection.ensure) into the options; every virtual channel reads its own."""
    ensure = set(inspect.signature(kombu.Connection.ensure).parameters) - {
        "self", "obj", "fun"}
    assert ensure <= KOMBU_OPTIONS
    assert set(virtual.Channel.from_transport_options) <= KOMBU_OPTIONS
    assert set(CELERY_DEFAULTS["task_publish_retry_policy"]) <= KOMBU_OPTIONS


def test_every_option_of_the_stock_redis_transport_is_an_option_or_refused() -> None:
    """Read from kombu's redis:// channels, so an option kombu adds shows up here
    (the transport itself also reads polling_interval and reauth_check_interval)."""
    stock = (set(stock_redis.SentinelChannel.from_transport_options)
             | {"polling_interval", "reauth_check_interval"})
    names = set(option_names())
    undecided = stock - names - set(STOCK_REDIS_OPTIONS) - KOMBU_OPTIONS
    assert not undecided
    assert set(SAME_AS_STOCK) <= names
    assert not set(STOCK_REDIS_OPTIONS) & names


@pytest.mark.parametrize(("option", "instead"), [
    ("visibility_timeout", "lease_ms"),
    ("unacked_restore_interval", "lease_ms"),
    ("ack_emulation", "XACK"),
    ("global_keyprefix", "its equivalent is key_prefix"),
    ("polling_interval", "block_ms"),
    ("priority_steps", "three priority buckets"),
    ("queue_order_strategy", "every consumed queue at once"),
    ("sep", "no separator"),
    ("fanout_prefix", "every bound queue"),
    ("fanout_patterns", "whatever its routing key"),
    ("sentinel_fanout_compat", "not in PUB/SUB topics"),
])
def test_a_stock_redis_option_is_refused_with_what_to_use_instead(
    option: str, instead: str
) -> None:
    message = str(refusal({option: 1}))
    assert message.startswith(
        f"transport option {option!r}: kombu's redis:// option, not used by envelope://: ")
    assert instead in message


def test_visibility_timeout_is_refused_saying_why_no_long_one_is_needed() -> None:
    """A 12-hour visibility timeout keeps stock Redis from handing a long task to another
    worker; here a live worker's lease does that for any length, and mapping it to lease_ms
    would make a dead worker's tasks wait 12 hours."""
    message = str(refusal({"visibility_timeout": 43_200}))
    assert "a task it runs is never handed to another worker however long it takes" in message
    assert "eta/countdown tasks wait in the delayed set" in message
    assert f"set lease_ms (milliseconds, default {DEFAULT_LEASE_MS})" in message


def test_stock_options_of_the_same_meaning_reach_redis_py() -> None:
    options = {"socket_timeout": 3, "socket_connect_timeout": 2, "socket_keepalive": False,
               "socket_keepalive_options": {socket.TCP_KEEPIDLE: 60},
               "retry_on_timeout": True, "health_check_interval": 25,
               "client_name": "billing", "max_connections": 20}
    assert set(options) == set(SAME_AS_STOCK)
    settings = Settings.from_transport_options(options)
    endpoint = RedisEndpoint.from_conninfo(kombu.Connection("envelope://cache.example"))
    kwargs = connection_kwargs(endpoint, settings)
    kwargs["max_connections"] = new_client(endpoint, settings).connection_pool.max_connections
    assert {name: kwargs[name] for name in options} == options


def test_connection_kwargs_still_override_the_named_options() -> None:
    settings = Settings.from_transport_options(
        {"max_connections": 20, "connection_kwargs": {"max_connections": 50}})
    endpoint = RedisEndpoint.from_conninfo(kombu.Connection("envelope://cache.example"))
    assert new_client(endpoint, settings).connection_pool.max_connections == 50


# ------------------------------------------------------------ documentation


def option_rows(markdown: str) -> set[str]:
    """Every backquoted name in the first column of the tables of ``markdown``."""
    names: set[str] = set()
    for line in markdown.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([a-z_*]+)`", line.split("|")[1]))
    return names


def test_every_option_and_every_refused_stock_option_is_in_the_operations_guide() -> None:
    rows = option_rows(OPERATIONS)
    missing = [name for name in option_names() if name not in rows]
    assert not missing, f"not in docs/operations.md's option table: {missing}"
    refused = {re.sub(r"^unacked_\w+$", "unacked_*", name) for name in STOCK_REDIS_OPTIONS}
    assert not refused - rows, f"not in docs/operations.md: {refused - rows}"


def test_every_option_is_named_in_the_transport_docstring() -> None:
    doc = kombu_envelope.kombu.transport.__doc__ or ""
    assert not [name for name in option_names() if f"``{name}``" not in doc]
    assert "``visibility_timeout``" in doc
