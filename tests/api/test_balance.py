"""api/balance.py: each worker's connection count in the shared file, the share rule, and the
`Connection: close` it adds to a response of a worker over its share (two workers simulated by two slots)."""

from __future__ import annotations

import asyncio
import os

import pytest

from api import balance
from api.balance import BalanceConnections, ConnectionShare


@pytest.fixture
def shares(tmp_path):
    path = ConnectionShare.create(tmp_path)
    a = ConnectionShare(path, 2)  # this process
    b = ConnectionShare(path, 2, pid=os.getppid())  # another live process
    return a, b


def test_counts_are_shared_and_the_share_is_ceil_of_the_mean(shares, tmp_path):
    a, b = shares
    assert a.slot != b.slot
    a.publish(10)
    b.publish(6)
    assert a.total() == b.total() == 16
    assert a.over_share() and not b.over_share()  # 10 > 8, 6 <= 8
    a.closing.update({("h", 1), ("h", 2)})
    assert not a.over_share()  # 10 - 2 told to close = 8
    b.publish(7)  # 17 open: share 9
    a.closing.clear()
    assert a.over_share()  # 10 > 9
    a.publish(9)
    b.publish(8)
    assert not a.over_share()  # 9 of 17: share 9
    # a lone connection, or one each, is never over the share
    a.publish(1)
    b.publish(0)
    assert not a.over_share()
    # a slot is claimed again by the same pid, and a dead pid's slot is free
    again = ConnectionShare(tmp_path / balance.FILE_NAME, 2)
    assert again.slot == a.slot


def _respond(app, client):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "client": client, "method": "GET", "path": "/"}
    asyncio.run(app(scope, receive, send))
    return dict(sent[0]["headers"])


async def _inner(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_a_worker_over_its_share_closes_one_connection_per_surplus(shares, monkeypatch):
    a, b = shares
    monkeypatch.setattr(balance, "SHARE", a)
    app = BalanceConnections(_inner, a)
    a.publish(10)
    b.publish(6)
    closed = [c for c in [("127.0.0.1", p) for p in range(1000, 1010)] if b"connection" in _respond(app, c)]
    assert len(closed) == 2  # 10 -> 8: two surplus connections told to close, no more
    assert _respond(app, closed[0]).get(b"connection") is None  # already closing: not counted twice
    # the protocol reports each closed connection gone: the count drops and the client leaves `closing`
    balance.connections_changed(9, closed[0])
    balance.connections_changed(8, closed[1])
    assert not a.closing
    b.publish(8)  # ... and their clients reconnected to the other worker
    assert not a.over_share()
    assert all(b"connection" not in _respond(app, ("127.0.0.1", p)) for p in range(1000, 1008))
    # the other worker, under its share, never closes
    assert b"connection" not in _respond(BalanceConnections(_inner, b), ("127.0.0.1", 2000))
    # lifespan and other scopes pass through untouched
    seen = []

    async def other(scope, receive, send):
        seen.append(scope["type"])

    asyncio.run(BalanceConnections(other, a)({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]
