"""The normaliser setting through the HTTP API: the response's log Z, its bound and method, against a
dense float64 softmax over the stored embeddings; bad values stop the server before it starts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from api.config import Settings, load_settings
from index.store import IndexStore


def _dense_log_z(api_index, vector: np.ndarray, tau: float) -> float:
    emb = IndexStore(api_index["root"]).load(api_index["version"]).embeddings.astype(np.float64)
    s = emb @ (vector / np.linalg.norm(vector))
    m = (s / tau).max()
    return float(m + np.log(np.exp(s / tau - m).sum()))


@pytest.mark.parametrize("normaliser", [None, "exact", "bounded"])
def test_search_response_carries_the_normaliser_and_its_bound(make_client, api_index, normaliser, rng):
    client = make_client(**({} if normaliser is None else {"normaliser": normaliser}))
    vector = rng.normal(size=16)
    r = client.post("/v1/search/vector", json={"vector": vector.tolist(), "k": 5, "temperature": 0.3})
    assert r.status_code == 200, r.text
    body = r.json()
    norm = body["normaliser"]
    # auto on a 120-item index is exact; bounded on it scans every k-means list (nothing to sample)
    assert norm["method"] == (normaliser or "exact").replace("auto", "exact")
    ref = _dense_log_z(api_index, vector, 0.3)
    assert body["log_normaliser"] == pytest.approx(ref, abs=1e-5)
    assert body["log_normalizer"] == body["log_normaliser"]  # the old spelling, kept on the wire
    assert norm["lower"] - 1e-5 <= ref <= norm["upper"] + 1e-5
    assert norm["interval"] is None and norm["level"] is None and norm["rows"] == body["count"]
    for h in body["results"]:
        p = h["probability"]
        assert p == pytest.approx(math.exp(h["similarity"] / 0.3 - body["log_normaliser"]), rel=1e-6)
        assert math.exp(h["similarity"] / 0.3 - norm["upper"]) <= p * (1 + 1e-9)
        assert p <= math.exp(h["similarity"] / 0.3 - norm["lower"]) * (1 + 1e-9)


def test_bad_normaliser_setting_stops_start_up(capsys):
    from api.server import main

    with pytest.raises(ValueError, match="normaliser"):
        load_settings({"normaliser": "approx"}, environ={})
    with pytest.raises(ValueError, match="SOFTSEARCH_NORMALISER"):
        load_settings(environ={"SOFTSEARCH_NORMALISER": "approx"})
    assert load_settings({"normaliser": "bounded"}, environ={}).normaliser == "bounded"
    with pytest.raises(SystemExit) as exc:
        main(["--normaliser", "approx"])
    assert exc.value.code == 2 and "--normaliser" in capsys.readouterr().err


def test_mapped_pages_setting_reaches_the_searcher(make_client, capsys):
    from api.server import build_parser, main

    def settings_flags(argv):  # the serve flags that are Settings (main() takes the --engine ones apart)
        return {k: v for k, v in vars(build_parser().parse_args(argv)).items() if k in Settings.model_fields}

    assert load_settings(settings_flags(["--mapped-pages", "keep"]), environ={}).mapped_pages == "keep"
    assert load_settings(settings_flags([]), environ={}).mapped_pages == "auto"
    assert load_settings(environ={"SOFTSEARCH_MAPPED_PAGES": "release"}).mapped_pages == "release"
    with pytest.raises(SystemExit) as exc:
        main(["--mapped-pages", "sometimes"])
    assert exc.value.code == 2 and "--mapped-pages" in capsys.readouterr().err
    # (setting, normaliser) -> does the exact scan / the bounded estimate release the pages it read
    for setting, exact, bounded in (("auto", True, False), ("release", True, True), ("keep", False, False)):
        snapshot = make_client(mapped_pages=setting).app.state.searcher.snapshot()
        assert snapshot.release_pages is exact  # auto -> exact here
        bounded_snapshot = make_client(
            mapped_pages=setting, normaliser="bounded"
        ).app.state.searcher.snapshot()
        assert bounded_snapshot.normaliser.describe()["release_pages"] is bounded


def test_normaliser_overlap_setting_reaches_the_normaliser(make_client, capsys):
    from api.server import build_parser, main

    def settings_flags(argv):
        return {k: v for k, v in vars(build_parser().parse_args(argv)).items() if k in Settings.model_fields}

    assert (
        load_settings(settings_flags(["--normaliser-overlap", "off"]), environ={}).normaliser_overlap == "off"
    )
    assert load_settings(settings_flags([]), environ={}).normaliser_overlap == "off"
    with pytest.raises(SystemExit) as exc:
        main(["--normaliser-overlap", "maybe"])
    assert exc.value.code == 2 and "--normaliser-overlap" in capsys.readouterr().err
    for setting, overlap in (("on", True), ("off", False)):
        client = make_client(normaliser="bounded", normaliser_overlap=setting)
        assert client.app.state.searcher.snapshot().normaliser.config.overlap is overlap
