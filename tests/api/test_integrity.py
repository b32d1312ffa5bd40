"""What serves is what passed (issue 18), as an operator meets it: the `softsearch` CLI (in-process, with
the real quality gate and calibration) against `softsearch serve` running in a subprocess.

- a low-recall ivf-pq build is refused (exit 1, the message names kind, parameters, recall, a kind that
  reaches the target) and `index list` shows the figures, checked against an independent computation;
- an admin reload of a refused version is 409 and the server keeps serving the store's `current`;
  `force` (admin) / `--force` (CLI) activates it, moves `current`, and is recorded in history.json;
- admin reloads are never charged to the search buckets: `activate --notify` lands after the searches
  emptied the bucket; a forged X-Forwarded-For from an untrusted peer changes nothing, a trusted
  proxy's does;
- under a 6-thread search load across build -> activate --notify -> rollback --notify -> reload: zero failed
  requests and the served version equals the store's `current` after every step.
"""

from __future__ import annotations

import json
import os
import time

import faiss
import httpx
import numpy as np
import pytest
from api_helpers import ADMIN_TOKEN, SearchClients, make_checkpoint, png_bytes
from fastapi.testclient import TestClient

from api.app import create_app
from api.cli import main as softsearch
from api.config import Settings
from api.launch import free_port, serve_process
from index.store import IndexStore
from search.evaluation.metrics import ideal_topk
from training.checkpoint import load_checkpoint
from training.datasets import create_dataset
from training.encoder import embed
from training.transforms import preprocess

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SIZE = 300
LOW_RECALL = ["--kind", "ivf-pq", "--param", "m=1", "--param", "nbits=4", "--param", "nlist=4"]


