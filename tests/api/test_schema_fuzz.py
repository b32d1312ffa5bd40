"""Property-based run over the OpenAPI schema (schemathesis): no input ever yields a 5xx.

Operations are iterated by hand (schemathesis.pytest.from_fixture does not work with
pytest 9); each gets bounded positive and negative examples."""
from __future__ import annotations

import pytest
import schemathesis
from api_helpers import ADMIN_TOKEN
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from api.app import create_app
from api.config import Settings

MAX_EXAMPLES = 25


@pytest.mark.slow
def test_no_server_errors_over_the_schema(api_index):
    app = create_app(Settings(index_root=api_index["root"], admin_token=ADMIN_TOKEN, max_upload_bytes=256 * 1024))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    labels, no_negative = [], []
    for result in schema.get_all_operations():
        operation = result.ok()
        labels.append(operation.label)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(mode))
            @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case):
                case.call_and_validate(checks=[not_a_server_error])

            try:
                run()
            except Unsatisfiable:
                # no parameters / body to break (e.g. GET /healthz): nothing negative to generate
                assert mode is GenerationMode.NEGATIVE, operation.label
                no_negative.append(operation.label)
    assert not {"POST /v1/search", "POST /v1/search/vector"} & set(no_negative)
    # the examples reached the handlers: successes and client errors, never a 5xx
    counts = {(s.labels["route"], s.labels["method"], s.labels["status"]): s.value  # {(route, method, status): n}
              for metric in app.state.metrics.requests.collect() for s in metric.samples}
    search_statuses = {status for (route, method, status) in counts if route.startswith("/v1/search")}
    assert any(s.startswith("4") for s in search_statuses)
    assert any(status == "200" for (_, _, status) in counts)
    assert not any(status.startswith("5") for (_, _, status) in counts), counts
    assert "POST /v1/search" in labels and "POST /v1/search/vector" in labels and len(labels) >= 10
