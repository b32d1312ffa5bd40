"""Exact, streaming cross-entropy gap between the ideal and the learned softmax search.

Per query x over a database D = {y_1..y_N} (docs/theory.md §1):

    ideal    q(j|x) = r(x, y_j) / sum_l r(x, y_l)           (from the generator's log r)
    learned  p(j|x) = exp(s_j / tau) / sum_l exp(s_l / tau)   (s = z_x . z_y)
    H(q, p) = log Z_p - E_q[s / tau],   H(q) = log Z_q - E_q[log r],   KL = H(q, p) - H(q)

with log Z_p = logsumexp_j s_j / tau and log Z_q = logsumexp_j log r_j. `softmax_gap` never
holds a Q x N matrix: it walks (block_q, block_n) tiles with an online log-sum-exp and
carries the q-weighted sums rescaled whenever the running max moves. Matmuls run in fp32,
the running sums in float64. For the label and latent generators on large problems the tiles
instead go through one compiled pass with fixed shifts (search/evaluation/fused.py, `fused=`).
`softmax_gap_dense` is the obviously-correct reference.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from scipy.special import i0e

from search.evaluation.fused import UNDERFLOW_PER_ITEM, TileSums, fused_supported
from training.distributed import default_device

logger = logging.getLogger(__name__)


@dataclass
class GapResult:
    """Per-query H(q,p), H(q) and KL(q||p) = H(q,p) - H(q), all (Q,) float64 in nats."""

    cross_entropy: np.ndarray
    ideal_entropy: np.ndarray
    kl: np.ndarray
    temperature: float | None = None
    generator: str | None = None

    def __len__(self) -> int:
        return int(self.kl.shape[0])

    def summary(self) -> dict:
        """Means and standard errors (std / sqrt(Q)) of the three per-query quantities."""
        out: dict = {"n_queries": len(self), "temperature": self.temperature, "generator": self.generator}
        for name, v in (
            ("cross_entropy", self.cross_entropy),
            ("ideal_entropy", self.ideal_entropy),
            ("kl", self.kl),
        ):
            n = v.shape[0]
            out[name] = float(v.mean()) if n else float("nan")
            out[f"{name}_se"] = float(v.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
        out["gap"], out["gap_se"] = out["kl"], out["kl_se"]
        return out


def _check_inputs(query_emb, db_emb, query_meta, db_meta, temperature):
    query_emb = np.asarray(query_emb)
    db_emb = np.asarray(db_emb)
    if query_emb.ndim != 2 or db_emb.ndim != 2 or query_emb.shape[1] != db_emb.shape[1]:
        raise ValueError(f"embedding shapes {query_emb.shape} and {db_emb.shape} are not (Q, D) and (N, D)")
    if len(query_meta) != query_emb.shape[0]:
        raise ValueError(f"query_meta has {len(query_meta)} rows for {query_emb.shape[0]} queries")
    if len(db_meta) != db_emb.shape[0]:
        raise ValueError(f"db_meta has {len(db_meta)} rows for {db_emb.shape[0]} database items")
    if db_emb.shape[0] == 0:
        raise ValueError("empty database")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    return query_emb, db_emb


def _log_i0(kappa: float) -> float:
    # log I0(k) = log(i0e(k)) + |k|, stable for large kappa
    return float(np.log(i0e(kappa)) + abs(kappa))


def _oracle(latents: np.ndarray) -> np.ndarray:
    # u = m^{-1/2} (cos t1, sin t1, ..., cos tm, sin tm); u_x . u_y = (1/m) sum_i cos(dt_i)
    latents = np.asarray(latents, dtype=np.float64)
    m = latents.shape[1]
    u = np.empty((latents.shape[0], 2 * m), dtype=np.float64)
    u[:, 0::2] = np.cos(latents)
    u[:, 1::2] = np.sin(latents)
    return u / math.sqrt(m)


def _latent_kappa(generator) -> float | None:
    """kappa when `generator` is the scalar-kappa von Mises latent generator (device fast path)."""
    if getattr(generator, "name", None) != "latent":
        return None
    kappa = getattr(generator, "kappa", None)
    if isinstance(kappa, (int, float, np.floating)) and math.isfinite(float(kappa)):
        return float(kappa)
    return None


RESIDENT_BYTES = 4 << 30  # keep a whole float32 operand on the device when it is at most this big


class DeviceRows:
    """Row blocks of a float32 matrix on `dev`: uploaded once when it fits in RESIDENT_BYTES
    (zero-copy on CPU), otherwise block by block (databases larger than device memory)."""

    def __init__(self, x: np.ndarray, dev: torch.device):
        self.x, self.dev = x, dev
        self.t = _tensor(x, dev) if x.shape[0] * x.shape[1] * 4 <= RESIDENT_BYTES else None

    def __getitem__(self, sl: slice) -> torch.Tensor:
        if self.t is not None:
            return self.t[sl]
        return _tensor(self.x[sl], self.dev)


def _tensor(x: np.ndarray, dev: torch.device) -> torch.Tensor:
    """float32 tensor over `x`, zero-copy on CPU; read-only arrays (an index version's memory-mapped
    embeddings) are shared as they are, since these kernels never write to their operands."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.flags.writeable:
        return torch.as_tensor(x, device=dev)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.as_tensor(x, device=dev)


