"""Where Redis is, from a URL or a kombu connection (kombu_envelope.store.client)."""

from __future__ import annotations

import kombu
import pytest

from kombu_envelope.errors import InvalidTransportOption
from kombu_envelope.settings import Settings
from kombu_envelope.store.client import Deployment, RedisEndpoint, new_client


@pytest.mark.parametrize(("url", "deployment", "nodes", "db", "tls"), [
    ("envelope://cache:6380/2", Deployment.SINGLE, (("cache", 6380),), 2, False),
    ("rediss://cache", Deployment.SINGLE, (("cache", 6379),), 0, True),
    ("envelope-sentinel://s1;envelope-sentinel://s2:26380/3", Deployment.SENTINEL,
     (("s1", 26379), ("s2", 26380)), 0, False),
    ("envelopes-sentinel://s1:26379/3", Deployment.SENTINEL, (("s1", 26379),), 3, True),
    ("envelope-cluster://n1:7000;envelope-cluster://n2:7001", Deployment.CLUSTER,
     (("n1", 7000), ("n2", 7001)), 0, False),
])
def test_urls_name_the_deployment_and_its_nodes(url: str, deployment: Deployment,
                                                nodes: tuple, db: int, tls: bool) -> None:
    endpoint = RedisEndpoint.from_url(url)
    assert (endpoint.deployment, endpoint.nodes, endpoint.tls) == (deployment, nodes, tls)
    if deployment is not Deployment.SENTINEL:
        assert endpoint.db == db


def test_credentials_are_unquoted() -> None:
    endpoint = RedisEndpoint.from_url("envelope://app%40billing:p%3Ass@cache/0")
    assert (endpoint.username, endpoint.password) == ("app@billing", "p:ss")


@pytest.mark.parametrize(("url", "says"), [
    ("amqp://cache", "scheme must be one of"),
    ("envelope-sentinel://s1;envelope-cluster://n1", "the same in every part"),
    ("envelope://a;envelope://b", "names several hosts"),
    ("envelope-cluster://n1:7000/2", "only database 0"),
    ("envelope://cache/zero", "database number must be an integer"),
    ("envelope://cache:port", "port of 'cache:port'"),
])
def test_bad_urls_fail_at_once_saying_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(InvalidTransportOption, match=says):
        RedisEndpoint.from_url(url)


def test_a_kombu_connection_keeps_its_sentinel_alternates() -> None:
    conninfo = kombu.Connection("envelope-sentinel://:pw@s1:26379;envelope-sentinel://s2:26380/1")
    endpoint = RedisEndpoint.from_conninfo(conninfo)
    assert endpoint.deployment is Deployment.SENTINEL
    assert endpoint.nodes == (("s1", 26379), ("s2", 26380))
    assert endpoint.password == "pw"


def test_a_transport_named_explicitly_keeps_the_deployment_of_the_url() -> None:
    conn = kombu.Connection("envelope-cluster://n1:7000;envelope-cluster://n2:7001",
                            transport="kombu_envelope.kombu.transport:Transport")
    endpoint = RedisEndpoint.from_conninfo(conn)
    assert endpoint.deployment is Deployment.CLUSTER
    assert endpoint.nodes == (("n1", 7000), ("n2", 7001))


def test_a_sentinel_url_needs_master_name() -> None:
    with pytest.raises(InvalidTransportOption, match="master_name"):
        new_client(RedisEndpoint.from_url("envelope-sentinel://s1"), Settings())
