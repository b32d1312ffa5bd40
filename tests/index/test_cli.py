"""`softsearch index ...` through index.cli.main in-process."""

from __future__ import annotations

import http.server
import json
import threading

import numpy as np
import pytest
from PIL import Image

from api.notify import notify_server
from index.cli import main as index_main
from index.cli import parse_bytes, parse_params


def main(argv, **kw):
    """`softsearch index ARGV` as the console script runs it (with the --notify HTTP client)."""
    return index_main(argv, notifier=notify_server, **kw)


from index.store import IndexStore


def _build(root, checkpoint, *extra) -> list[str]:
    return [
        "build",
        "--root",
        str(root),
        "--checkpoint",
        str(checkpoint),
        "--dataset",
        "synthetic",
        "--size",
        "48",
        "--no-progress",
        *extra,
    ]


class _Recorder(http.server.BaseHTTPRequestHandler):
    requests: list = []

    def do_POST(self):  # noqa: N802 - http.server API
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        _Recorder.requests.append((self.path, self.headers.get("Authorization"), json.loads(body)))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps({"version": json.loads(body)["version"]}).encode())  # as the API answers

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    _Recorder.requests = []
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", _Recorder.requests
    httpd.shutdown()


def test_build_list_activate_rollback_verify(tmp_path, tiny_checkpoint, capsys, server):
    url, requests = server
    root = tmp_path / "idx"
    assert main(_build(root, tiny_checkpoint)) == 0
    out = capsys.readouterr().out
    store = IndexStore(root)
    v1 = store.current_version()
    assert f"version {v1} (activated), 48 items, kind flat, 0 skipped" in out
    assert (
        main(
            _build(
                root,
                tiny_checkpoint,
                "--kind",
                "hnsw",
                "--param",
                "M=8",
                "--notify",
                url,
                "--token",
                "s3cret",
            )
        )
        == 0
    )
    v2 = store.current_version()
    assert store.manifest(v2).params["M"] == 8 and v2 != v1
    assert requests == [("/v1/admin/reload", "Bearer s3cret", {"version": v2})]
    capsys.readouterr()
    assert main(["list", "--root", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("*") and v2 in line and "hnsw" in line for line in lines)
    assert main(["list", "--root", str(root), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["current"] == v2 and [v["version"] for v in listed["versions"]] == [v1, v2]
    assert main(["activate", "--root", str(root), v1, "--notify", url]) == 0
    assert store.current_version() == v1 and requests[-1] == ("/v1/admin/reload", None, {"version": v1})
    assert main(["rollback", "--root", str(root)]) == 0 and store.current_version() == v2
    assert main(["verify", "--root", str(root), "--all"]) == 0
    assert capsys.readouterr().out.count("ok ") >= 2
    emb = store.path(v1) / "embeddings.npy"
    emb.write_bytes(emb.read_bytes()[:-8])
    assert main(["verify", "--root", str(root), v1]) == 1
    assert "CORRUPT" in capsys.readouterr().out
    assert main(["activate", "--root", str(root), v1]) == 2  # never activate a corrupt version
    assert "bytes" in capsys.readouterr().err and store.current_version() == v2
    assert main(["prune", "--root", str(root), "--keep", "1"]) == 0
    assert store.versions() == [v2]


def test_add_from_folder_and_failed_notify(tmp_path, tiny_checkpoint, capsys):
    root = tmp_path / "idx"
    assert main(_build(root, tiny_checkpoint)) == 0
    folder = tmp_path / "new"
    folder.mkdir()
    for i in range(3):
        Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(folder / f"n{i}.png")
    capsys.readouterr()
    rc = main(
        [
            "add",
            "--root",
            str(root),
            "--folder",
            str(folder),
            "--no-progress",
            "--notify",
            "http://127.0.0.1:9",
            "--notify-timeout",
            "0.6",
        ]
    )
    assert rc == 3  # the store moved, the server did not confirm: exit 3 after retrying
    captured = capsys.readouterr()
    assert "51 items" in captured.out and "error: the server did not confirm version" in captured.err
    assert "attempts" in captured.err
    assert IndexStore(root).load().ids[-3:] == ["n0.png", "n1.png", "n2.png"]


def test_quality_gate_exit_code(tmp_path, tiny_checkpoint, capsys):
    root = tmp_path / "idx"

    def worse(candidate, serving):
        return {"candidate": 0.1, "serving": 0.9, "metric": "map@10"}

    assert main(_build(root, tiny_checkpoint), evaluator=worse) == 0
    v1 = IndexStore(root).current_version()
    assert main(_build(root, tiny_checkpoint), evaluator=worse) == 1
    assert "refused: quality gate failed (map@10)" in capsys.readouterr().err
    store = IndexStore(root)
    refused = [v for v in store.versions() if v != v1][0]
    assert store.current_version() == v1
    assert main(["activate", "--root", str(root), refused]) == 1  # gate refusals exit 1 everywhere
    err = capsys.readouterr().err
    assert "quality gate failed (map@10): candidate 0.1 < serving 0.9" in err and "--force" in err
    assert main(["activate", "--root", str(root), refused, "--force"]) == 0
    assert store.current_version() == refused
    entry = store.history()["log"][-1]
    assert entry["forced"] is True and entry["path"] == "index activate" and entry["version"] == refused


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["build", "--checkpoint", "nope.safetensors", "--dataset", "synthetic"],
            "checkpoint not found: nope.safetensors",
        ),
        (
            ["activate", "20990101T000000000Z-deadbeef"],
            "unknown index version '20990101T000000000Z-deadbeef'",
        ),
        (["rollback"], "no earlier activated version"),
        (["verify"], "no current index version"),
        (["add", "--folder", "x"], "no current index version"),
        (["prune", "--keep", "0"], "keep must be"),
        (
            ["build", "--checkpoint", "__CKPT__", "--dataset", "synthetic", "--batch-size", "0"],
            "batch_size must be",
        ),
        (
            ["build", "--checkpoint", "__CKPT__", "--dataset", "synthetic", "--target-recall", "1.5"],
            "target_recall",
        ),
    ],
)
def test_user_errors_exit_2(tmp_path, argv, message, capsys, tiny_checkpoint):
    argv = (
        argv[:1]
        + ["--root", str(tmp_path)]
        + [str(tiny_checkpoint) if a == "__CKPT__" else a for a in argv[1:]]
    )
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_argument_errors(tmp_path, tiny_checkpoint, capsys):
    assert main(["frobnicate"]) == 2
    assert main(_build(tmp_path, tiny_checkpoint, "--param", "nlist")) == 2
    assert "bad --param 'nlist'" in capsys.readouterr().err
    assert main(_build(tmp_path, tiny_checkpoint, "--dataset", "imagenet")) == 2
    assert "unknown dataset 'imagenet'" in capsys.readouterr().err
    assert parse_bytes("2G") == 2 << 30 and parse_bytes("512MiB") == 512 << 20 and parse_bytes("100") == 100
    assert parse_params(["nlist=4", "M=16"]) == {"nlist": 4, "M": 16}
    with pytest.raises(ValueError, match="bad memory size"):
        parse_bytes("lots")


