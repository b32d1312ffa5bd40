"""README's Python client example runs as printed against a served index built like the demo's (synthetic
dataset, no metadata), and its comment's error is what such an index answers to a metadata filter."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
from api_helpers import ServerThread

from api.app import create_app
from api.client import SoftsearchClient, SoftsearchError
from api.config import Settings

README = Path(__file__).resolve().parents[2] / "README.md"


def client_example() -> str:
    text = README.read_text()
    section = text[text.index("**Python client**") :]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def test_readme_client_example_runs_on_an_index_without_metadata(api_index) -> None:
    code = client_example()
    assert "http://127.0.0.1:8000" in code and "filter=" not in code  # a filter needs metadata the demo lacks
    with ServerThread(create_app(Settings(index_root=api_index["root"]))) as server:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code.replace("http://127.0.0.1:8000", server.url), "README.md", "exec"), {})
        lines = out.getvalue().splitlines()
        assert lines[0] == "{}"  # no metadata fields, as the example's comment says
        # hits passing min_probability=0.01 (this untrained 120-item index may have none; the demo has five)
        hits = [ln.split() for ln in lines[1:]]
        assert len(hits) <= 5 and all(len(h) == 3 for h in hits)
        probs = [float(h[2]) for h in hits]
        assert all(p >= 0.01 for p in probs) and probs == sorted(probs, reverse=True)
        with SoftsearchClient(server.url) as ss:  # the error the example's comment names
            item = ss.sample(n=1, seed=0).items[0].id
            with pytest.raises(SoftsearchError) as err:
                ss.search_item(item, k=5, filter={"class": "apps"})
        assert err.value.status == 422 and err.value.code == "bad_filter" and "'class'" in err.value.detail
