"""Tail statistics: fits against scipy, the query bootstrap's coverage of a known xi on simulated data,
the endpoint bound, the threshold choice and the Weibull-vs-Gumbel likelihoods."""

import numpy as np
import pytest
from scipy import optimize, stats

from search.evaluation.tail import (
    choose_threshold,
    gpd_fit,
    gpd_threshold_fit,
    gpd_threshold_stability,
    plot_daic,
    plot_tail,
    plot_threshold_stability,
    tail_diagnostics,
    weibull_gumbel,
    weibull_gumbel_mle,
)


def coverage_interval(trials: int, level: float = 0.95, conf: float = 0.999) -> tuple[float, float]:
    lo, hi = stats.binom.interval(conf, trials, level)
    return lo / trials, hi / trials


@pytest.mark.parametrize("xi", [-0.6, -0.3, 0.0, 0.3])
def test_gpd_fit_matches_scipy(xi):
    y = stats.genpareto.rvs(xi, scale=0.5, size=3000, random_state=1)
    f = gpd_fit(y)
    c, _, scale = stats.genpareto.fit(y, floc=0)
    assert f["xi"][0] == pytest.approx(c, abs=1e-3) and f["sigma"][0] == pytest.approx(scale, rel=1e-3)
    ll = stats.genpareto.logpdf(y, f["xi"][0], 0, f["sigma"][0]).sum()
    assert f["loglik"][0] == pytest.approx(ll, abs=1e-3)
    assert ll >= stats.genpareto.logpdf(y, c, 0, scale).sum() - 1e-3  # at least as high as scipy's optimum


def test_group_weights_equal_refit_on_replicated_data():
    """A bootstrap row of query counts gives the fit of the data with each query's pairs repeated that
    often."""
    rng = np.random.default_rng(0)
    y = stats.genpareto.rvs(-0.3, scale=0.2, size=(12, 30), random_state=rng)
    groups = np.repeat(np.arange(12), 30)
    counts = rng.multinomial(12, np.full(12, 1 / 12))
    weighted = gpd_fit(y.ravel(), groups, counts[None])
    replicated = gpd_fit(np.concatenate([np.tile(y[q], c) for q, c in enumerate(counts)]))
    assert weighted["xi"][0] == pytest.approx(replicated["xi"][0], abs=1e-6)
    assert weighted["loglik"][0] == pytest.approx(replicated["loglik"][0], rel=1e-8)


def _coverage(draw, xi_true, trials, n_queries, per_query, quantile=None, seed=0):
    hits = []
    for t in range(trials):
        rng = np.random.default_rng(seed + t)
        s = draw(rng, (n_queries, per_query))
        u = 0.0 if quantile is None else float(np.quantile(s, quantile))
        f = gpd_threshold_fit(
            s.ravel(),
            np.repeat(np.arange(n_queries), per_query),
            u,
            bound=np.inf if quantile is None else 1.0,
            n_boot=200,
            seed=t,
        )
        hits.append(f["xi_low"] <= xi_true <= f["xi_high"])
    return float(np.mean(hits))


def gpd_draw(xi):
    return lambda rng, size: stats.genpareto.rvs(xi, scale=0.1, size=size, random_state=rng)


def reversed_weibull_draw(beta):
    """s = 1 - delta with P(delta <= t) = t^beta: excesses over any u are exactly GPD(-1/beta), endpoint 1."""
    return lambda rng, size: 1.0 - rng.uniform(size=size) ** (1.0 / beta)


def test_gpd_interval_covers_known_xi_at_stated_rate():
    """200 data sets of 100 queries x 30 GPD(-0.4) excesses: the 95 % query-bootstrap interval holds xi."""
    cov = _coverage(gpd_draw(-0.4), -0.4, 200, 100, 30)
    lo, hi = coverage_interval(200)
    assert lo <= cov <= hi, cov