class _Flaky(http.server.BaseHTTPRequestHandler):
    """Answers the first `busy` reloads with `status` (+ Retry-After when set), then as the API does."""

    plan: dict = {}

    def do_POST(self):  # noqa: N802 - http.server API
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        _Flaky.plan["seen"] += 1
        if _Flaky.plan["seen"] <= _Flaky.plan["busy"]:
            self.send_response(_Flaky.plan["status"])
            if _Flaky.plan.get("retry_after") is not None:
                self.send_header("Retry-After", str(_Flaky.plan["retry_after"]))
            self.end_headers()
            self.wfile.write(json.dumps({"error": "x", "detail": "busy"}).encode())
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps({"version": body["version"]}).encode())

    def do_GET(self):  # noqa: N802 - /healthz
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps({"version": _Flaky.plan.get("healthz")}).encode())

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(
    "status, retry_after, busy, expected_sleeps, ok",
    [
        (429, 2, 2, [2.0, 2.0], True),  # Retry-After honoured
        (503, None, 3, [0.25, 0.5, 1.0], True),  # 5xx without it: doubling backoff
        (409, None, 1, [], False),  # refused: no retry
        (403, None, 1, [], False),
        (429, 3, 99, [3.0, 3.0, 3.0, 1.0], False),  # bounded: gives up when the time is spent
    ],
)
def test_notify_retries_what_can_pass_and_stops_in_time(status, retry_after, busy, expected_sleeps, ok):
    from api.notify import notify_server

    _Flaky.plan = {"seen": 0, "busy": busy, "status": status, "retry_after": retry_after, "healthz": "old"}
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    clock = [0.0]
    sleeps = []

    def sleep(s):  # virtual time: the retry schedule is checked without waiting for it
        sleeps.append(round(s, 3))
        clock[0] += s

    try:
        good, message = notify_server(
            f"http://127.0.0.1:{httpd.server_address[1]}",
            "t0ken-123",
            "V2",
            wait_s=10.0,
            sleep=sleep,
            clock=lambda: clock[0],
        )
    finally:
        httpd.shutdown()
    assert good is ok and sleeps == expected_sleeps, (message, sleeps)
    if ok:
        assert "now serves V2" in message and f"attempt {busy + 1}" in message
    else:
        assert f"HTTP {status}" in message and ("'old'" in message or status in (403, 409))


