"""WEINCE: InfoNCE limit, stop-gradient gates, tail fits on known laws, brute-force reference,
EMA and the distributed (gather) contract."""
import math

import numpy as np
import pytest
import torch

from training.losses import InfoNCELoss, LOSSES, contrastive_similarities, create_loss
from training.weince import WEINCELoss, fit_tail, tail_fit, weince_logits


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


@pytest.mark.parametrize("opts", [{"margin": "x"}, {"kappa_rho": 0}, {"quantile": 1.5}, {"m": 2},
                                  {"beta": "big"}, {"beta": -1.0}, {"fixed_lambda": 2.0}, {"nope": 1}])
def test_bad_options(opts):
    with pytest.raises(ValueError):
        create_loss("weince", **opts)


def test_lambda_zero_is_infonce_in_loss_and_gradient():
    za, zb = _views(dtype=torch.float32)
    out = {}
    for name, loss_fn in (("info", InfoNCELoss()), ("wei", WEINCELoss(fixed_lambda=0.0))):
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
    loss_fn = WEINCELoss(margin=0.0, kappa_aic=0.5)
    z = torch.cat([a, b])
    sim, pos, self_idx = contrastive_similarities(z, z, 0)
    lam, beta, _ = WEINCELoss(margin=0.0, kappa_aic=0.5).gates(sim, pos, self_idx)
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
    lam = sig(opts["kappa_rho"] * (np.log(rho0) - np.log(rho))) * sig(opts["kappa_aic"] * (daic - opts["margin"]))
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
    opts = dict(margin=0.0, kappa_rho=10.0, kappa_aic=1.0, quantile=0.2, m=16, tail_frac=0.1,
                burn_frac=0.05, eps=1e-6, beta=beta, beta_min=0.5, beta_max=16.0, shrink_c=20.0, ema=0.9)
    loss_fn = WEINCELoss(**opts)
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


def test_eval_mode_does_not_update_ema():
    loss_fn = WEINCELoss()
    za, zb = _views(seed=3)
    loss_fn(za, zb, 0.1)
    before = float(loss_fn.rho0_ema)
    loss_fn.eval()
    za2, zb2 = _views(seed=4)
    loss_fn(za2, zb2, 0.1)
    assert float(loss_fn.rho0_ema) == before
    assert "rho0_ema" in loss_fn.state_dict()


def test_two_ranks_with_gather_equal_single_process():
    # Simulate DDP with 2 ranks of n pairs: each rank sees its anchors against all candidates and
    # gathers per-anchor tensors; the mean of the rank losses must equal the single-process loss.
    za, zb = _views(n=16, seed=7)
    z_all = torch.cat([za, zb])
    opts = dict(margin=0.0, beta="auto", shrink_c=10.0)
    single = WEINCELoss(**opts)(za, zb, 0.1)
    n = 8
    locals_ = []
    for r in range(2):
        z_local = torch.cat([za[r * n:(r + 1) * n], zb[r * n:(r + 1) * n]])
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
    for key in ("weince_lambda_mean", "weince_beta_mean", "weince_rho0", "weince_daic_mean"):
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
