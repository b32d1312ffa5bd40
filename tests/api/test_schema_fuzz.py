"""The schemathesis CLI with every check (`--checks all`: no 5xx, status codes, content types and
response bodies as documented, schema-valid requests accepted, schema-violating ones refused) over
every route of a served folder index, items included, as a user runs it from the repository root:
`schemathesis run --checks all URL/openapi.json`, which reads schemathesis.toml and so the hooks that
give upload parts real image files (tests/api/schemathesis_hooks.py).

Bounded for the suite: 30 examples per operation and phase, and the coverage phase (every boundary
value of every keyword) is left out on the three JSON search routes, whose schema is the whole filter
grammar over eight fields (about 16 minutes there alone); their filters get the fuzzing phase here and
the reference property test (test_filter_property.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from api_helpers import ADMIN_TOKEN, ServerThread

from api.app import create_app
from api.config import Settings

ROOT = Path(__file__).resolve().parents[2]
HOOKS = ROOT / "tests" / "api" / "schemathesis_hooks.py"
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
EXAMPLES = 30


def _suite_config(path: Path) -> Path:
    """The repository's schemathesis.toml plus the suite's bound on the coverage phase."""
    text = (ROOT / "schemathesis.toml").read_text()
    assert re.search(r'^hooks = "tests/api/schemathesis_hooks.py"$', text, re.M), text
    text = text.replace('"tests/api/schemathesis_hooks.py"', f'"{HOOKS}"')
    path.write_text(
        text + '\n[[operations]]\ninclude-path-regex = "^/v1/search/(vector|item|batch)$"\n'
        "phases.coverage.enabled = false\n"
    )
    return path


@pytest.mark.slow
def test_schemathesis_with_every_check_is_clean_on_every_route(folder_index, tmp_path):
    """Over the folder index: real PNG files with metadata fields (class, path, size, ..., a user rating),
    so filters are generated from the served grammar too."""
    if not SCHEMATHESIS.exists():
        pytest.skip(f"no schemathesis CLI next to {sys.executable}")
    app = create_app(Settings(index_root=folder_index["root"], admin_token=ADMIN_TOKEN))
    report = tmp_path / "report"
    with ServerThread(app) as server:
        run = subprocess.run(
            [
                str(SCHEMATHESIS),
                "--config-file",
                str(_suite_config(tmp_path / "schemathesis.toml")),
                "run",
                f"{server.url}/openapi.json",
                "--checks",
                "all",
                "--max-examples",
                str(EXAMPLES),
                "--seed",
                "1",
                "--report",
                "junit",
                "--report-dir",
                str(report),
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "NO_COLOR": "1"},
        )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    generated = int(re.search(r"(\d+) generated", out).group(1))
    print(f"schemathesis --checks all: {generated} cases, clean")
    # every operation ran, the item routes included, none failed or errored
    cases = {c.get("name"): c for c in ET.parse(next(report.glob("*.xml"))).getroot().iter("testcase")}
    assert {
        "GET /v1/items/{item_id}",
        "GET /v1/items/{item_id}/thumbnail",
        "POST /v1/search",
        "POST /v1/search/batch",
        "POST /v1/search/vector",
        "POST /v1/search/item",
        "GET /v1/items",
    } <= set(cases)
    assert len(cases) >= 14
    assert not [
        name for name, c in cases.items() if c.find("failure") is not None or c.find("error") is not None
    ]
    # the requests reached the handlers: image searches answered 200 (the hooks' files decoded), refusals
    # were 4xx, and nothing was a 5xx
    counts = {
        (s.labels["route"], s.labels["method"], s.labels["status"]): s.value
        for metric in app.state.metrics.requests.collect()
        for s in metric.samples
    }
    assert not any(status.startswith("5") for (_, _, status) in counts), counts
    for route in ("/v1/search", "/v1/search/batch", "/v1/search/vector", "/v1/search/item"):
        assert counts.get((route, "POST", "200"), 0) > 0, (route, counts)
        assert any(s.startswith("4") for (r, _, s) in counts if r == route), (route, counts)
    assert generated > 14 * EXAMPLES