def _rows_without_support(log_z_q: np.ndarray, offset: int) -> None:
    bad = np.flatnonzero(~np.isfinite(log_z_q))
    if bad.size:
        raise ValueError(
            f"queries {(bad[:5] + offset).tolist()} have r = 0 for every database item "
            "(e.g. their class is absent from the database): the ideal search is undefined"
        )


def _label_gap(
    zq, zn, qlab, nlab, temperature, block_q, block_n, dev, tile_sums: TileSums | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Label fast path in O(QN) without an ideal matrix: q is uniform over the n_c same-class
    items, so E_q[s] = z_q . mean_{c(q)} z and H(q) = log n_c."""
    qlab = np.asarray(qlab).astype(np.int64).ravel()
    nlab = np.asarray(nlab).astype(np.int64).ravel()
    classes, inv = np.unique(nlab, return_inverse=True)
    counts = np.bincount(inv, minlength=classes.size).astype(np.float64)
    # class means of the database embeddings, accumulated in float64: (C, D)
    sums = torch.zeros((classes.size, zn.shape[1]), dtype=torch.float64)
    for n0 in range(0, zn.shape[0], block_n):  # blocked so a huge database is never copied whole in float64
        sums.index_add_(
            0,
            torch.as_tensor(inv[n0 : n0 + block_n]),
            torch.as_tensor(np.asarray(zn[n0 : n0 + block_n], dtype=np.float64)),
        )
    means = sums.numpy() / counts[:, None]
    pos = np.searchsorted(classes, qlab)
    pos_c = np.clip(pos, 0, classes.size - 1)
    missing = classes[pos_c] != qlab
    if missing.any():
        bad = np.flatnonzero(missing)
        raise ValueError(
            f"query classes {sorted(set(qlab[bad].tolist()))[:5]} are absent from the database "
            "(r = 0 for every item): the ideal search is undefined"
        )
    e_s = np.einsum("qd,qd->q", zq.astype(np.float64), means[pos_c])  # E_q[s] per query
    log_zp = _log_partition(zq, zn, temperature, block_q, block_n, dev, tile_sums)
    ce = log_zp - e_s / temperature
    h = np.log(counts[pos_c])
    return ce, h


def _log_partition(
    zq, zn, temperature, block_q, block_n, dev, tile_sums: TileSums | None = None
) -> np.ndarray:
    """log Z_p = logsumexp_j s_qj / tau per query, streamed over (block_q, block_n) tiles.

    With `tile_sums`, one fused pass per tile against the fixed shift |x_q| max|y|
    (search/evaluation/fused.py); rows whose total could have lost mass to underflow are redone with the
    online max."""
    if tile_sums is not None:
        out, redo = _log_partition_fixed(zq, zn, temperature, block_q, block_n, dev, tile_sums)
        if redo.any():
            out[redo] = _log_partition(zq[redo], zn, temperature, block_q, block_n, dev)
        return out
    out = np.empty(zq.shape[0], dtype=np.float64)
    inv_tau = 1.0 / temperature
    rq, rn = DeviceRows(zq, dev), DeviceRows(zn, dev)
    for q0 in range(0, zq.shape[0], block_q):
        xq = rq[q0 : q0 + block_q] * inv_tau  # (bq, D) z/tau
        m = torch.full((xq.shape[0],), -math.inf, dtype=torch.float64, device=dev)
        acc = torch.zeros(xq.shape[0], dtype=torch.float64, device=dev)
        for n0 in range(0, zn.shape[0], block_n):
            xn = rn[n0 : n0 + block_n]
            lp = xq @ xn.T  # (bq, bn) fp32 logits s/tau
            new_m = torch.maximum(m, lp.amax(dim=1).double())
            acc = acc * torch.exp(m - new_m) + torch.exp(lp - new_m.float()[:, None]).sum(1).double()
            m = new_m
        out[q0 : q0 + xq.shape[0]] = (m + torch.log(acc)).cpu().numpy()
    return out


def _max_norm(rows: DeviceRows, n: int, block: int) -> float:
    return max(float(torch.linalg.vector_norm(rows[i : i + block], dim=1).max()) for i in range(0, n, block))


def _log_partition_fixed(zq, zn, temperature, block_q, block_n, dev, tile_sums: TileSums):
    """(log Z_p, rows to redo): fixed-shift sums, s/tau - |x_q| max|y| <= 0 (Cauchy-Schwarz)."""
    nq, nn = zq.shape[0], zn.shape[0]
    out = np.empty(nq, dtype=np.float64)
    redo = np.zeros(nq, dtype=bool)
    rq, rn = DeviceRows(zq, dev), DeviceRows(zn, dev)
    max_n = _max_norm(rn, nn, block_n)
    for q0 in range(0, nq, block_q):
        xq = rq[q0 : q0 + block_q] * (1.0 / temperature)  # (bq, D) z/tau
        shift = torch.linalg.vector_norm(xq, dim=1) * max_n  # (bq,) >= every s/tau of these rows
        acc = torch.zeros(xq.shape[0], dtype=torch.float64, device=dev)
        for n0 in range(0, nn, block_n):
            xn = rn[n0 : n0 + block_n]
            full = xq.shape[0] == block_q and xn.shape[0] == block_n
            acc += tile_sums.partition(xq @ xn.T, shift, full).double()
        q1 = q0 + xq.shape[0]
        out[q0:q1] = (shift.double() + torch.log(acc)).cpu().numpy()
        redo[q0:q1] = (acc < nn * UNDERFLOW_PER_ITEM).cpu().numpy()
    return out, redo


FUSED_MIN_PAIRS = 1 << 25  # auto mode compiles the fused tile kernel from Q * N >= 33.5M pairs


def _use_fused(fused: bool | None, dev: torch.device, n_pairs: int) -> bool:
    if fused is None:  # auto: measured faster on CPU (bench/gap.py); small problems skip the compile
        return dev.type == "cpu" and n_pairs >= FUSED_MIN_PAIRS and fused_supported(dev)
    return bool(fused) and fused_supported(dev)


def softmax_gap(
    query_emb,
    db_emb,
    query_meta,
    db_meta,
    generator,
    temperature: float,
    block_q: int = 512,
    block_n: int = 8192,
    device=None,
    fused: bool | None = None,
) -> GapResult:
    """Exact per-query H(q,p), H(q) and KL for unit embeddings, streamed in tiles.

    `query_meta`/`db_meta` are what `generator.log_ratio` takes (latents, labels, indices).
    The label generator takes an O(QN) fast path with no ideal matrix; the von Mises latent
    generator computes log r on the device as m kappa (u_q . u_n) - m log I0(kappa) with u the
    oracle embedding; any other generator is called per tile through `log_ratio`.
    `fused` (label and latent paths): True compiles one-pass tile kernels (search/evaluation/fused.py), False
    keeps the eager online-max walk, None decides (CPU and Q * N >= FUSED_MIN_PAIRS).
    """
    zq, zn = _check_inputs(query_emb, db_emb, query_meta, db_meta, temperature)
    if block_q < 1 or block_n < 1:
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_n={block_n}")
    temperature = float(temperature)
    dev = default_device(device)
    gname = getattr(generator, "name", type(generator).__name__)
    kappa = _latent_kappa(generator)
    tile_sums = None
    if (gname == "label" or kappa is not None) and _use_fused(fused, dev, zq.shape[0] * zn.shape[0]):
        tile_sums = TileSums(compiled=True)
    if gname == "label":
        ce, h = _label_gap(zq, zn, query_meta, db_meta, temperature, block_q, block_n, dev, tile_sums)
        return GapResult(ce, h, ce - h, temperature, gname)

    uq_all = un_all = None
    if kappa is not None:
        # log r = m kappa (u_q . u_n) - m log I0(kappa); the constant cancels in q and in H(q), so the
        # tiles carry only m kappa (u_q . u_n): one small matmul on the device
        uq_all = _oracle(query_meta) * (np.asarray(query_meta).shape[1] * kappa)
        un_all = _oracle(db_meta)
    if tile_sums is not None:
        ce, h, redo = _latent_gap_fixed(zq, zn, uq_all, un_all, temperature, block_q, block_n, dev, tile_sums)
        if redo.any():
            ce[redo], h[redo] = _online_gap(
                zq[redo],
                zn,
                None,
                db_meta,
                generator,
                uq_all[redo],
                un_all,
                temperature,
                block_q,
                block_n,
                dev,
            )
    else:
        ce, h = _online_gap(
            zq, zn, query_meta, db_meta, generator, uq_all, un_all, temperature, block_q, block_n, dev
        )
    return GapResult(ce, h, ce - h, temperature, gname)


def _latent_gap_fixed(zq, zn, uq_all, un_all, temperature, block_q, block_n, dev, tile_sums: TileSums):
    """(H(q,p), H(q), rows to redo) for the latent generator with fixed shifts: one fused pass per
    tile (search/evaluation/fused.py); s/tau <= |x_q| max|y| and log r <= |u_q| max|u_n| bound every term."""
    nq, nn = zq.shape[0], zn.shape[0]
    ce, h = np.empty(nq, dtype=np.float64), np.empty(nq, dtype=np.float64)
    redo = np.zeros(nq, dtype=bool)
    rq, rn = DeviceRows(zq, dev), DeviceRows(zn, dev)
    ruq, run = DeviceRows(uq_all, dev), DeviceRows(un_all, dev)
    max_n, max_un = _max_norm(rn, nn, block_n), _max_norm(run, nn, block_n)
    for q0 in range(0, nq, block_q):
        xq = rq[q0 : q0 + block_q] * (1.0 / temperature)  # (bq, D) z/tau
        uq = ruq[q0 : q0 + block_q]  # (bq, 2m) scaled oracle
        shift_p = torch.linalg.vector_norm(xq, dim=1) * max_n
        shift_q = torch.linalg.vector_norm(uq, dim=1) * max_un
        totals = [torch.zeros(xq.shape[0], dtype=torch.float64, device=dev) for _ in range(4)]
        for n0 in range(0, nn, block_n):
            xn = rn[n0 : n0 + block_n]
            full = xq.shape[0] == block_q and xn.shape[0] == block_n
            tile = tile_sums.latent(xq @ xn.T, uq, run[n0 : n0 + block_n], shift_p, shift_q, full)
            for t, v in zip(totals, tile):
                t += v.double()
        sp, sq, a, b = totals  # sum e^{s/tau - shift_p}, S = sum w, A = sum w s/tau, B = sum w log r
        q1 = q0 + xq.shape[0]
        ce[q0:q1] = (shift_p.double() + torch.log(sp) - a / sq).cpu().numpy()  # log Z_p - E_q[s/tau]
        h[q0:q1] = (shift_q.double() + torch.log(sq) - b / sq).cpu().numpy()  # log Z_q - E_q[log r]
        redo[q0:q1] = ((sp < nn * UNDERFLOW_PER_ITEM) | (sq < nn * UNDERFLOW_PER_ITEM)).cpu().numpy()
    return ce, h, redo


def _online_gap(zq, zn, query_meta, db_meta, generator, uq_all, un_all, temperature, block_q, block_n, dev):
    """(H(q,p), H(q)) by the online-max tile walk; log r from the oracle rows `uq_all`/`un_all`
    (latent) or, when they are None, from `generator.log_ratio` per tile."""
    inv_tau = 1.0 / temperature
    oracle = uq_all is not None
    rq, rn = DeviceRows(zq, dev), DeviceRows(zn, dev)
    if oracle:
        ruq, run = DeviceRows(uq_all, dev), DeviceRows(un_all, dev)
    nq = zq.shape[0]
    ce = np.empty(nq, dtype=np.float64)
    h = np.empty(nq, dtype=np.float64)
    for q0 in range(0, nq, block_q):
        q1 = min(q0 + block_q, nq)
        bq = q1 - q0
        xq = rq[q0:q1] * inv_tau  # (bq, D) z/tau
        f64 = dict(dtype=torch.float64, device=dev)
        mp = torch.full((bq,), -math.inf, **f64)  # running max of s/tau
        sp = torch.zeros(bq, **f64)  # sum exp(s/tau - mp)
        mq = torch.full((bq,), -math.inf, **f64)  # running max of log r
        sq = torch.zeros(bq, **f64)  # S = sum exp(log r - mq)
        a = torch.zeros(bq, **f64)  # A = sum exp(log r - mq) * s/tau
        b = torch.zeros(bq, **f64)  # B = sum exp(log r - mq) * log r
        if oracle:
            uq = ruq[q0:q1]
        for n0 in range(0, zn.shape[0], block_n):
            n1 = min(n0 + block_n, zn.shape[0])
            xn = rn[n0:n1]
            lp = xq @ xn.T  # (bq, bn) fp32 logits s/tau
            # learned side: online logsumexp (tile sums in fp32, running sums in float64)
            new = torch.maximum(mp, lp.amax(dim=1).double())
            sp = sp * torch.exp(mp - new) + torch.exp(lp - new.float()[:, None]).sum(1).double()
            mp = new
            # ideal side: log r tile (bq, bn)
            if oracle:
                un = run[n0:n1]
                lr = uq @ un.T
                has_zero_r = False
            else:
                lr_np = np.asarray(generator.log_ratio(query_meta[q0:q1], db_meta[n0:n1]), dtype=np.float64)
                assert lr_np.shape == (bq, n1 - n0), (
                    f"log_ratio returned {lr_np.shape}, expected {(bq, n1 - n0)}"
                )
                has_zero_r = bool(np.isneginf(lr_np).any())
                lr = torch.as_tensor(lr_np, dtype=torch.float32, device=dev)
            new = torch.maximum(mq, lr.amax(dim=1).double())
            safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
            scale = torch.exp(mq - safe)  # 0 while the old max is -inf
            w = torch.exp(lr - safe.float()[:, None])  # q-weights up to 1/S; exp(-inf) = 0
            if has_zero_r:
                lr = lr.masked_fill(w == 0, 0.0)  # 0 * -inf = 0: items with r = 0 add nothing to E_q[log r]
            sq = sq * scale + w.sum(1).double()
            a = a * scale + torch.einsum("qn,qn->q", w, lp).double()
            b = b * scale + torch.einsum("qn,qn->q", w, lr).double()
            mq = new
        log_zp = mp + torch.log(sp)
        log_zq = mq + torch.log(sq)
        _rows_without_support(log_zq.cpu().numpy(), q0)
        ce[q0:q1] = (log_zp - a / sq).cpu().numpy()  # H(q,p) = log Z_p - E_q[s/tau]
        h[q0:q1] = (log_zq - b / sq).cpu().numpy()  # H(q)   = log Z_q - E_q[log r]
    return ce, h


def softmax_gap_dense(query_emb, db_emb, query_meta, db_meta, generator, temperature: float) -> GapResult:
    """Reference: full (Q, N) float64 matrices of log p and log q from `generator.log_ratio`."""
    zq, zn = _check_inputs(query_emb, db_emb, query_meta, db_meta, temperature)
    s = zq.astype(np.float64) @ zn.astype(np.float64).T / float(temperature)
    log_p = s - _lse(s)[:, None]
    lr = np.asarray(generator.log_ratio(query_meta, db_meta), dtype=np.float64)
    log_zq = _lse(lr)
    _rows_without_support(log_zq, 0)
    log_q = lr - log_zq[:, None]
    q = np.exp(log_q)
    with np.errstate(invalid="ignore"):  # 0 * -inf = 0 via the mask
        ce = -np.sum(np.where(q > 0, q * log_p, 0.0), axis=1)
        h = -np.sum(np.where(q > 0, q * log_q, 0.0), axis=1)
    return GapResult(ce, h, ce - h, float(temperature), getattr(generator, "name", None))


DENSE_BLOCK = 65536  # database rows converted to float64 at a time by ideal_and_learned


def ideal_and_learned(
    query_emb, db_emb, query_meta, db_meta, generator, temperature: float
) -> tuple[np.ndarray, np.ndarray]:
    """(q, p) as dense (Q, N) rows, for plotting a few sample queries in reports."""
    zq, zn = _check_inputs(query_emb, db_emb, query_meta, db_meta, temperature)
    q64 = zq.astype(np.float64)
    s = np.empty((zq.shape[0], zn.shape[0]))  # (Q, N) float64; the database is converted block by block,
    for n0 in range(0, zn.shape[0], DENSE_BLOCK):  # never as a whole N x D float64 copy (1 GB at 10^6 x 128)
        s[:, n0 : n0 + DENSE_BLOCK] = q64 @ zn[n0 : n0 + DENSE_BLOCK].astype(np.float64).T
    s /= float(temperature)
    p = np.exp(s - _lse(s)[:, None])
    lr = np.asarray(generator.log_ratio(query_meta, db_meta), dtype=np.float64)
    log_zq = _lse(lr)
    _rows_without_support(log_zq, 0)
    return np.exp(lr - log_zq[:, None]), p


def _lse(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=1)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return m_safe + np.log(np.sum(np.exp(x - m_safe[:, None]), axis=1))