def test_reversed_weibull_xi_covered_at_stated_rate():
    """Shortfalls F(delta) = delta^2.5 (xi = -0.4 exactly above every threshold), 90 % threshold."""
    cov = _coverage(reversed_weibull_draw(2.5), -0.4, 200, 100, 300, quantile=0.9, seed=1000)
    lo, hi = coverage_interval(200)
    assert lo <= cov <= hi, cov


@pytest.mark.parametrize("xi", [-0.2, 0.2])
def test_gpd_interval_coverage_other_shapes(xi):
    cov = _coverage(gpd_draw(xi), xi, 200, 100, 30, seed=500)
    lo, hi = coverage_interval(200)
    assert lo <= cov <= hi, cov


def test_threshold_stability_on_reversed_weibull_recovers_xi_and_endpoint():
    s = reversed_weibull_draw(2.5)(np.random.default_rng(0), (100, 2000))
    r = gpd_threshold_stability(s, n_boot=100)
    assert len(r["fits"]) >= 8 and r["chosen"] <= 2, r["chosen_reason"]  # stable from (near) the bottom
    assert r["chosen_xi_low"] <= -0.4 <= r["chosen_xi_high"]
    assert r["chosen_endpoint"] == pytest.approx(1.0, abs=0.01)
    for f in r["fits"]:
        assert f["xi_low"] < f["xi"] < f["xi_high"] and 90 <= f["n_queries"] <= 100  # queries with an excess
        assert f["endpoint_constrained"] <= 1.0 + 1e-9


def test_constrained_fit_caps_the_endpoint():
    """Heavy-tailed excesses (xi = 0.2, no endpoint): the bounded fit puts the endpoint exactly on the
    bound."""
    y = stats.genpareto.rvs(0.2, scale=0.05, size=4000, random_state=3)
    y = y[y < 0.9]
    f = gpd_threshold_fit(y + 0.1, np.arange(y.size) % 50, 0.1, bound=1.0, n_boot=50)
    assert f["xi"] > 0 and not f["endpoint_within_bound"] and f["endpoint"] == np.inf
    assert f["xi_constrained"] < 0 and f["endpoint_constrained"] == pytest.approx(1.0, abs=1e-9)
    assert f["lr_bound"] > 10
    c = gpd_fit(y, upper=0.9)
    direct = stats.genpareto.logpdf(y, c["xi"][0], 0, c["sigma"][0]).sum()
    assert c["loglik"][0] == pytest.approx(direct, abs=1e-6)
    # here the optimum is on the boundary (endpoint = 0.9, sigma = -0.9 xi): scipy's bounded search over it
    # agrees
    best = optimize.minimize_scalar(
        lambda xi: -stats.genpareto.logpdf(y, xi, 0, -xi * 0.9).sum(), bounds=(-1, -1e-6), method="bounded"
    )
    assert c["loglik"][0] >= -best.fun - 1e-6


def test_choose_threshold_rule():
    def fit(xi, lo, hi):
        return {"xi": xi, "xi_low": lo, "xi_high": hi, "alpha": 0.05}

    stable = [
        fit(-0.30, -0.32, -0.28),
        fit(-0.45, -0.47, -0.43),
        fit(-0.46, -0.50, -0.42),
        fit(-0.44, -0.55, -0.35),
    ]
    k, why = choose_threshold(stable)
    assert k == 1 and "2 higher" in why
    drifting = [fit(-0.3, -0.31, -0.29), fit(-0.4, -0.41, -0.39), fit(-0.5, -0.52, -0.48)]
    k, why = choose_threshold(drifting)
    assert k == 2 and "no stable range" in why


