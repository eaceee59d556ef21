"""The output-length predictor: trains, ranks, saves, refuses other models, steers SJF."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from cbjax import LLM, SamplingParams
from cbjax.loading import load_model
from cbjax.models import length_predictor as lp


def test_kendall_tau_on_known_orders():
    assert lp.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert lp.kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # 6 pairs: 4 concordant, 2 discordant.
    assert lp.kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # tau-b with a tie in the second sequence: (3 - 2) / sqrt(6 * 5)... computed by hand below.
    a, b = [1, 2, 3, 4], [1, 1, 3, 2]
    assert lp.kendall_tau(a, b) == pytest.approx((4 - 1) / np.sqrt(6 * 5))


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama", with_tokenizer=False)


def _synthetic_pairs(model, n, seed):
    """Prompts whose output length follows which tokens they hold (a hidden direction of the
    model's embeddings) and their length: what the predictor must recover."""
    rng = np.random.default_rng(seed)
    embed = lp.embedding_table(model)
    direction = np.random.default_rng(99).normal(size=embed.shape[1])
    prompts = [rng.integers(3, embed.shape[0], size=int(k)).tolist() for k in rng.integers(4, 40, size=n)]
    signal = np.array([embed[p].astype(np.float64).mean(0) @ direction for p in prompts])
    lengths = np.exp(3 + 2.5 * (signal - signal.mean()) / signal.std() + 0.2 * rng.normal(size=n))
    return prompts, np.clip(np.round(lengths), 1, 2000)


def _train(model, prompts, lengths, epochs=150):
    embed = lp.embedding_table(model)
    features = lp.prompt_features(embed, prompts)
    return lp.LengthPredictor.train(features, lengths, meta={"model": lp.model_identity("tiny-llama", embed)},
                                    epochs=epochs, batch_size=64, hidden=32)


def test_predictor_learns_a_length_rule_and_survives_a_save(tiny, tmp_path):
    prompts, lengths = _synthetic_pairs(tiny, 600, seed=0)
    predictor = _train(tiny, prompts[:480], lengths[:480])
    path = str(tmp_path / "predictor")
    predictor.save(path)
    loaded = lp.LengthPredictor.load(os.path.relpath(path), tiny)  # orbax itself takes absolute paths only
    predicted = loaded.predict_many(prompts[480:])
    assert lp.kendall_tau(predicted, lengths[480:]) > 0.6
    assert np.allclose(predicted, predictor.predict_features(lp.prompt_features(loaded.embed, prompts[480:])),
                       rtol=1e-5)
    assert loaded(prompts[500]) == int(round(float(predicted[20])))


def test_sjf_admits_by_predicted_length(tiny, tmp_path):
    """One slot, five requests at once with equal max_tokens: under ordering=sjf with the
    predictor they start in the order of its predictions; without one, in arrival order."""
    prompts, lengths = _synthetic_pairs(tiny, 400, seed=1)
    path = str(tmp_path / "predictor")
    _train(tiny, prompts, lengths, epochs=60).save(path)
    queued = prompts[:5]
    llm = LLM(tiny, num_slots=1, max_seq_len=64, ordering="sjf", length_predictor=path)
    ids = [llm.add_request(p, SamplingParams(max_tokens=3, ignore_eos=True)) for p in queued]
    predicted = {i: llm.requests[i].predicted_len for i in ids}
    outs = llm.run_until_done()
    started = sorted(ids, key=lambda i: next(o.metrics.scheduled_time for o in outs if o.request_id == i))
    assert [predicted[i] for i in started] == sorted(predicted.values())
    assert len(set(predicted.values())) > 1

    plain = LLM(tiny, num_slots=1, max_seq_len=64, ordering="sjf")
    ids = [plain.add_request(p, SamplingParams(max_tokens=3, ignore_eos=True)) for p in queued]
    assert all(plain.requests[i].predicted_len is None for i in ids)
    outs = {o.request_id: o for o in plain.run_until_done()}
    assert sorted(ids, key=lambda i: outs[i].metrics.scheduled_time) == ids


def test_a_predictor_for_another_model_or_a_broken_one_is_refused_by_name(tiny, tmp_path):
    prompts, lengths = _synthetic_pairs(tiny, 200, seed=2)
    good = str(tmp_path / "good")
    _train(tiny, prompts, lengths, epochs=5).save(good)
    other = load_model("tiny-llama", with_tokenizer=False, seed=7)  # same shapes, other weights
    with pytest.raises(ValueError, match="made for model 'tiny-llama'"):
        lp.LengthPredictor.load(good, other)
    with pytest.raises(ValueError, match="made for model"):
        lp.LengthPredictor.load(good, load_model("tiny-qwen2", with_tokenizer=False))

    broken_meta = str(tmp_path / "broken_meta")
    shutil.copytree(good, broken_meta)
    with open(os.path.join(broken_meta, lp.META_FILE), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="broken_meta.*broken metadata"):
        lp.LengthPredictor.load(broken_meta, tiny)

    no_params = str(tmp_path / "no_params")
    shutil.copytree(good, no_params)
    shutil.rmtree(os.path.join(no_params, lp.PARAMS_DIR))
    with pytest.raises(FileNotFoundError, match="no_params"):
        lp.LengthPredictor.load(no_params, tiny)

    wrong_width = str(tmp_path / "wrong_width")
    shutil.copytree(good, wrong_width)
    with open(os.path.join(wrong_width, lp.META_FILE)) as f:
        meta = json.load(f)
    meta["hidden"] = 16  # the stored arrays are 32 wide
    with open(os.path.join(wrong_width, lp.META_FILE), "w") as f:
        json.dump(meta, f)
    with pytest.raises(ValueError, match="wrong_width.*cannot restore"):
        lp.LengthPredictor.load(wrong_width, tiny)

    with pytest.raises(FileNotFoundError, match="length_predictor"):
        LLM(tiny, length_predictor=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="length_predictor"):
        LLM(tiny, length_predictor=3)
    # Nothing else is harmed: the good checkpoint still loads and serves.
    llm = LLM(tiny, num_slots=2, max_seq_len=64, ordering="sjf", length_predictor=good)
    assert llm.generate([prompts[0]], SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids
