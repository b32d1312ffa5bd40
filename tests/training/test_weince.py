"""WEINCE: InfoNCE limit, stop-gradient gates, tail fits on known laws, brute-force reference,
EMA and the distributed (gather) contract."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from training.losses import LOSSES, InfoNCELoss, contrastive_similarities, create_loss
from training.weince import WEINCELoss, fit_tail, power_law_slope, tail_fit, weince_logits


def _views(n=24, d=8, seed=0, noise=0.3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, d, generator=g, dtype=dtype)
    za = torch.nn.functional.normalize(base + noise * torch.randn(n, d, generator=g, dtype=dtype), dim=1)
    zb = torch.nn.functional.normalize(base + noise * torch.randn(n, d, generator=g, dtype=dtype), dim=1)
    return za, zb


def test_registered():
    assert "weince" in LOSSES
    loss = create_loss("weince", margin=6.0, kappa_rho=20.0, kappa_aic=0.5)
    assert isinstance(loss, WEINCELoss) and loss.options()["margin"] == 6.0
    assert not list(loss.parameters())  # no trainable parameters


@pytest.mark.parametrize(
    "opts",
    [
        {"margin": "x"},
        {"kappa_rho": 0},
        {"quantile": 1.5},
        {"m": 2},
        {"beta": "big"},
        {"beta": -1.0},
        {"fixed_lambda": 2.0},
        {"nope": 1},
    ],
)
def test_bad_options(opts):
    with pytest.raises(ValueError):
        create_loss("weince", **opts)


def test_lambda_zero_is_infonce_in_loss_and_gradient():
    za, zb = _views(dtype=torch.float32)
    out = {}
    for name, loss_fn in (("info", InfoNCELoss()), ("wei", WEINCELoss(variant="blend", fixed_lambda=0.0))):
        a, b = za.clone().requires_grad_(), zb.clone().requires_grad_()
        res = loss_fn(a, b, 0.2)
        res.loss.backward()
        out[name] = (res.loss.detach(), a.grad, b.grad)
    assert torch.allclose(out["info"][0], out["wei"][0], atol=1e-6)
    assert torch.allclose(out["info"][1], out["wei"][1], atol=1e-6)
    assert torch.allclose(out["info"][2], out["wei"][2], atol=1e-6)


def test_gates_carry_no_gradient():
    za, zb = _views()
    a, b = za.clone().requires_grad_(), zb.clone().requires_grad_()
    loss_fn = WEINCELoss(variant="blend", margin=0.0, kappa_aic=0.5)
    z = torch.cat([a, b])
    sim, pos, self_idx = contrastive_similarities(z, z, 0)
    lam, beta, _ = WEINCELoss(variant="blend", margin=0.0, kappa_aic=0.5).gates(sim, pos, self_idx)
    assert not lam.requires_grad and not beta.requires_grad
    assert 0.05 < float(lam.mean()) < 0.95  # the test is not degenerate: gates are in play
    res = loss_fn.loss_from_similarities(sim, pos, self_idx, 0.1)
    g_full = torch.autograd.grad(res.loss, (a, b))
    # The same loss with lambda, beta as constants: if the gates were differentiated the
    # gradients would differ (d lambda / d s terms).
    a2, b2 = za.clone().requires_grad_(), zb.clone().requires_grad_()
    z2 = torch.cat([a2, b2])
    sim2, _, _ = contrastive_similarities(z2, z2, 0)
    logits = weince_logits(sim2, lam.clone(), beta.clone(), 0.1)
    logits = logits.scatter(1, self_idx[:, None], float("-inf"))
    ref = torch.nn.functional.cross_entropy(logits, pos)
    g_ref = torch.autograd.grad(ref, (a2, b2))
    assert torch.allclose(res.loss, ref, atol=1e-12)
    assert all(torch.allclose(x, y, atol=1e-12) for x, y in zip(g_full, g_ref))
    # perturbing the gates changes the loss value but they remain outside the graph
    logits_p = weince_logits(sim2.detach(), (lam * 0.5), beta + 1.0, 0.1)
    assert not logits_p.requires_grad


@pytest.mark.parametrize("beta", [0.5, 1.0, 3.0])
def test_fit_recovers_power_law_exponent(beta):
    # F(delta) = (delta / d0)^beta on [0, d0]: delta = d0 U^(1/beta); fit the top m of K.
    g = torch.Generator().manual_seed(int(10 * beta))
    u = torch.rand(64, 4000, generator=g, dtype=torch.float64)
    delta = 0.8 * u ** (1.0 / beta)
    top = delta.topk(256, dim=1, largest=False).values
    est, daic = fit_tail(top, burn=12)
    assert float(est.median()) == pytest.approx(beta, rel=0.10)
    assert float((daic > 0).float().mean()) > 0.8  # Weibull preferred on a power-law tail


def test_exponential_tail_favours_gumbel():
    # s = 0.3 + Exp(rate 20): log F(delta) = 20 delta + const exactly (delta = 1 - s), far from the cap.
    g = torch.Generator().manual_seed(5)
    x = -torch.log(torch.rand(64, 4000, generator=g, dtype=torch.float64)) / 20.0
    delta = (0.7 - x).clamp_min(1e-3)
    top = delta.topk(256, dim=1, largest=False).values
    fit = tail_fit(top, burn=12)
    assert float(fit.daic.median()) < 0
    assert float((fit.daic < 0).float().mean()) > 0.6
    assert float(fit.gumbel_rate.median()) == pytest.approx(20.0, rel=0.15)


def test_fit_matches_numpy_least_squares():
    g = torch.Generator().manual_seed(6)
    d = torch.rand(5, 40, generator=g, dtype=torch.float64)
    fit = tail_fit(d, burn=2)
    for r in range(5):
        x = np.sort(d[r].numpy())
        y = np.log(np.arange(1, 41) / 41.0)
        x, y = x[2:], y[2:]
        bw, aw = np.polyfit(np.log(x), y, 1)
        bg, ag = np.polyfit(x, y, 1)
        sse_w = np.sum((y - aw - bw * np.log(x)) ** 2)
        sse_g = np.sum((y - ag - bg * x) ** 2)
        aic = lambda sse: len(y) * math.log(sse / len(y)) + 2 * 2  # noqa: E731
        assert float(fit.beta[r]) == pytest.approx(bw, rel=1e-9)
        assert float(fit.gumbel_rate[r]) == pytest.approx(bg, rel=1e-9)
        assert float(fit.daic[r]) == pytest.approx(aic(sse_g) - aic(sse_w), rel=1e-7, abs=1e-9)


def _brute_force(sim, pos, self_idx, tau, opts, rho0_prev=None, beta_prev=None):
    """Per-anchor loop in NumPy float64 following the module definition."""
    sim = sim.detach().numpy()
    A, C = sim.shape
    K = C - 2
    m = min(K, max(opts["m"], int(round(opts["tail_frac"] * K))))
    burn = max(1, int(opts["burn_frac"] * m))
    rho, beta_hat, r2, daic = np.zeros(A), np.zeros(A), np.zeros(A), np.zeros(A)
    for i in range(A):
        negs = [sim[i, j] for j in range(C) if j not in (pos[i], self_idx[i])]
        d = np.sort(1.0 - np.array(negs))[:m]
        rho[i] = max(d[0], opts["eps"])
        y = np.log(np.arange(1, m + 1) / (m + 1.0))[burn:]
        x = np.maximum(d[burn:], opts["eps"])
        bw, aw = np.polyfit(np.log(x), y, 1)
        bg, ag = np.polyfit(x, y, 1)
        sse_w = np.sum((y - aw - bw * np.log(x)) ** 2)
        sse_g = np.sum((y - ag - bg * x) ** 2)
        n = len(y)
        daic[i] = (n * np.log(sse_g / n) + 4) - (n * np.log(sse_w / n) + 4)
        beta_hat[i] = bw
        r2[i] = max(0.0, 1 - sse_w / np.sum((y - y.mean()) ** 2))
    q = np.quantile(rho, opts["quantile"])
    rho0 = q if rho0_prev is None else opts["ema"] * rho0_prev + (1 - opts["ema"]) * q
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    lam = sig(opts["kappa_rho"] * (np.log(rho0) - np.log(rho))) * sig(
        opts["kappa_aic"] * (daic - opts["margin"])
    )
    bh = np.clip(beta_hat, opts["beta_min"], opts["beta_max"])
    if opts["beta"] == "auto":
        bb = bh.mean() if beta_prev is None else opts["ema"] * beta_prev + (1 - opts["ema"]) * bh.mean()
        w = len(y) * r2 / (len(y) * r2 + opts["shrink_c"])
        beta = np.clip(w * bh + (1 - w) * bb, opts["beta_min"], opts["beta_max"])
    else:
        bb, beta = None, np.full(A, opts["beta"])
    total = 0.0
    for i in range(A):
        logits = []
        for j in range(C):
            if j == self_idx[i]:
                continue
            s = sim[i, j]
            sc = min(s, 1 - opts["eps"])
            logits.append(((1 - lam[i]) * s / tau + lam[i] * beta[i] * -math.log(1 - sc), j == pos[i]))
        vals = np.array([v for v, _ in logits])
        mx = vals.max()
        lse = mx + math.log(np.exp(vals - mx).sum())
        total += lse - next(v for v, p in logits if p)
    return total / A, rho0, bb, lam


@pytest.mark.parametrize("beta", [1.0, "auto"])
def test_matches_brute_force_loop_over_two_steps(beta):
    opts = dict(
        margin=0.0,
        kappa_rho=10.0,
        kappa_aic=1.0,
        quantile=0.2,
        m=16,
        tail_frac=0.1,
        burn_frac=0.05,
        eps=1e-6,
        beta=beta,
        beta_min=0.5,
        beta_max=16.0,
        shrink_c=20.0,
        ema=0.9,
    )
    loss_fn = WEINCELoss(variant="blend", **opts)
    rho0, bb = None, None
    for step in range(2):  # second step exercises the EMA of rho_0 (and of the batch beta)
        za, zb = _views(n=20, seed=10 + step)
        z = torch.cat([za, zb])
        sim, pos, self_idx = contrastive_similarities(z, z, 0)
        res = loss_fn.loss_from_similarities(sim, pos, self_idx, 0.15)
        ref, rho0, bb, lam = _brute_force(sim, pos.tolist(), self_idx.tolist(), 0.15, opts, rho0, bb)
        assert float(res.loss) == pytest.approx(ref, rel=1e-9)
        assert res.stats["weince_lambda_mean"] == pytest.approx(lam.mean(), rel=1e-9)
        assert float(loss_fn.rho0_ema) == pytest.approx(rho0, rel=1e-12)


@pytest.mark.parametrize("variant", ["paper", "blend"])
def test_eval_mode_does_not_update_ema(variant):
    loss_fn = WEINCELoss(variant=variant)
    za, zb = _views(seed=3)
    loss_fn(za, zb, 0.1)
    before = float(loss_fn.rho0_ema)
    loss_fn.eval()
    za2, zb2 = _views(seed=4)
    loss_fn(za2, zb2, 0.1)
    assert float(loss_fn.rho0_ema) == before
    assert {"rho0_ema", "weib_beta_ema"} <= set(loss_fn.state_dict())


@pytest.mark.parametrize("variant,tail_points", [("paper", 100), ("paper", 1024), ("blend", 1024)])
def test_two_ranks_with_gather_equal_single_process(variant, tail_points):
    # Simulate DDP with 2 ranks of n pairs: each rank sees its anchors against all candidates and
    # gathers per-anchor tensors; the mean of the rank losses must equal the single-process loss.
    # beta_t tail: 100 points are cut from the two ranks' 2 x 100; 1024 keeps all 960 negatives,
    # two sorted halves that must be merged.
    za, zb = _views(n=16, seed=7)
    z_all = torch.cat([za, zb])
    opts = dict(
        variant=variant,
        margin=0.0,
        beta="auto",
        shrink_c=10.0,
        weib_min_tail_points=tail_points,
        weib_top_m=8,
        pl_top_m=12,
        weib_r2_min=0.0,
    )
    single = WEINCELoss(**opts)(za, zb, 0.1)
    n = 8
    locals_ = []
    for r in range(2):
        z_local = torch.cat([za[r * n : (r + 1) * n], zb[r * n : (r + 1) * n]])
        locals_.append(contrastive_similarities(z_local, z_all, r * n))
    # Each rank's gathered inputs depend on earlier gathered statistics (rho_0 -> lambda -> stats),
    # so iterate: every pass records the local inputs and serves the previous pass's concatenation.
    recorded = None
    for _ in range(4):
        new_rec, outs = [[], []], []
        for r in range(2):

            def gather(x, r=r, k=iter(range(100))):
                i = next(k)
                new_rec[r].append(x.detach().clone())
                return x.detach() if recorded is None else torch.cat([recorded[0][i], recorded[1][i]])

            outs.append(WEINCELoss(**opts).loss_from_similarities(*locals_[r], 0.1, gather=gather))
        recorded = new_rec
    assert float((outs[0].loss + outs[1].loss) / 2) == pytest.approx(float(single.loss), rel=1e-10)
    assert set(outs[0].stats) == set(single.stats)
    if variant == "paper":
        assert single.stats["weince_beta_t_updated"] == 1.0 and single.stats["weince_beta_t"] != 4.0
    for key in single.stats:
        assert outs[0].stats[key] == pytest.approx(single.stats[key], rel=1e-10)
        assert outs[1].stats[key] == pytest.approx(single.stats[key], rel=1e-10)


def test_stats_present_and_in_range():
    za, zb = _views(n=32, seed=8, dtype=torch.float32)
    res = WEINCELoss()(za, zb, 0.1)
    for key in ("weince_lambda_mean", "weince_lambda_frac_gt_half", "weince_beta_mean", "weince_daic_mean"):
        assert key in res.stats and math.isfinite(res.stats[key])
    assert 0.0 <= res.stats["weince_lambda_mean"] <= 1.0
    assert res.stats["weince_beta_mean"] == pytest.approx(1.0)
    assert torch.isfinite(res.loss)


def test_near_duplicate_negative_is_finite():
    # a negative identical to the anchor (s = 1) must not produce inf / nan thanks to the clamp
    za, zb = _views(n=8, seed=9)
    za[1] = za[0]
    a = za.clone().requires_grad_()
    res = WEINCELoss(fixed_lambda=1.0)(a, zb, 0.1)
    res.loss.backward()
    assert torch.isfinite(res.loss) and torch.isfinite(a.grad).all()


# ---------------------------------------------------------------------------------------------
# variant="blend" is the blend-only loss as it was before the paper variant existed; variant="paper"
# is the reference's as-run objective (blend + two top-M terms + beta_t rule), checked against a
# plain float64 NumPy loop of the written formulas.

GOLDEN = Path(__file__).parent / "data" / "weince_blend_golden.npz"


@pytest.mark.parametrize("tag,opts", [("default", {}), ("auto", {"beta": "auto", "margin": 0.0})])
def test_blend_variant_equals_the_previous_implementation(tag, opts):
    # Loss and gradients recorded from training/weince.py before the variants existed (two steps,
    # so the rho_0 / beta EMAs are exercised); the blend variant must reproduce them exactly.
    golden = np.load(GOLDEN)
    loss_fn = WEINCELoss(variant="blend", **opts)
    for step in range(2):
        za, zb = _views(n=24, d=8, seed=40 + step)
        a, b = za.clone().requires_grad_(), zb.clone().requires_grad_()
        res = loss_fn(a, b, 0.2)
        res.loss.backward()
        assert float(res.loss.detach()) == pytest.approx(float(golden[f"{tag}_step{step}_loss"]), rel=1e-13)
        np.testing.assert_allclose(a.grad.numpy(), golden[f"{tag}_step{step}_grad_a"], rtol=1e-11, atol=1e-14)
        np.testing.assert_allclose(b.grad.numpy(), golden[f"{tag}_step{step}_grad_b"], rtol=1e-11, atol=1e-14)
        assert res.stats["weince_lambda_mean"] == pytest.approx(
            float(golden[f"{tag}_step{step}_lambda_mean"])
        )
        assert not any(
            k.startswith(("weince_beta_t", "weince_loss_weib", "weince_loss_pl")) for k in res.stats
        )


def test_variant_defaults_and_explicit_overrides():
    paper, blend = WEINCELoss().options(), WEINCELoss(variant="blend").options()
    assert paper["variant"] == "paper"
    assert (paper["weib_lambda"], paper["pl_lambda"], paper["weib_top_m"], paper["pl_top_m"]) == (
        0.5,
        0.5,
        50,
        50,
    )
    assert (
        paper["weib_beta"],
        paper["weib_beta_init"],
        paper["weib_beta_momentum"],
        paper["weib_r2_min"],
    ) == ("auto", 4.0, 0.9, 0.85)
    assert (paper["gumbel_proxy"], paper["slope_penalty"], paper["ema"], paper["rho0_rule"]) == (
        "loglog",
        True,
        0.0,
        "nearest",
    )
    assert (blend["weib_lambda"], blend["pl_lambda"], blend["gumbel_proxy"], blend["ema"]) == (
        0.0,
        0.0,
        "exponential",
        0.9,
    )
    # an explicit option beats the variant's default, and options() rebuilds the same loss
    mixed = WEINCELoss(variant="blend", weib_lambda=0.5, gumbel_proxy="loglog")
    assert mixed.options()["weib_lambda"] == 0.5 and mixed.options()["gumbel_proxy"] == "loglog"
    assert WEINCELoss(**mixed.options()).options() == mixed.options()
    assert create_loss("weince", variant="blend").options() == blend


@pytest.mark.parametrize(
    "opts",
    [
        {"variant": "full"},
        {"gumbel_proxy": "weibull"},
        {"rho0_rule": "mid"},
        {"slope_penalty": "yes"},
        {"weib_lambda": -0.1},
        {"pl_top_m": 0},
        {"weib_top_m": 2.5},
        {"weib_beta": "fit"},
        {"weib_beta_momentum": 1.5},
        {"weib_r2_min": 2.0},
        {"weib_min_tail_points": 5},
        {"weib_tail_frac": 0.0},
    ],
)
def test_bad_paper_options(opts):
    with pytest.raises(ValueError):
        create_loss("weince", **opts)


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def _ols(x, y):
    """slope and residual sum of squares of y ~ a + b x (NumPy polyfit)."""
    b, a = np.polyfit(x, y, 1)
    return b, float(np.sum((y - a - b * x) ** 2))


def _paper_reference(za, zb, tau, o, beta_t_prev):
    """The paper variant written out per anchor in NumPy float64.

    Returns (loss(z), lam, beta_t, terms(z)): lam and beta_t are computed once from the batch (stop
    gradient); loss(z) re-selects the top-M negatives from z and keeps lam, beta_t fixed, so a
    finite-difference gradient of loss(z) is the gradient the written objective prescribes.
    """
    z0 = np.concatenate([za, zb])
    n_pairs, A = len(za), 2 * len(za)
    pos = [(i + n_pairs) % A for i in range(A)]
    eps = o["eps"]
    negs_of = lambda s, i: [j for j in range(A) if j not in (i, pos[i])]  # noqa: E731
    sim = z0 @ z0.T
    K = A - 2
    m = min(K, max(o["m"], int(round(o["tail_frac"] * K))))
    burn = max(1, m // 20)
    rho, daic = np.zeros(A), np.zeros(A)
    f = np.arange(1, m + 1) / (m + 1.0)
    y_w, y_g = np.log(f)[burn:], np.log(-np.log(f))[burn:]
    for i in range(A):
        d = np.sort([1.0 - sim[i, j] for j in negs_of(sim, i)])[:m]
        rho[i] = max(d[0], eps)
        x = np.log(np.maximum(d[burn:], eps))
        b_w, sse_w = _ols(x, y_w)
        b_g, sse_g = _ols(x, y_g)  # Gumbel proxy log(-log F) on log delta
        sse_w += 1e6 if b_w <= 0 else 0.0  # bad-slope penalties
        sse_g += 1e6 if b_g >= 0 else 0.0
        k = len(y_w)
        daic[i] = (k * np.log(sse_g / k) + 4) - (k * np.log(sse_w / k) + 4)
    rho0 = np.sort(rho)[int(round(o["quantile"] * (A - 1)))]
    lam = _sigmoid(o["kappa_rho"] * (np.log(rho0) - np.log(rho))) * _sigmoid(
        o["kappa_aic"] * (daic - o["margin"])
    )
    # beta_t: power-law slope of the smallest max(1024, 5 %) shortfalls of all negatives
    all_d = np.sort([1.0 - sim[i, j] for i in range(A) for j in negs_of(sim, i)])
    k_tail = min(len(all_d), max(o["weib_min_tail_points"], int(o["weib_tail_frac"] * len(all_d))))
    tb = max(1, k_tail // 20)
    x = np.log(np.maximum(all_d[:k_tail], eps))[tb:]
    y = np.log(np.arange(1, k_tail + 1) / (k_tail + 1.0))[tb:]
    slope, sse = _ols(x, y)
    r2 = 1.0 - sse / np.sum((y - y.mean()) ** 2)
    beta_t = beta_t_prev
    if r2 >= o["weib_r2_min"] and slope > 0:
        beta_t = 0.9 * beta_t_prev + 0.1 * min(o["beta_max"], max(o["beta_min"], slope))

    def ce(logits, target):
        mx = max(logits)
        return mx + math.log(sum(math.exp(v - mx) for v in logits)) - logits[target]

    def terms(z):
        s = z @ z.T
        out = np.zeros((A, 3))
        for i in range(A):
            cands = [j for j in range(A) if j != i]
            blend = [
                (1 - lam[i]) * s[i, j] / tau + lam[i] * -math.log(1 - min(s[i, j], 1 - eps)) for j in cands
            ]
            out[i, 0] = ce(blend, cands.index(pos[i]))
            hardest = sorted(negs_of(s, i), key=lambda j: -s[i, j])
            top_w = [pos[i]] + hardest[: o["weib_top_m"]]
            out[i, 1] = ce([-beta_t * math.log(1 - min(s[i, j], 1 - eps)) for j in top_w], 0)
            top_p = [pos[i]] + hardest[: o["pl_top_m"]]
            out[i, 2] = ce([s[i, j] / tau for j in top_p], 0)
        return out

    def loss(z):
        t = terms(z).mean(axis=0)
        return t[0] + o["weib_lambda"] * t[1] + o["pl_lambda"] * t[2]

    return loss, lam, (beta_t, slope, r2), terms


def test_paper_variant_matches_plain_formulas_value_and_gradient():
    # n = 24 pairs: 46 negatives per anchor, gate tail m = 32, top-M 10 / 16 (a real selection),
    # beta_t tail = 1024 of the 2208 negatives; two steps exercise the beta_t EMA.
    o = dict(WEINCELoss().options(), weib_top_m=10, pl_top_m=16)
    loss_fn = WEINCELoss(**o)
    tau, beta_prev, n, d = 0.5, 4.0, 24, 8
    for step in range(2):
        za, zb = _views(n=n, d=d, seed=60 + step, noise=0.4)
        a, b = za.clone().requires_grad_(), zb.clone().requires_grad_()
        res = loss_fn(a, b, tau)
        res.loss.backward()
        ref_loss, lam, (beta_t, slope, r2), ref_terms = _paper_reference(
            za.numpy(), zb.numpy(), tau, o, beta_prev
        )
        assert 0.05 < lam.mean() < 0.95  # the gates are in play
        assert r2 >= 0.85 and beta_t != beta_prev  # the EMA moved
        z0 = torch.cat([za, zb]).numpy()
        assert float(res.loss) == pytest.approx(ref_loss(z0), rel=1e-10)
        t = ref_terms(z0).mean(axis=0)
        for key, value in zip(("blend", "weib_topm", "pl_topm"), t):
            assert res.stats[f"weince_loss_{key}"] == pytest.approx(value, rel=1e-10)
        assert res.stats["weince_lambda_mean"] == pytest.approx(lam.mean(), rel=1e-9)
        assert res.stats["weince_beta_t"] == pytest.approx(beta_t, rel=1e-12)
        assert res.stats["weince_beta_t_hat"] == pytest.approx(slope, rel=1e-9)
        assert res.stats["weince_beta_t_r2"] == pytest.approx(r2, rel=1e-9)
        assert float(loss_fn.weib_beta_ema) == pytest.approx(beta_t, rel=1e-12)
        # central differences of the written loss (lam, beta_t held, as the stop-gradient prescribes)
        h, grad = 1e-6, np.zeros_like(z0)
        for idx in np.ndindex(*z0.shape):
            zp, zm = z0.copy(), z0.copy()
            zp[idx] += h
            zm[idx] -= h
            grad[idx] = (ref_loss(zp) - ref_loss(zm)) / (2 * h)
        got = torch.cat([a.grad, b.grad]).numpy()
        np.testing.assert_allclose(got, grad, rtol=1e-6, atol=1e-8)
        beta_prev = beta_t


def test_beta_t_gate_keeps_the_ema_on_a_poor_fit():
    za, zb = _views(n=24, seed=70)
    loss_fn = WEINCELoss(weib_r2_min=1.0)  # no fit reaches R^2 = 1: beta_t stays at its start value
    res = loss_fn(za, zb, 0.5)
    assert res.stats["weince_beta_t_updated"] == 0.0 and res.stats["weince_beta_t"] == 4.0
    fixed = WEINCELoss(weib_beta=2.5)(za, zb, 0.5)
    assert fixed.stats["weince_beta_t"] == 2.5


def test_power_law_slope_recovers_exponent_and_matches_numpy():
    g = torch.Generator().manual_seed(71)
    d = (0.9 * torch.rand(20000, generator=g, dtype=torch.float64) ** (1 / 3.0)).sort().values[:2000]
    slope, r2 = power_law_slope(d)
    assert slope == pytest.approx(3.0, rel=0.05) and r2 > 0.99
    burn = 2000 // 20
    x = np.log(d.numpy())[burn:]
    y = np.log(np.arange(1, 2001) / 2001.0)[burn:]
    b, sse = _ols(x, y)
    assert slope == pytest.approx(b, rel=1e-10)
    assert r2 == pytest.approx(1 - sse / np.sum((y - y.mean()) ** 2), rel=1e-10)


def test_beta_t_survives_a_state_dict_round_trip():
    za, zb = _views(n=24, seed=72)
    loss_fn = WEINCELoss()
    for _ in range(3):
        loss_fn(za, zb, 0.5)
    state = loss_fn.state_dict()
    resumed = WEINCELoss()
    resumed.load_state_dict(state)
    assert float(resumed.weib_beta_ema) == float(loss_fn.weib_beta_ema) != 4.0
    old = {k: v for k, v in state.items() if k != "weib_beta_ema"}  # a checkpoint from before beta_t
    older = WEINCELoss()
    older.load_state_dict(old)
    assert float(older.weib_beta_ema) == 4.0


def test_slope_penalty_neutralises_a_degenerate_tail():
    # Tied shortfalls (a collapsed batch): both slopes are 0, i.e. of the wrong sign. The reference
    # penalises both fits equally, so dAIC ~ 0 instead of the ratio of the two responses' variances.
    tied = torch.full((3, 40), 0.3, dtype=torch.float64)
    plain = tail_fit(tied, burn=2, gumbel="loglog")
    penal = tail_fit(tied, burn=2, gumbel="loglog", slope_penalty=True)
    assert abs(float(plain.daic[0])) > 10
    assert abs(float(penal.daic[0])) < 1e-2
    # a proper tail is untouched by the penalty
    g = torch.Generator().manual_seed(73)
    d = torch.rand(4, 40, generator=g, dtype=torch.float64)
    assert torch.equal(
        tail_fit(d, burn=2, gumbel="loglog").daic,
        tail_fit(d, burn=2, gumbel="loglog", slope_penalty=True).daic,
    )


def test_float32_fit_sse_matches_float64_residuals():
    """dAIC in float32 agrees with a float64 numpy fit of the same rows: the SSE is the sum of squared
    residuals, not Syy - b Sxy (which cancels in float32 when the fit is good)."""
    rng = np.random.default_rng(7)
    m, rows = 256, 64
    # near-exact power-law tails (R^2 ~ 1): the regime where the shortcut formula loses digits
    quantiles = np.arange(1, m + 1) / (m + 1)
    d = np.sort(quantiles ** (1.0 / 3.0) * 0.5 * np.exp(1e-3 * rng.standard_normal((rows, m))), axis=1)
    fit = tail_fit(torch.tensor(d, dtype=torch.float32), presorted=True)
    dd = torch.tensor(d, dtype=torch.float32).double().numpy().clip(1e-6)
    y = np.log(np.arange(1, m + 1) / (m + 1))

    def sse(x):
        xc, yc = x - x.mean(), y - y.mean()
        b = (xc * yc).sum() / (xc * xc).sum()
        return ((yc - b * xc) ** 2).sum()

    ref = np.array([m * (np.log(sse(row)) - np.log(sse(np.log(row)))) for row in dd])
    np.testing.assert_allclose(fit.daic.numpy(), ref, rtol=2e-4, atol=2e-4)
