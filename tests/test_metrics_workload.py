"""Metrics on hand-built timelines; workload generators' distributions."""

from __future__ import annotations

import numpy as np
import pytest

from cbjax.metrics import SLO, RequestTimes, summarize
from cbjax.workload import LengthDist, arrival_times, synthetic


def timeline(arrival, token_times, prompt=10):
    return RequestTimes(arrival, token_times[0], token_times[-1], token_times, prompt, len(token_times))


def test_per_request_metrics():
    r = timeline(1.0, [1.5, 1.7, 2.0, 2.1])
    assert r.ttft == pytest.approx(0.5)
    assert r.e2el == pytest.approx(1.1)
    assert r.tpot == pytest.approx(0.6 / 3)
    assert r.itls == pytest.approx([0.2, 0.3, 0.1])
    assert timeline(0.0, [0.4]).tpot is None


def test_run_metrics_throughput_percentiles_and_goodput():
    # Four requests: TTFTs 100, 200, 300, 400 ms; each has 3 tokens 50 ms apart.
    reqs = [timeline(float(i), [i + 0.1 * (i + 1) + 0.05 * k for k in range(3)]) for i in range(4)]
    m = summarize(reqs, slo=SLO(ttft_ms=250, tpot_ms=60))
    assert m["completed"] == 4 and m["total_output_tokens"] == 12 and m["total_input_tokens"] == 40
    duration = reqs[-1].finish - 0.0
    assert m["duration"] == pytest.approx(duration)
    assert m["request_throughput"] == pytest.approx(4 / duration)
    assert m["output_throughput"] == pytest.approx(12 / duration)
    assert m["total_token_throughput"] == pytest.approx(52 / duration)
    assert m["mean_ttft_ms"] == pytest.approx(250)
    assert m["median_ttft_ms"] == pytest.approx(250)
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile([100, 200, 300, 400], 99))
    assert m["p90_ttft_ms"] == pytest.approx(370)
    assert m["mean_tpot_ms"] == pytest.approx(50)
    assert m["mean_itl_ms"] == pytest.approx(50) and m["p99_itl_ms"] == pytest.approx(50)
    assert m["good_requests"] == 2 and m["request_goodput"] == pytest.approx(2 / duration)
    assert summarize(reqs, slo=SLO(e2el_ms=10_000))["good_requests"] == 4
    assert summarize(reqs, slo=SLO(tpot_ms=40))["good_requests"] == 0


def test_summarize_rejects_empty():
    with pytest.raises(ValueError, match="no finished"):
        summarize([])


def test_capped_exponential_mean_and_cap():
    rng = np.random.default_rng(0)
    dist = LengthDist("capped_exponential", mean=128, cap=512)
    x = dist.sample(rng, 200_000)
    assert x.max() == 512 and x.min() >= 1
    # E[min(ceil(X), c)] for X ~ Exp(mean m) is about m (1 - e^{-c/m}) + 0.5.
    expected = 128 * (1 - np.exp(-512 / 128)) + 0.5
    assert x.mean() == pytest.approx(expected, rel=0.01)
    assert (x == 512).mean() == pytest.approx(np.exp(-511 / 128), rel=0.1)
    small_cap = LengthDist("capped_exponential", mean=128, cap=32).sample(rng, 10_000)
    assert small_cap.max() == 32 and (small_cap == 32).mean() > 0.7


def test_fixed_and_uniform_lengths():
    rng = np.random.default_rng(1)
    assert set(LengthDist("fixed", value=7).sample(rng, 100)) == {7}
    u = LengthDist("uniform", low=3, high=9).sample(rng, 50_000)
    assert u.min() == 3 and u.max() == 9 and u.mean() == pytest.approx(6, rel=0.01)
    with pytest.raises(ValueError):
        LengthDist("uniform", low=5, high=2)
    with pytest.raises(ValueError):
        LengthDist("zipf")


@pytest.mark.parametrize("kind,burstiness", [("poisson", 1.0), ("gamma", 0.5), ("gamma", 4.0)])
def test_arrival_rate_within_tolerance(kind, burstiness):
    rng = np.random.default_rng(2)
    t = arrival_times(kind, 20_000, rng, qps=8.0, burstiness=burstiness)
    gaps = np.diff(t)
    assert t[0] == 0 and np.all(gaps >= 0)
    assert 1 / gaps.mean() == pytest.approx(8.0, rel=0.03)
    # Coefficient of variation of gamma gaps is 1/sqrt(burstiness); Poisson's is 1.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)


def test_all_at_once_and_bad_rates():
    rng = np.random.default_rng(3)
    assert np.all(arrival_times("all_at_once", 5, rng) == 0)
    with pytest.raises(ValueError):
        arrival_times("poisson", 5, rng, qps=0)
    with pytest.raises(ValueError):
        arrival_times("uniform", 5, rng)


def test_synthetic_workload_is_seeded_and_shaped():
    kw = dict(prompt_len=LengthDist("uniform", low=4, high=12), output_len=LengthDist("fixed", value=5),
              vocab_size=100, arrival="poisson", qps=2.0)
    a, b = synthetic(30, seed=5, **kw), synthetic(30, seed=5, **kw)
    assert [r.as_tuple() for r in a] == [r.as_tuple() for r in b]
    assert all(4 <= len(r.prompt) <= 12 and all(3 <= t < 100 for t in r.prompt) for r in a)
    assert all(r.sampling.max_tokens == 5 and r.sampling.ignore_eos for r in a)
    assert [r.arrival for r in a] == sorted(r.arrival for r in a)