def test_failed_build_leaves_no_staging_and_gc_removes_stale(tmp_path, tiny_checkpoint, capsys):
    import os

    root = tmp_path / "idx"

    def undecodable(candidate):  # the calibration step meets a file it cannot decode (after the write)
        raise ValueError("image too large to decode: 30000 x 30000 pixels")

    for _ in range(2):
        assert main(_build(root, tiny_checkpoint), calibrator=undecodable) == 2
        assert "image too large to decode" in capsys.readouterr().err
    store = IndexStore(root)
    assert store.versions() == [] and store.current_version() is None
    left = [p.name for p in store.staging_dir.iterdir()]
    assert all(name.startswith("embed-") for name in left), left  # only the resumable embedding cache
    # a build killed outright leaves its directory: `index gc` removes it once it is older than an hour
    stale, fresh = (
        store.staging_path("20200101T000000000Z-deadbeef"),
        store.staging_path("20990101T000000000Z-cafe0000"),
    )
    os.utime(stale, (0, 0))
    assert main(["gc", "--root", str(root)]) == 0
    assert "removed 1 stale staging entry: 20200101T000000000Z-deadbeef" in capsys.readouterr().out
    assert not stale.exists() and fresh.exists() and all((store.staging_dir / n).exists() for n in left)
    assert main(["gc", "--root", str(root), "--max-age-s", "-1"]) == 2


def test_a_version_without_gate_result_is_gated_at_first_activation(tmp_path, tiny_checkpoint, capsys):
    from index.manifest import read_manifest_json, write_manifest

    root = tmp_path / "idx"
    calls = []

    def worse(candidate, serving):
        calls.append((candidate.version, serving.version))
        return {"candidate": 0.2, "serving": 0.7, "metric": "map@10"}

    assert main(_build(root, tiny_checkpoint)) == 0
    assert main(_build(root, tiny_checkpoint, "--no-activate")) == 0
    store = IndexStore(root)
    v1 = store.current_version()
    (old,) = [v for v in store.versions() if v != v1]
    manifest = read_manifest_json(store.path(old))
    del manifest["quality_gate"]  # as a store written before the gate existed
    write_manifest(store.path(old), manifest)
    capsys.readouterr()
    assert main(["activate", "--root", str(root), old], evaluator=worse) == 1
    assert calls == [(old, v1)] and store.current_version() == v1
    assert "quality gate failed (map@10): candidate 0.2 < serving 0.7" in capsys.readouterr().err
    gate = store.manifest(old).quality_gate.to_json()  # recorded: judged like any build from now on
    assert gate["passed"] is False and gate["checks"]["score"]["serving_version"] == v1
    assert main(["activate", "--root", str(root), old]) == 1 and len(calls) == 1  # not gated twice


def test_help_states_the_rules(capsys):
    from index.cli import build_parser

    for argv, needles in (
        (["build", "--help"], ["--target-recall", "not activated, exit 1", "recorded as forced"]),
        (["activate", "--help"], ["--force", "recorded as forced", "--notify-timeout", "exit 3"]),
        (["rollback", "--help"], ["--force", "activation rule"]),
        (["gc", "--help"], ["--max-age-s", "killed builds"]),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        text = " ".join(capsys.readouterr().out.split())
        for needle in needles:
            assert needle in text, (argv, needle)
