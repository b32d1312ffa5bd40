import numpy as np
import pytest
from search_refs import GenericLatent, Instance, Labels, VonMises, oracle, unit

from search.evaluation.gap import ideal_and_learned, softmax_gap, softmax_gap_dense

RNG = np.random.default_rng(0)


def _rel(a, b):
    return np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-3))


def _assert_close(res, ref, tol=1e-5):
    for f in ("cross_entropy", "ideal_entropy", "kl"):
        a, b = getattr(res, f), getattr(ref, f)
        if f == "kl":  # KL can be tiny: compare against the scale of H(q,p)
            assert np.max(np.abs(a - b)) < tol * max(1.0, np.max(np.abs(ref.cross_entropy))), f
        else:
            assert _rel(a, b) < tol, (f, _rel(a, b))


@pytest.mark.parametrize("gen", [VonMises(4.0), GenericLatent(4.0)])
def test_latent_streaming_matches_dense(gen):
    qlat = RNG.uniform(0, 2 * np.pi, (37, 3))
    dlat = RNG.uniform(0, 2 * np.pi, (211, 3))
    zq, zd = unit(RNG.normal(size=(37, 16))), unit(RNG.normal(size=(211, 16)))
    ref = softmax_gap_dense(zq, zd, qlat, dlat, gen, 0.1)
    res = softmax_gap(zq, zd, qlat, dlat, gen, 0.1, block_q=8, block_n=50)
    _assert_close(res, ref)
    assert np.all(ref.kl > 0)


def test_label_fast_path_matches_dense():
    qlab, dlab = RNG.integers(0, 5, 40), RNG.integers(0, 5, 300)
    zq, zd = unit(RNG.normal(size=(40, 8))), unit(RNG.normal(size=(300, 8)))
    ref = softmax_gap_dense(zq, zd, qlab, dlab, Labels(), 0.07)
    res = softmax_gap(zq, zd, qlab, dlab, Labels(), 0.07, block_q=16, block_n=64)
    _assert_close(res, ref)
    # H(q) = log n_c in closed form
    counts = np.bincount(dlab, minlength=5)
    np.testing.assert_allclose(res.ideal_entropy, np.log(counts[qlab]), rtol=1e-12)


def test_instance_point_mass():
    zd = unit(RNG.normal(size=(120, 8)))
    idx = RNG.choice(120, 30, replace=False)
    zq = unit(zd[idx] + 0.1 * RNG.normal(size=(30, 8)))
    ref = softmax_gap_dense(zq, zd, idx, np.arange(120), Instance(), 0.2)
    res = softmax_gap(zq, zd, idx, np.arange(120), Instance(), 0.2, block_q=7, block_n=33)
    _assert_close(res, ref)
    # q is a point mass: H(q) = 0 and H(q,p) = -log p(source | x)
    np.testing.assert_allclose(res.ideal_entropy, 0.0, atol=1e-12)
    s = zq @ zd.T / 0.2
    logp = s - np.log(np.exp(s).sum(1))[:, None]
    np.testing.assert_allclose(res.cross_entropy, -logp[np.arange(30), idx], rtol=1e-5)


def test_oracle_embedding_gap_vanishes_and_random_does_not():
    m, kappa = 3, 5.0
    qlat, dlat = RNG.uniform(0, 2 * np.pi, (50, m)), RNG.uniform(0, 2 * np.pi, (400, m))
    gen = VonMises(kappa)
    tau = 1.0 / (m * kappa)
    res = softmax_gap(oracle(qlat), oracle(dlat), qlat, dlat, gen, tau, block_q=16, block_n=128)
    assert abs(res.summary()["gap"]) < 1e-4
    rnd = softmax_gap(unit(RNG.normal(size=(50, 6))), unit(RNG.normal(size=(400, 6))), qlat, dlat, gen, tau)
    assert rnd.summary()["gap"] > 1e3 * max(abs(res.summary()["gap"]), 1e-6)
    assert rnd.summary()["gap"] > 0.1


