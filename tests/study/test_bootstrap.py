"""The bootstrap intervals of ``posenc study`` against known distributions: the analytic normal
interval of a mean, the coverage of the truth over many draws, and the paired difference."""

from __future__ import annotations

import math

import numpy as np
import pytest

from posenc.study import bootstrap


def test_interval_of_a_mean_matches_the_normal_interval():
    """iid windows with equal counts: the ratio is the mean NLL; for n = 2000 the percentile
    interval is the normal one, mean +- 1.96 s / sqrt(n), within a few percent of its width."""
    rng = np.random.default_rng(1)
    nll = rng.gamma(shape=4.0, scale=0.5, size=2000)  # per-window NLL sums, skewed like real ones
    count = np.ones_like(nll)
    low, high = bootstrap.interval(nll, count)
    mean, se = nll.mean(), nll.std(ddof=1) / math.sqrt(len(nll))
    width = 2 * 1.959964 * se
    assert low == pytest.approx(mean - 1.959964 * se, abs=0.06 * width)
    assert high == pytest.approx(mean + 1.959964 * se, abs=0.06 * width)
    # through exp (perplexity): the same quantiles, transformed (exp is monotone)
    plow, phigh = bootstrap.interval(nll, count, bootstrap.exp)
    assert (plow, phigh) == pytest.approx((math.exp(low), math.exp(high)), rel=1e-12)


def test_interval_covers_the_truth_at_the_stated_rate():
    """200 evaluation sets of 60 windows from a known distribution (exponential NLL sums, mean 2,
    window sizes 32 or 64 tokens): the 95% interval of the ratio contains the true per-token NLL
    in close to 95% of them (binomial sd over 200 draws: 1.5%)."""
    rng = np.random.default_rng(7)
    truth = 2.0 / 48  # E[nll] / E[count]: the ratio of means the estimator targets
    hits = 0
    for _ in range(200):
        count = rng.choice([32, 64], size=60)
        nll = rng.exponential(2.0 * count / 48)  # per-token mean 2/48, whatever the window size
        low, high = bootstrap.interval(nll, count, resamples=800, seed=int(rng.integers(1 << 30)))
        hits += low <= truth <= high
    assert 0.89 <= hits / 200 <= 0.99


def test_the_interval_repeats_exactly_and_is_the_ratio_of_sums():
    rng = np.random.default_rng(3)
    nll, count = rng.exponential(3.0, 500), rng.integers(10, 64, 500)
    assert bootstrap.interval(nll, count) == bootstrap.interval(nll, count)
    assert bootstrap.point(nll, count) == pytest.approx(nll.sum() / count.sum())
    low, high = bootstrap.interval(nll, count)
    assert low < bootstrap.point(nll, count) < high
    # several seeds: the mean of their ratios; two identical seeds give one seed's interval
    assert bootstrap.interval([nll, nll], [count, count]) == pytest.approx((low, high))
    with pytest.raises(ValueError):
        bootstrap.interval(nll, count[:10])


def test_paired_difference_cancels_the_shared_text_noise():
    """B = A + a small constant per token on the same windows: the unpaired intervals overlap
    widely, the paired difference is resolved and contains the true shift."""
    rng = np.random.default_rng(5)
    count = np.full(400, 64.0)
    hardness = rng.gamma(2.0, 1.0, 400)  # some windows are harder for every model
    a = count * (1.0 + hardness) + rng.normal(0, 2.0, 400)
    b = a + count * 0.02  # B is worse by 0.02 nats per token everywhere
    diff, low, high = bootstrap.difference(a, count, b, count)
    assert diff == pytest.approx(0.02)
    assert 0 < low <= 0.02 <= high
    alow, ahigh = bootstrap.interval(a, count)
    blow, bhigh = bootstrap.interval(b, count)
    assert blow < ahigh  # unpaired: not separated
    assert bootstrap.difference(a, count, a, count) == (0.0, 0.0, 0.0)
    d, lo, hi = bootstrap.difference(a, count, b, count, transform=bootstrap.exp)
    assert d == pytest.approx(math.exp(b.sum() / count.sum()) - math.exp(a.sum() / count.sum()))
    assert lo < d < hi
