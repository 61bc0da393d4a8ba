"""The DP sampler is Poisson sampling: each record joins each batch independently with probability q."""

import itertools

import numpy as np
import torch
from scipy import stats

from dpllm.sampling import PoissonBatchSampler


def test_inclusion_is_bernoulli_q_per_record_and_independent():
    n, q, draws = 50, 0.2, 4000
    sampler = PoissonBatchSampler(num_samples=n, sample_rate=q, generator=torch.Generator().manual_seed(1))
    masks = np.zeros((draws, n), dtype=bool)
    for t, batch in enumerate(itertools.islice(iter(sampler), draws)):
        masks[t, batch] = True
    # every record's inclusion count is Binomial(draws, q): a chi-square test over records
    counts = masks.sum(axis=0)
    expected = draws * q
    chi2 = (((counts - expected) ** 2) / (expected * (1 - q))).sum()
    assert stats.chi2.sf(chi2, df=n) > 1e-4
    # batch sizes are Binomial(n, q): mean n·q, variance n·q·(1−q) (fixed-size batches would have 0)
    sizes = masks.sum(axis=1)
    assert abs(sizes.mean() - n * q) < 4 * np.sqrt(n * q * (1 - q) / draws)
    assert 0.85 < sizes.var() / (n * q * (1 - q)) < 1.15
    # no dependence between records or between consecutive batches
    corr = np.corrcoef(masks.T.astype(float))
    assert np.abs(corr[np.triu_indices(n, 1)]).max() < 0.1
    lagged = np.corrcoef(masks[:-1].ravel(), masks[1:].ravel())[0, 1]
    assert abs(lagged) < 0.03


def test_len_gives_opacus_the_sampling_rate():
    sampler = PoissonBatchSampler(num_samples=1000, sample_rate=1 / 16, generator=torch.Generator())
    assert len(sampler) == 16