def test_weibull_gumbel_mle_matches_scipy():
    rng = np.random.default_rng(1)
    s = 1 - rng.uniform(size=(5, 400)) ** (1 / 3)
    top = -np.sort(-s, axis=1)[:, :21]
    r = weibull_gumbel_mle(top)
    for q in range(5):
        y = top[q, :20] - top[q, 20]
        t = 1 - top[q, 20]
        # Weibull: GPD with xi = -1/beta and endpoint t (scale t / beta); maximise over beta numerically
        nll = lambda b: -stats.genpareto.logpdf(y, -1 / b, 0, t / b).sum()
        best = optimize.minimize_scalar(nll, bounds=(0.05, 200), method="bounded", options={"xatol": 1e-8})
        assert r["beta"][q] == pytest.approx(best.x, rel=1e-4)
        assert r["loglik_weibull"][q] == pytest.approx(-best.fun, abs=1e-6)
        _, scale = stats.expon.fit(y, floc=0)
        assert r["loglik_gumbel"][q] == pytest.approx(stats.expon.logpdf(y, 0, scale).sum(), abs=1e-8)
        assert r["daic"][q] == pytest.approx(2 * (r["loglik_weibull"][q] - r["loglik_gumbel"][q]))


def test_weibull_vs_gumbel_domains():
    rng = np.random.default_rng(0)
    near_bound = 1 - rng.uniform(size=(200, 2000)) ** (1 / 3)  # F(delta) = delta^3: Weibull domain, beta 3
    w = weibull_gumbel(-np.sort(-near_bound, axis=1)[:, :33])
    assert 2.5 < w["beta_median"] < 3.5 and w["fraction_weibull"] > 0.8 and w["daic_median"] > 2
    exp_tail = 0.3 + 0.03 * rng.exponential(size=(200, 2000))  # Gumbel domain, far below the bound
    g = weibull_gumbel(-np.sort(-exp_tail, axis=1)[:, :33])
    # the power law at a distant bound mimics the exponential: dAIC near 0, rarely decisive
    assert (
        abs(g["daic_mean"]) < 0.5 and g["fraction_weibull_decisive"] < 0.05 < w["fraction_weibull_decisive"]
    )
    assert g["daic_median"] < w["daic_median"]
    with pytest.raises(ValueError, match="bound"):
        weibull_gumbel_mle(np.full((2, 5), 1.5))


def test_queries_with_duplicates_at_the_bound_are_left_out_without_warnings():
    """A query whose m+1 nearest negatives are duplicates of it (similarity 1) has no tail: it is left out
    (counted), with no numpy divide-by-zero warning, and the rest is summarised as if it were absent."""
    import warnings

    rng = np.random.default_rng(3)
    s = 1 - rng.uniform(size=(6, 300)) ** (1 / 3)
    top = -np.sort(-s, axis=1)[:, :21]
    with_dups = top.copy()
    with_dups[[1, 4]] = 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = weibull_gumbel_mle(with_dups)
        w = weibull_gumbel(with_dups)
        assert weibull_gumbel(np.ones((3, 21))) is None
    assert r["at_bound"].tolist() == [False, True, False, False, True, False]
    assert np.isnan(r["daic"][[1, 4]]).all() and np.isfinite(np.delete(r["daic"], [1, 4])).all()
    alone = weibull_gumbel(top[[0, 2, 3, 5]])
    assert w["n_at_bound"] == 2 and alone["n_at_bound"] == 0 and w["n_queries"] == 4
    for key in ("daic_mean", "daic_median", "beta_median", "proxy_daic_median", "fraction_weibull"):
        assert w[key] == pytest.approx(alone[key], rel=1e-12)


def test_bundle_on_sphere_and_plots():
    rng = np.random.default_rng(2)
    z = rng.normal(size=(300, 8))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    neg = np.ones((40, 260), bool)
    neg[:, :5] = False  # e.g. each query's positives
    t = tail_diagnostics(z[:40], z[40:], neg, top_m=16, n_boot=20)
    # on the sphere S^7 the similarity has endpoint 1: a bounded tail, xi < 0 at the chosen threshold
    assert t["gpd"]["chosen_xi"] < 0 and t["gpd"]["n_pairs"] == 40 * 255 and t["negatives_per_query"] == 255
    assert t["weibull_gumbel"]["m"] == 16
    for png in (
        plot_threshold_stability(t["gpd"]),
        plot_tail(t),
        plot_daic(t["weibull_gumbel"]["daic_values"]),
    ):
        assert png[:4] == b"\x89PNG"