def test_q_and_p_are_distributions():
    qlat, dlat = RNG.uniform(0, 2 * np.pi, (5, 2)), RNG.uniform(0, 2 * np.pi, (60, 2))
    q, p = ideal_and_learned(oracle(qlat), oracle(dlat), qlat, dlat, VonMises(2.0), 0.3)
    np.testing.assert_allclose(q.sum(1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(p.sum(1), 1.0, rtol=1e-12)
    q, _ = ideal_and_learned(
        oracle(qlat), oracle(dlat), np.array([0, 1, 2, 3, 4]) % 2, np.arange(60) % 3, Labels(), 0.3
    )
    np.testing.assert_allclose(q.sum(1), 1.0, rtol=1e-12)


def test_dense_rows_are_blocked_over_the_database(monkeypatch):
    """ideal_and_learned converts the database to float64 in blocks: the same p as one dense product."""
    import search.evaluation.gap as gap_module

    qlat, dlat = RNG.uniform(0, 2 * np.pi, (4, 3)), RNG.uniform(0, 2 * np.pi, (103, 3))
    zq, zn = oracle(qlat).astype(np.float32), oracle(dlat).astype(np.float32)
    s = zq.astype(np.float64) @ zn.astype(np.float64).T / 0.2
    ref = np.exp(s - s.max(1, keepdims=True))
    ref /= ref.sum(1, keepdims=True)
    monkeypatch.setattr(gap_module, "DENSE_BLOCK", 10)  # 11 blocks, the last one ragged
    _, p = ideal_and_learned(zq, zn, qlat, dlat, VonMises(2.0), 0.2)
    np.testing.assert_allclose(p, ref, rtol=1e-12)


def test_bad_inputs():
    z = unit(RNG.normal(size=(4, 3)))
    with pytest.raises(ValueError, match="temperature"):
        softmax_gap(z, z, np.arange(4), np.arange(4), Instance(), -1.0)
    with pytest.raises(ValueError, match="absent"):
        softmax_gap(z, z, np.array([9, 0, 0, 0]), np.zeros(4, int), Labels(), 0.1)
    with pytest.raises(ValueError, match="r = 0"):
        softmax_gap(z, z, np.array([9, 0, 1, 2]), np.arange(4), Instance(), 0.1)
    with pytest.raises(ValueError, match="shapes"):
        softmax_gap(z, z[:, :2], np.arange(4), np.arange(4), Instance(), 0.1)


@pytest.mark.parametrize("name", ["latent", "label", "instance"])
def test_project_generators_streaming_matches_dense(name):
    from training.generators import create_generator
    from training.synthetic import oracle_embedding

    gen = create_generator(name, kappa=3.0) if name == "latent" else create_generator(name)
    if name == "latent":
        qm, dm = RNG.uniform(0, 2 * np.pi, (30, 3)), RNG.uniform(0, 2 * np.pi, (150, 3))
        # the device fast path's log r equals the generator's own log_ratio
        tau = 1 / (3 * 3.0)
        res = softmax_gap(oracle_embedding(qm), oracle_embedding(dm), qm, dm, gen, tau, block_q=8, block_n=40)
        assert abs(res.summary()["gap"]) < 1e-4
    elif name == "label":
        qm, dm = RNG.integers(0, 4, 30), RNG.integers(0, 4, 150)
    else:
        qm, dm = RNG.choice(150, 30, replace=False), np.arange(150)
    zq, zd = unit(RNG.normal(size=(30, 8))), unit(RNG.normal(size=(150, 8)))
    ref = softmax_gap_dense(zq, zd, qm, dm, gen, 0.1)
    _assert_close(softmax_gap(zq, zd, qm, dm, gen, 0.1, block_q=8, block_n=40), ref)
    assert ref.summary()["generator"] == name


def test_generic_path_only_sees_tiles():
    """The generic path asks the generator for (block_q, block_n) tiles only, never the Q x N block."""

    class Spy(GenericLatent):
        shapes = []

        def log_ratio(self, qm, dm):
            self.shapes.append((len(qm), len(dm)))
            return super().log_ratio(qm, dm)

    gen = Spy(1.5)
    qm, dm = RNG.uniform(0, 2 * np.pi, (23, 2)), RNG.uniform(0, 2 * np.pi, (101, 2))
    zq, zd = unit(RNG.normal(size=(23, 4))), unit(RNG.normal(size=(101, 4)))
    res = softmax_gap(zq, zd, qm, dm, gen, 0.2, block_q=10, block_n=30)
    assert max(a for a, _ in gen.shapes) <= 10 and max(b for _, b in gen.shapes) <= 30
    assert sum(a * b for a, b in gen.shapes) == 23 * 101  # every pair exactly once
    gen.shapes.clear()
    _assert_close(res, softmax_gap_dense(zq, zd, qm, dm, gen, 0.2))


# --- fused fixed-shift tile kernels (search/evaluation/fused.py) ---------------------------------------


def _fused_case(rng, q=150, n=2600, d=24):
    zq, zd = unit(rng.normal(size=(q, d))), unit(rng.normal(size=(n, d)))
    return (
        zq,
        zd,
        rng.uniform(0, 2 * np.pi, (q, 3)),
        rng.uniform(0, 2 * np.pi, (n, 3)),
        rng.integers(0, 6, q),
        rng.integers(0, 6, n),
    )


@pytest.mark.parametrize("tau", [0.1, 0.03, 0.004])
def test_fixed_shift_eager_matches_dense_including_underflow_rows(tau, monkeypatch):
    """fused=True without a compiler runs the same fixed-shift formula eagerly; at tau = 0.004 the
    shift |x| max|y| = 250 underflows whole rows, which must be detected and redone exactly."""
    import search.evaluation.gap as gap_mod

    monkeypatch.setattr(gap_mod, "fused_supported", lambda dev: True)
    monkeypatch.setattr(gap_mod.TileSums, "_failed", False)  # restored after the test
    monkeypatch.setattr(
        gap_mod.TileSums,
        "_kernels",
        classmethod(lambda cls: (_ for _ in ()).throw(RuntimeError("no compiler"))),
    )
    redone = []
    online = gap_mod._online_gap
    monkeypatch.setattr(
        gap_mod, "_online_gap", lambda zq, *a, **k: (redone.append(len(zq)), online(zq, *a, **k))[1]
    )
    zq, zd, lq, ld, cq, cd = _fused_case(np.random.default_rng(3))
    for gen, mq, md in [(VonMises(4.0), lq, ld), (Labels(), cq, cd)]:
        ref = softmax_gap_dense(zq, zd, mq, md, gen, tau)
        res = softmax_gap(zq, zd, mq, md, gen, tau, block_q=32, block_n=512, fused=True)
        _assert_close(res, ref)
    assert gap_mod.TileSums._failed  # the failing compile was noticed once, then everything ran eagerly
    if tau < 0.01:
        assert redone and 0 < redone[0] <= len(zq)  # the underflow fallback really ran
    else:
        assert not redone


@pytest.mark.slow
def test_compiled_tile_kernels_match_eager_and_dense():
    """The torch.compile'd kernels (full tiles) and the eager edges give the dense answer."""
    import torch

    from search.evaluation.fused import TileSums, fused_supported

    if not fused_supported(torch.device("cpu")):
        pytest.skip("no C++ compiler for torch.compile on this machine")
    from search.evaluation.fused import latent_sums, partition_sum

    g = torch.Generator().manual_seed(0)
    lp, uq, un = (
        torch.randn(32, 1024, generator=g) * 4,
        torch.randn(32, 6, generator=g),
        torch.randn(1024, 6, generator=g),
    )
    shift_p = lp.amax(1) + 0.5
    shift_q = torch.linalg.vector_norm(uq, dim=1) * torch.linalg.vector_norm(un, dim=1).max()
    sums = TileSums(compiled=True)
    compiled = sums.latent(lp, uq, un, shift_p, shift_q, full=True)
    assert sums.compiled  # compilation worked (a failure would have switched the instance to eager)
    for got, want in zip(compiled, latent_sums(lp, uq, un, shift_p, shift_q, broadcast=False)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        sums.partition(lp, shift_p, full=True), partition_sum(lp, shift_p), rtol=1e-5, atol=1e-6
    )
    assert sums.compiled

    zq, zd, lq, ld, cq, cd = _fused_case(np.random.default_rng(4), q=96, n=3000)
    for gen, mq, md in [(VonMises(4.0), lq, ld), (Labels(), cq, cd)]:
        ref = softmax_gap_dense(zq, zd, mq, md, gen, 0.07)
        res = softmax_gap(
            zq, zd, mq, md, gen, 0.07, block_q=32, block_n=1024, fused=True
        )  # full + ragged tiles
        _assert_close(res, ref)
        eager = softmax_gap(zq, zd, mq, md, gen, 0.07, block_q=32, block_n=1024, fused=False)
        np.testing.assert_allclose(res.kl, eager.kl, rtol=1e-5)


def test_fused_auto_and_opt_out(monkeypatch):
    import torch

    import search.evaluation.gap as gap_mod
    from search.evaluation.fused import fused_supported

    cpu = torch.device("cpu")
    monkeypatch.setattr(gap_mod, "fused_supported", lambda dev: True)
    assert not gap_mod._use_fused(None, cpu, gap_mod.FUSED_MIN_PAIRS - 1)  # small: no compile
    assert gap_mod._use_fused(None, cpu, gap_mod.FUSED_MIN_PAIRS)
    assert not gap_mod._use_fused(False, cpu, 10**12)
    monkeypatch.setenv("SOFTSEARCH_NO_COMPILE", "1")
    assert not fused_supported(cpu)
