"""Perplexity against transformers on a tiny random-init model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cbjax.loading import load_hf_dir
from cbjax.perplexity import negative_log_likelihood, perplexity, windows
from tests.hf_models import make_hf_model, save_hf_model


def test_windows_drop_tails_that_predict_nothing():
    assert windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError):
        windows([1, 2], 1)


def test_perplexity_matches_transformers(tmp_path):
    hf = make_hf_model("qwen2", seed=3)
    model = load_hf_dir(save_hf_model(hf, str(tmp_path)), with_tokenizer=False)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=150).tolist()
    total, count = negative_log_likelihood(model, ids, window=64)
    ref_total = 0.0
    for w in windows(ids, 64):
        t = torch.tensor([w])
        with torch.no_grad():
            logits = hf(t).logits[0, :-1]
        ref_total += float(torch.nn.functional.cross_entropy(logits, t[0, 1:], reduction="sum"))
    assert count == 147
    assert total == pytest.approx(ref_total, rel=1e-5)
    assert perplexity(model, ids, 64) == pytest.approx(np.exp(ref_total / count), rel=1e-5)
