"""The admin reload body is strict: the OpenAPI schema says `force` is a boolean, so 0/1/"yes" are refused."""

import pytest
from pydantic import ValidationError

from api.routes.models import ReloadRequest


@pytest.mark.parametrize("value", [0, 1, "true", "yes"])
def test_force_refuses_non_booleans(value):
    with pytest.raises(ValidationError):
        ReloadRequest(force=value)


def test_force_accepts_booleans_and_defaults_false():
    assert ReloadRequest(force=True).force is True
    assert ReloadRequest().force is False
    assert ReloadRequest.model_json_schema()["properties"]["force"]["type"] == "boolean"
