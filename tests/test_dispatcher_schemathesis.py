"""schemathesis against the dispatcher's OpenAPI document and a real server process:
no answer is a server error, and every answer matches the document (status code,
content type, body schema). A quick pass per operation, then a short stateful run."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from kombu_envelope.dispatcher.server import OPENAPI_PATH
from kombu_envelope.testing.dispatcher import DispatcherProcess

TOKEN = "op-" + "s" * 30
CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_schema_conformance]

schema = schemathesis.openapi.from_path(OPENAPI_PATH)


@pytest.fixture(scope="module")
def server(redis_url: str) -> Iterator[DispatcherProcess]:
    with DispatcherProcess(redis_url, [{"name": "ops", "scope": "operator", "token": TOKEN}],
                           {"key_prefix": f"t-st-{uuid.uuid4().hex[:8]}"},
                           extra_args=["--rate", "100000", "--burst", "100000"]) as proc:
        yield proc


@schema.parametrize()
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_every_operation(case: schemathesis.Case, server: DispatcherProcess) -> None:
    case.call_and_validate(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"},
                           checks=CHECKS)


def test_stateful(server: DispatcherProcess) -> None:
    machine = schema.as_state_machine()

    class Stateful(machine):  # type: ignore[misc, valid-type]
        def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, object]:
            return {"base_url": server.url, "headers": {"Authorization": f"Bearer {TOKEN}"}}

        def validate_response(self, response: object, case: schemathesis.Case,
                              **kwargs: object) -> None:
            case.validate_response(response, checks=CHECKS)

    Stateful.run(settings=settings(max_examples=8, stateful_step_count=4, deadline=None,
                                   suppress_health_check=list(HealthCheck)))