def _cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = softsearch([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _build(root, checkpoint, *extra) -> list:
    return [
        "index",
        "build",
        "--root",
        root,
        "--checkpoint",
        checkpoint,
        "--dataset",
        "synthetic",
        "--size",
        SIZE,
        "--no-progress",
        *extra,
    ]


def _served(url: str) -> str | None:
    return httpx.get(url + "/healthz", timeout=30).json()["version"]  # health is never rate limited


def _held_out_recalls(root, version, checkpoint) -> dict:
    """Independently of the gate: the held-out queries it draws (test split, 500 of 512 with seed 0),
    embedded with the version's encoder, searched by numpy brute force and as the server does: the raw
    FAISS file at the manifest's nprobe, its top 10 * rerank candidates re-scored with numpy; overlaps
    with each other and with the ideal (latent) top 10."""
    store = IndexStore(root)
    path, m = store.path(version), store.manifest(version)
    queries = create_dataset("synthetic", split="test", seed=0)
    q_idx = np.sort(np.random.default_rng(0).choice(len(queries), 500, replace=False))
    encoder, _ = load_checkpoint(checkpoint)
    zq = embed(
        encoder, preprocess([queries.image(int(i)) for i in q_idx], encoder.image_size), progress=False
    )
    zdb = np.load(path / "embeddings.npy")
    exact = np.argsort(-(zq.astype(np.float64) @ zdb.astype(np.float64).T), axis=1, kind="stable")[:, :10]
    index = faiss.read_index(str(path / "index.faiss"))
    faiss.extract_index_ivf(index).nprobe = m.params["nprobe"]
    _, cand = index.search(np.ascontiguousarray(zq, np.float32), 10 * m.params["rerank"])
    served = np.full((len(zq), 10), -1, np.int64)
    for i, c in enumerate(cand):
        c = c[c >= 0]
        best = c[np.argsort(-(zdb[c].astype(np.float64) @ zq[i].astype(np.float64)), kind="stable")[:10]]
        served[i, : len(best)] = best
    db = create_dataset("synthetic", split="train", size=SIZE, seed=0)
    ideal = ideal_topk(queries.latents[q_idx], db.latents, db.default_generator(), 10)

    def overlap(a, b):
        return float(np.mean([len(set(x[x >= 0].tolist()) & set(y.tolist())) / 10 for x, y in zip(a, b)]))

    return {"index": overlap(served, exact), "exact": overlap(exact, ideal), "served": overlap(served, ideal)}


@pytest.mark.slow
def test_gate_refusals_admin_reload_and_force(tmp_path, capsys):
    ck = make_checkpoint(tmp_path / "enc.safetensors", seed=41)
    root = tmp_path / "index"
    store = IndexStore(root)
    assert _cli(capsys, *_build(root, ck))[0] == 0
    v1 = store.current_version()
    with serve_process(
        root, "--admin-token", ADMIN_TOKEN, "--watch-interval-s", "0", log_path=tmp_path / "serve.log"
    ) as srv:
        url = srv.url
        # 1. a low-recall ivf-pq build: committed, not activated, exit 1, a message saying why and what to do
        rc, out, err = _cli(capsys, *_build(root, ck, *LOW_RECALL, "--notify", url, "--token", ADMIN_TOKEN))
        assert rc == 1 and store.current_version() == v1 and _served(url) == v1
        (v2,) = [v for v in store.versions() if v != v1]
        gate = store.manifest(v2).quality_gate.to_json()
        recall = gate["checks"]["recall"]
        assert gate["passed"] is False and recall["passed"] is False and recall["target"] == 0.95
        assert err.count("\n") == 1 and f"activation of index version {v2} refused" in err
        assert "ivf-pq (nlist=4, nprobe=" in err and "m=1, nbits=4, rerank=" in err
        assert f"reaches recall@10 {recall['served']:.3f} < target 0.950 on 500 held-out queries" in err
        assert "--kind auto chooses flat for 300 x 16" in err and "--force" in err
        # the figures, against an independent computation; `index list` shows exact and served ones
        ref = _held_out_recalls(root, v2, ck)
        assert recall["served"] == pytest.approx(ref["index"], abs=0.01) and ref["index"] < 0.8
        rc, out, _ = _cli(capsys, "index", "list", "--root", root, "--json")
        row = {r["version"]: r for r in json.loads(out)["versions"]}[v2]
        assert row["gate"] is False and row["current"] is False and row["index_recall"] == recall["served"]
        assert row["recall_exact"] == pytest.approx(ref["exact"], abs=0.01)
        assert row["recall_served"] == pytest.approx(ref["served"], abs=0.01)
        assert ref["served"] < ref["exact"]  # what the served index loses, which exact kNN scoring cannot see
        rc, out, _ = _cli(capsys, "index", "list", "--root", root)
        line = next(x for x in out.splitlines() if v2 in x)
        assert f"{recall['served']:.3f}" in line and f"{row['recall_exact']:.3f}" in line and "FAIL" in line

        # 2. an admin reload of the refused version: 409, the server keeps serving the store's current
        r = httpx.post(url + "/v1/admin/reload", json={"version": v2}, headers=AUTH, timeout=60)
        assert r.status_code == 409 and r.json()["error"] == "reload_refused", r.text
        assert (
            "recall check failed" in r.json()["detail"]
            and f"still serving version {v1}" in r.json()["detail"]
        )
        assert _served(url) == v1 == store.current_version()
        r = httpx.post(url + "/v1/search/vector", json={"vector": [1.0] * 16, "k": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["version"] == v1

        # 3. force: served, made current in the store, recorded (time, path, forced, what it overrode)
        r = httpx.post(
            url + "/v1/admin/reload", json={"version": v2, "force": True}, headers=AUTH, timeout=60
        )
        assert r.status_code == 200 and r.json()["version"] == v2 == r.json()["store_current"], r.text
        assert _served(url) == v2 == store.current_version()
        entry = store.history()["log"][-1]
        assert (entry["action"], entry["version"], entry["path"], entry["forced"]) == (
            "activate",
            v2,
            "POST /v1/admin/reload",
            True,
        )
        assert entry["time"] and "recall check failed" in entry["overridden"][0]
        assert _cli(capsys, "index", "list", "--root", root)[1].count("FAIL!") == 1  # forced, and shown so
        # a plain reload (what a restart or the follower does) keeps a forced version: its activation says so
        r = httpx.post(url + "/v1/admin/reload", headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.json()["version"] == v2

        # 4. the CLI: activate (passes), a refused activate exits 1, --force activates and is recorded
        rc, out, _ = _cli(
            capsys, "index", "activate", v1, "--root", root, "--notify", url, "--token", ADMIN_TOKEN
        )
        assert rc == 0 and f"now serves {v1}" in out and _served(url) == v1 == store.current_version()
        rc, _, err = _cli(
            capsys, "index", "activate", v2, "--root", root, "--notify", url, "--token", ADMIN_TOKEN
        )
        assert rc == 1 and "recall check failed" in err and _served(url) == v1 == store.current_version()
        rc, _, err = _cli(capsys, "index", "rollback", "--root", root)  # back to v2: the rule applies again
        assert rc == 1 and "refused" in err and store.current_version() == v1
        rc, out, _ = _cli(
            capsys,
            "index",
            "activate",
            v2,
            "--root",
            root,
            "--force",
            "--notify",
            url,
            "--token",
            ADMIN_TOKEN,
        )
        assert (
            rc == 0 and "forced: recall check failed" in out and _served(url) == v2 == store.current_version()
        )
        entry = store.history()["log"][-1]
        assert (entry["path"], entry["forced"], entry["previous"]) == ("index activate", True, v1)
        rc, out, _ = _cli(
            capsys, "index", "rollback", "--root", root, "--notify", url, "--token", ADMIN_TOKEN
        )
        assert rc == 0 and _served(url) == v1 == store.current_version()
        assert store.history()["log"][-1]["forced"] is False
    assert "Traceback" not in srv.log


def test_start_up_goes_through_the_rule(tmp_path, capsys):
    """A pointer written by hand to a refused version is not served at start-up (503 naming why);
    a forced activation is."""
    ck = make_checkpoint(tmp_path / "enc.safetensors", seed=42)
    root = tmp_path / "index"
    store = IndexStore(root)
    assert _cli(capsys, *_build(root, ck))[0] == 0
    assert _cli(capsys, *_build(root, ck, *LOW_RECALL))[0] == 1
    refused = [v for v in store.versions() if v != store.current_version()][0]
    (root / "current").write_text(refused + "\n")  # by hand, past the store's rule
    with TestClient(create_app(Settings(index_root=root, watch_interval_s=0))) as client:
        r = client.get("/readyz")
        assert r.status_code == 503 and "recall check failed" in r.json()["detail"]
    assert _cli(capsys, "index", "activate", refused, "--root", root, "--force")[0] == 0
    with TestClient(create_app(Settings(index_root=root, watch_interval_s=0))) as client:
        assert client.get("/readyz").json()["version"] == refused


@pytest.mark.slow
def test_rate_limit_identity_and_notify_after_an_empty_bucket(tmp_path, capsys):
    ck = make_checkpoint(tmp_path / "enc.safetensors", seed=43)
    root = tmp_path / "index"
    store = IndexStore(root)
    assert _cli(capsys, *_build(root, ck))[0] == 0
    v1 = store.current_version()
    proxy = httpx.HTTPTransport(local_address="127.0.0.2")  # a second loopback address: the trusted proxy
    with (
        serve_process(
            root,
            "--admin-token",
            ADMIN_TOKEN,
            "--watch-interval-s",
            "0",
            "--rate-limit-rps",
            "0.02",
            "--rate-limit-burst",
            "3",
            "--forwarded-allow-ips",
            "127.0.0.2",
            log_path=tmp_path / "serve.log",
        ) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as peer,
        httpx.Client(base_url=srv.url, timeout=60, transport=proxy) as via_proxy,
    ):
        url = srv.url
        # `index add` goes through the rule too; an added item reports its own source (split test, not train)
        # (a wide gate margin: this test is about serving, not about whether 4 more items help)
        rc, out, _ = _cli(
            capsys,
            "index",
            "add",
            "--root",
            root,
            "--dataset",
            "synthetic",
            "--split",
            "test",
            "--size",
            "4",
            "--no-progress",
            "--margin",
            "10",
            "--notify",
            url,
            "--token",
            ADMIN_TOKEN,
        )
        v2 = store.current_version()
        assert rc == 0 and v2 != v1 and _served(url) == v2
        added = peer.get("/v1/items/synthetic/test/2")
        assert added.status_code == 200 and added.json()["dataset"]["split"] == "test", added.text
        config = peer.get("/v1/config").json()  # the limit is shown
        assert config["rate_limit"] == {"rps": 0.02, "burst": 3, "key": "forwarded client from 127.0.0.2"}
        # the bucket of the TCP peer 127.0.0.1 (3 tokens, 0.02/s) is now empty ...
        assert [peer.get("/v1/index").status_code for _ in range(2)] == [200, 429]
        # ... and a forged X-Forwarded-For from that (untrusted) peer changes nothing
        forged = peer.get("/v1/index", headers={"X-Forwarded-For": "10.9.9.9"})
        assert forged.status_code == 429 and "too many requests from 127.0.0.1" in forged.json()["detail"]
        # a trusted proxy's header does name the client: its own fresh bucket, then limited on its own
        codes = [
            via_proxy.get("/v1/index", headers={"X-Forwarded-For": "10.9.9.9"}).status_code for _ in range(4)
        ]
        assert codes == [200, 200, 200, 429]
        limited = via_proxy.get("/v1/index", headers={"X-Forwarded-For": "10.9.9.9"})
        assert "too many requests from 10.9.9.9" in limited.json()["detail"]
        assert via_proxy.get("/v1/index", headers={"X-Forwarded-For": "10.9.9.8"}).status_code == 200
        # an admin reload with the token is never charged: activate --notify lands with the bucket empty
        rc, out, _ = _cli(
            capsys, "index", "activate", v1, "--root", root, "--notify", url, "--token", ADMIN_TOKEN
        )
        assert rc == 0 and f"now serves {v1}" in out
        assert _served(url) == v1 == store.current_version()
        # wrong or missing tokens are charged like any client (no free path around the limit)
        assert (
            peer.post("/v1/admin/reload", headers={"Authorization": "Bearer wrong-token-xyz"}).status_code
            == 429
        )
        # a notify that cannot land exits non-zero and says what the server serves
        rc, _, err = _cli(
            capsys,
            "index",
            "activate",
            v2,
            "--root",
            root,
            "--notify",
            url,
            "--token",
            "wrong-token-xyz",
            "--notify-timeout",
            "1",
        )
        assert rc == 3 and "HTTP 429" in err and "did not confirm" in err and store.current_version() == v2
        assert _served(url) == v1
        rc, out, _ = _cli(
            capsys, "index", "activate", v2, "--root", root, "--notify", url, "--token", ADMIN_TOKEN
        )
        assert rc == 0 and _served(url) == v2 == store.current_version()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection errors, retried
    t0 = time.monotonic()
    rc, _, err = _cli(
        capsys,
        "index",
        "activate",
        v1,
        "--root",
        root,
        "--notify",
        dead,
        "--token",
        ADMIN_TOKEN,
        "--notify-timeout",
        "1.5",
    )
    assert rc == 3 and "attempts in 1.5 s" in err and 1.4 <= time.monotonic() - t0 < 15
    assert "Traceback" not in srv.log


def _expected(root, version, images, k):
    """Brute force for one version: its own encoder, its stored embeddings."""
    store = IndexStore(root)
    v = store.load(version, gpu=False)
    enc, _ = load_checkpoint(store.models.path(v.manifest.checkpoint.sha256))  # the store's copy
    z = embed(enc, preprocess(images, enc.image_size), progress=False)
    s = z.astype(np.float64) @ v.embeddings.astype(np.float64).T
    return [[v.ids[j] for j in row] for row in np.argsort(-s, axis=1, kind="stable")[:, :k]]


@pytest.mark.slow
def test_swaps_under_load_keep_server_and_store_in_step(tmp_path, capsys):
    ck_a = make_checkpoint(tmp_path / "a.safetensors", seed=44)
    ck_b = make_checkpoint(tmp_path / "b.safetensors", seed=45)
    root = tmp_path / "index"
    store = IndexStore(root)
    assert _cli(capsys, *_build(root, ck_a))[0] == 0
    queries = create_dataset("synthetic", split="test", size=8, seed=0)
    images = [queries.image(i) for i in range(len(queries))]
    payloads = [png_bytes(im) for im in images]
    steps = []
    with (
        serve_process(
            root, "--admin-token", ADMIN_TOKEN, "--watch-interval-s", "0", log_path=tmp_path / "serve.log"
        ) as srv,
        SearchClients(srv.url, payloads, clients=6, k=5) as load,
    ):
        url, notify = srv.url, ["--notify", srv.url, "--token", ADMIN_TOKEN]

        def step(name: str) -> None:
            load.wait_for(6)  # queries land on every version
            steps.append((name, _served(url), store.current_version()))

        step("start")
        # the gate compares the new encoder with the served one; --force keeps the test about serving
        assert _cli(capsys, *_build(root, ck_b, "--force", *notify))[0] == 0
        step("build --notify")
        assert _cli(capsys, "index", "activate", steps[0][2], "--root", root, *notify)[0] == 0
        step("activate --notify")
        assert _cli(capsys, "index", "rollback", "--root", root, "--force", *notify)[0] == 0
        step("rollback --notify")
        r = httpx.post(url + "/v1/admin/reload", json={"version": steps[0][2]}, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        step("admin reload")
        r = httpx.post(url + "/v1/admin/reload", headers=AUTH, timeout=60)
        assert r.status_code == 200 and not r.json()["changed"]
        step("plain reload")
    v1, v2 = steps[0][2], steps[1][2]
    assert [s[2] for s in steps] == [v1, v2, v1, v2, v1, v1] and v1 != v2
    assert all(served == current for _, served, current in steps), steps  # server == store after every step
    failed = [r for r in load.results if r[1] != 200]
    assert not failed, failed[:5]
    seen = {body["version"] for _, _, body in load.results}
    assert seen == {v1, v2}
    expected = {v: _expected(root, v, images, 5) for v in seen}
    for q, _, body in load.results:
        assert [h["id"] for h in body["results"]] == expected[body["version"]][q], (body["version"], q)
    assert "Traceback" not in srv.log
    assert not [p for p in os.listdir(root / "staging") if not p.startswith("embed-")]
