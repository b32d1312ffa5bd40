"""Filters, batches and the Python client on a served folder index with class folders (real PNG files)."""

from __future__ import annotations

import numpy as np
import pytest
from api_helpers import ADMIN_TOKEN
from fastapi.testclient import TestClient

from api.app import create_app
from api.client import SoftsearchClient, SoftsearchError
from api.config import Settings


@pytest.fixture(scope="module")
def ss(folder_index):
    settings = Settings(index_root=folder_index["root"], admin_token=ADMIN_TOKEN)
    with TestClient(create_app(settings)) as http:
        yield SoftsearchClient(http=http, token=ADMIN_TOKEN)


def _dense(version, vector, rows, tau):
    """Brute force over `rows`: order by similarity, softmax over exactly those rows (float64)."""
    emb = np.asarray(version.embeddings, dtype=np.float64)[rows]
    q = np.asarray(vector, dtype=np.float64)
    s = emb @ (q / np.linalg.norm(q))
    logits = s / tau
    p = np.exp(logits - logits.max())
    p /= p.sum()
    order = np.argsort(-s, kind="stable")
    return [int(rows[o]) for o in order], p[order]


def test_index_lists_fields_and_items_carry_them(ss, folder_index):
    fields = ss.index().fields
    assert fields == {
        "path": "str",
        "class": "str",
        "size": "int",
        "mtime": "float",
        "width": "int",
        "height": "int",
        "format": "str",
        "rating": "int",
    }
    first = folder_index["ids"][0]
    item = ss.item(first)
    assert item.fields["class"] == first.split("/")[0] and item.fields["width"] == 40
    assert item.fields["format"] == "png" and item.fields["rating"] == 0


def test_filtered_search_returns_only_that_class_ranked_as_brute_force(ss, folder_index):
    version = folder_index["version"]
    klass = [i.split("/")[0] for i in version.ids]
    query_file = next((folder_index["folder"] / "class2").glob("*.png"))
    for name in ("class0", "class1"):
        rows = np.array([r for r, c in enumerate(klass) if c == name])
        answer = ss.search_image(query_file, k=8, temperature=0.2, filter={"class": name})
        assert answer.matched == rows.size and answer.results
        assert {version.ids[h.row].split("/")[0] for h in answer.results} == {name}
        # the query's own embedding, as the server computed it: vector search with the same filter agrees
        vec_answer = None
        stored = version.embeddings[
            version.ids.index(query_file.relative_to(folder_index["folder"]).as_posix())
        ]
        vec_answer = ss.search_vector(stored.tolist(), k=8, temperature=0.2, filter={"class": name})
        order, p = _dense(version, stored, rows, 0.2)
        assert [h.row for h in vec_answer.results] == order[:8]
        np.testing.assert_allclose([h.probability for h in vec_answer.results], p[:8], rtol=1e-5, atol=1e-9)
        assert abs(sum(p) - 1) < 1e-9 and vec_answer.matched == rows.size
        assert [h.id for h in answer.results] == [
            h.id for h in vec_answer.results
        ]  # uploaded copy of the file


def test_combined_filters_and_item_search_with_a_filter(ss, folder_index):
    version = folder_index["version"]
    rating = {i: n % 5 for n, i in enumerate(folder_index["ids"])}
    flt = {"and": [{"rating": {"gte": 1, "lt": 3}}, {"not": {"class": "class0"}}]}
    rows = np.array(
        [r for r, i in enumerate(version.ids) if 1 <= rating[i] < 3 and not i.startswith("class0/")]
    )
    item = version.ids[int(rows[0])]
    answer = ss.search_item(item, k=5, temperature=0.3, filter=flt, include_self=True)
    order, p = _dense(version, version.embeddings[int(rows[0])], rows, 0.3)
    assert [h.row for h in answer.results] == order[:5] and answer.self_rank == 1
    np.testing.assert_allclose([h.probability for h in answer.results], p[:5], rtol=1e-5, atol=1e-9)
    prefix = ss.search_item(item, k=50, filter={"path": {"prefix": "class1/"}})
    assert prefix.results and all(h.id.startswith("class1/") for h in prefix.results)
    nothing = ss.search_item(item, k=5, filter={"rating": 99})
    assert nothing.results == [] and nothing.matched == 0


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"colour": "red"}, "unknown field 'colour'"),
        ({"rating": "high"}, "field 'rating' is int"),
        ({"class": {"gt": 1}}, "ranges need a numeric field"),
    ],
)
def test_bad_filters_are_422_naming_the_field(ss, folder_index, bad, needle):
    with pytest.raises(SoftsearchError) as err:
        ss.search_item(folder_index["ids"][0], k=3, filter=bad)
    assert err.value.status == 422 and err.value.code == "bad_filter" and needle in err.value.detail
    with pytest.raises(SoftsearchError) as err:  # the multipart route reads the filter as JSON text
        ss.search_image(folder_index["folder"] / folder_index["ids"][0], k=3, filter=bad)
    assert err.value.status == 422 and needle in err.value.detail
    r = ss.http.post(
        "/v1/search",
        files={"file": ("q.png", (folder_index["folder"] / folder_index["ids"][0]).read_bytes())},
        data={"filter": "{nope"},
    )
    assert r.status_code == 422 and r.json()["error"] == "bad_filter"


