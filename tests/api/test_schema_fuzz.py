"""Property-based run over the OpenAPI schema (schemathesis) with every check (`--checks all`): no
5xx, every status code and response body as documented, every schema-valid request accepted and
every schema-violating one refused.

Operations are iterated by hand (schemathesis.pytest.from_fixture does not work with
pytest 9); each gets bounded positive and negative examples. A positive example's image parts are
real PNG files: an OpenAPI schema cannot say "a decodable image" (random bytes are rightly 400)."""
from __future__ import annotations

import pytest
import schemathesis
from api_helpers import ADMIN_TOKEN, png_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS, load_all_checks

from api.app import create_app
from api.config import Settings

MAX_EXAMPLES = 25


def _all_checks() -> list:
    """Every check schemathesis registers (the CLI's `--checks all`)."""
    load_all_checks()
    return list(CHECKS.get_all())


def _with_real_images(images: list[bytes]):
    def replace(case):
        body = case.body
        if isinstance(body, dict):
            if "file" in body:
                body["file"] = images[len(repr(body)) % len(images)]
            if isinstance(body.get("files"), list):
                body["files"] = [images[i % len(images)] for i in range(len(body["files"]))]
        return case
    return replace


@pytest.mark.slow
def test_the_api_conforms_to_its_schema(folder_index, api_dataset):
    """Over the folder index: real PNG files with metadata fields (class, path, size, ..., a user rating),
    so filters are generated from the served grammar too."""
    # the default upload limit (10 MiB): a body's size is a limit no JSON Schema can state (413 beyond it),
    # and generated bodies (a filter's `in` list of up to 4096 strings) reach a few hundred KiB
    app = create_app(Settings(index_root=folder_index["root"], admin_token=ADMIN_TOKEN))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    checks = _all_checks()
    assert len(checks) >= 10 and "positive_data_acceptance" in {getattr(c, "__name__", "") for c in checks}
    images = [png_bytes(api_dataset.image(i)) for i in range(8)]
    labels, no_negative = [], []
    for result in schema.get_all_operations():
        operation = result.ok()
        labels.append(operation.label)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = operation.as_strategy(mode)
            if mode is GenerationMode.POSITIVE:
                strategy = strategy.map(_with_real_images(images))

            @given(case=strategy)
            @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case):
                case.call_and_validate(checks=checks)

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
