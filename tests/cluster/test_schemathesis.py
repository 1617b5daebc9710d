"""schemathesis over the daemon's own /openapi.json, against a live cluster over real HTTP: for every
operation, generated requests (valid and not; bounded examples, derandomized so a run is repeatable)
never get a 5xx and never a status code the document does not state."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import status_code_conformance

from .harness import start_cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[schemathesis.BaseSchema]:
    c = start_cluster(Path(tmp_path_factory.mktemp("schemathesis")), ["prefill", "decode"])
    try:
        yield schemathesis.openapi.from_url(c.url + "/openapi.json")
    finally:
        c.stop()


schema = schemathesis.pytest.from_fixture("daemon_api")


@schema.parametrize()
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_no_server_error_and_no_undocumented_status(case: schemathesis.Case) -> None:
    response = case.call(timeout=30)
    # raises, naming the case, on a 5xx or a status code the operation's document does not state
    # (schemathesis also probes methods an operation lacks: the 405 those get is conformant)
    case.validate_response(response, checks=[not_a_server_error, status_code_conformance])
    assert response.status_code < 500