def test_batches_answer_each_query_as_the_single_route(ss, folder_index):
    version = folder_index["version"]
    vectors = [version.embeddings[r].tolist() for r in (0, 9, 33)]
    flt = {"class": {"in": ["class0", "class2"]}}
    batch = ss.search_batch(vectors=vectors, k=4, temperature=0.25, filter=flt, mass=0.9)
    singles = [ss.search_vector(v, k=4, temperature=0.25, filter=flt, mass=0.9) for v in vectors]
    assert len(batch) == 3
    for b, s in zip(batch, singles):
        assert [h.id for h in b.results] == [h.id for h in s.results] and b.n_passed == s.n_passed
        np.testing.assert_allclose(
            [h.probability for h in b.results], [h.probability for h in s.results], rtol=1e-6
        )
    files = [folder_index["folder"] / folder_index["ids"][r] for r in (3, 40)]
    images = ss.search_batch(images=files, k=3)
    for f, answer in zip(files, images):
        single = ss.search_image(f, k=3)
        assert [h.id for h in answer.results] == [h.id for h in single.results]
    with pytest.raises(SoftsearchError) as err:
        ss.search_batch(vectors=[vectors[0], [1.0, 2.0]], k=3)
    assert err.value.status == 422 and err.value.detail.startswith("vectors[1] has 2 values")
    with pytest.raises(SoftsearchError) as err:
        ss.search_batch(images=[files[0], b"not an image"], k=3)
    assert err.value.status == 400 and err.value.detail.startswith("files[1]:")
    r = ss.http.post("/v1/search/batch", content=b"{}", headers={"content-type": "application/json"})
    assert r.status_code == 422
    r = ss.http.post("/v1/search/batch", content=b"x", headers={"content-type": "text/plain"})
    assert r.status_code == 415


def test_client_raises_server_errors_and_reads_service_routes(ss, folder_index):
    assert ss.ready() and ss.healthz().status == "ok"
    assert ss.config().max_k == 100 and "softsearch_" in ss.metrics()
    assert ss.sample(n=4, seed=1).items and ss.thumbnail(folder_index["ids"][0])[:4] == b"\x89PNG"
    with pytest.raises(SoftsearchError) as err:
        ss.search_item("no/such.png", k=3)
    assert err.value.status == 404 and err.value.code == "item_not_found"
    assert ss.reload().version == folder_index["version"].version


@pytest.mark.parametrize(
    "kind, params",
    [("flat", {}), ("ivf-flat", {"nlist": 4}), ("ivf-pq", {"nlist": 4, "m": 4}), ("hnsw", {"M": 8})],
)
def test_item_search_equals_vector_search_for_every_index_kind(tmp_path_factory, api_dataset, kind, params):
    """POST /v1/search/item == /v1/search/vector with the item's stored embedding: same ids, same p to
    1e-6."""
    from api_helpers import make_checkpoint

    from index.build import BuildOptions, build_index
    from index.store import IndexStore

    base = tmp_path_factory.mktemp(f"kind-{kind}")
    root = base / "index"
    build_index(
        make_checkpoint(base / "enc.safetensors", seed=3),
        api_dataset,
        root,
        BuildOptions(kind=kind, params=params, progress=False, force=True),
    )
    version = IndexStore(root).load(verify=False, gpu=False)
    with TestClient(create_app(Settings(index_root=root))) as http:
        ss = SoftsearchClient(http=http)
        for row in (0, 11, 57):
            vector = np.asarray(version.embeddings[row], dtype=np.float64).tolist()
            ref = ss.search_vector(vector, k=7, temperature=0.2)
            got = ss.search_item(version.ids[row], k=7, temperature=0.2, include_self=True)
            assert [h.id for h in got.results] == [h.id for h in ref.results]
            np.testing.assert_allclose(
                [h.probability for h in got.results],
                [h.probability for h in ref.results],
                rtol=1e-6,
                atol=1e-12,
            )
