"""Output-length prediction (TetriInfer §3.3.2): 200-token buckets, the oracle with a set accuracy, and
the learned predictor."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetri.scheduling.predictor import (
    LearnedPredictor,
    OraclePredictor,
    bucket_of,
    bucket_range,
    features,
    make_predictor,
)

# --- buckets ------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(tokens=st.integers(1, 100_000), granularity=st.integers(1, 1000))
def test_bucket_range_contains_the_length(tokens: int, granularity: int) -> None:
    lo, hi = bucket_range(bucket_of(tokens, granularity), granularity)
    assert lo <= tokens <= hi
    assert hi - lo + 1 == granularity


def test_bucket_boundaries() -> None:
    assert [bucket_of(n, 200) for n in (1, 200, 201, 400, 401)] == [0, 0, 1, 1, 2]
    assert bucket_range(0, 200) == (1, 200)
    assert bucket_range(2, 200) == (401, 600)


# --- oracle -------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(true=st.integers(1, 50_000), rid=st.text(max_size=12), seed=st.integers(0, 2**16))
def test_perfect_oracle_returns_the_true_bucket(true: int, rid: str, seed: int) -> None:
    lo, hi = OraclePredictor(accuracy=1.0, seed=seed).predict([1, 2, 3], rid, true)
    assert lo <= true <= hi
    assert hi - lo + 1 == 200
    assert (lo - 1) % 200 == 0


def test_oracle_at_paper_accuracy_hits_about_that_often_and_misses_by_one_bucket() -> None:
    p = OraclePredictor(accuracy=0.749, seed=3)
    rng = random.Random(11)
    n, hits = 20_000, 0
    misses_up = misses_down = 0
    for i in range(n):
        true = rng.randint(1, 2000)
        lo, hi = p.predict([], f"req-{i}", true)
        assert hi - lo + 1 == 200
        got, want = (lo - 1) // 200, bucket_of(true, 200)
        if got == want:
            hits += 1
        else:
            assert abs(got - want) == 1, f"req-{i}: bucket {got} for a true length in bucket {want}"
            assert got >= 0
            misses_up += got > want
            misses_down += got < want
    assert abs(hits / n - 0.749) <= 0.02
    assert misses_up > 0 and misses_down > 0  # both neighbours occur


def test_oracle_miss_in_the_first_bucket_goes_up() -> None:
    p = OraclePredictor(accuracy=0.0)
    for i in range(200):
        assert p.predict([], f"r{i}", 50) == (201, 400)


def test_oracle_with_zero_accuracy_never_hits() -> None:
    p = OraclePredictor(accuracy=0.0, seed=1)
    for i in range(500):
        lo, hi = p.predict([], f"r{i}", 1000)
        assert (lo, hi) in ((601, 800), (1001, 1200))  # 1000 is in (801, 1000)


def test_oracle_is_deterministic_per_request_id_and_seed() -> None:
    a, b = OraclePredictor(0.5, seed=7), OraclePredictor(0.5, seed=7)
    ids = [f"r{i}" for i in range(300)]
    first = [a.predict([9], rid, 777) for rid in ids]
    assert first == [a.predict([1, 2], rid, 777) for rid in ids]  # the prompt does not matter
    assert first == [b.predict([9], rid, 777) for rid in ids]
    other = [OraclePredictor(0.5, seed=8).predict([9], rid, 777) for rid in ids]
    assert other != first  # another seed draws other misses


def test_oracle_needs_the_true_length() -> None:
    with pytest.raises(ValueError, match="true output length"):
        OraclePredictor().predict([1, 2, 3], "r0")


def test_oracle_granularity() -> None:
    assert OraclePredictor(1.0, granularity=100).predict([], "x", 250) == (201, 300)


# --- learned ------------------------------------------------------------------------------------


def synthetic(rng: random.Random, n: int) -> tuple[list[list[int]], list[int]]:
    """Prompts that contain the phrase 7 7 7 7 (say, "write an essay") get long answers (801-1000
    tokens, bucket 4); the others short ones (1-150, bucket 0). Filler tokens never include 7."""
    vocab = [t for t in range(1, 100) if t != 7]
    prompts, outputs = [], []
    for _ in range(n):
        toks = [rng.choice(vocab) for _ in range(rng.randint(8, 40))]
        if rng.random() < 0.5:
            i = rng.randrange(len(toks) + 1)
            toks[i:i] = [7, 7, 7, 7]
            outputs.append(rng.randint(801, 1000))
        else:
            outputs.append(rng.randint(1, 150))
        prompts.append(toks)
    return prompts, outputs


def test_unfitted_learned_predictor_returns_the_prior_bucket() -> None:
    p = LearnedPredictor()
    assert p.weights is None
    assert p.predict([1, 2, 3], "r0") == (1, 200)
    assert p.predict([], "r1") == (1, 200)


def test_learned_predictor_separates_long_and_short_prompts() -> None:
    rng = random.Random(5)
    prompts, outputs = synthetic(rng, 600)
    p = LearnedPredictor()
    acc = p.fit(prompts, outputs)
    assert p.trained_on == 600
    assert acc is not None and acc > 0.8  # chance is 0.5
    assert p.accuracy == acc
    test_prompts, test_outputs = synthetic(rng, 300)
    preds = [p.predict(x, f"t{i}") for i, x in enumerate(test_prompts)]
    hit = np.mean([lo <= o <= hi for (lo, hi), o in zip(preds, test_outputs, strict=True)])
    assert hit > 0.8
    long_lo = [lo for (lo, _), o in zip(preds, test_outputs, strict=True) if o > 800]
    short_lo = [lo for (lo, _), o in zip(preds, test_outputs, strict=True) if o <= 150]
    assert np.mean(long_lo) > np.mean(short_lo) + 400


def test_learned_predictor_is_deterministic() -> None:
    prompts, outputs = synthetic(random.Random(2), 100)
    a, b = LearnedPredictor(), LearnedPredictor()
    assert a.fit(prompts, outputs, epochs=50) == b.fit(prompts, outputs, epochs=50)
    np.testing.assert_array_equal(a.weights, b.weights)


def test_long_outputs_go_to_the_last_bucket() -> None:
    p = LearnedPredictor(buckets=3)
    prompts = [[1, 2, 3]] * 20
    p.fit(prompts, [5000] * 20, epochs=100)
    assert p.predict([1, 2, 3], "x") == bucket_range(2, 200)


def test_fit_on_few_examples_has_no_holdout() -> None:
    p = LearnedPredictor()
    assert p.fit([[1, 2], [3, 4]], [10, 900], epochs=10) is None
    assert p.trained_on == 2
    assert p.weights is not None


@pytest.mark.parametrize(("prompts", "outputs"), [([], []), ([[1, 2]], []), ([[1], [2]], [10])])
def test_fit_validates_inputs(prompts: list[list[int]], outputs: list[int]) -> None:
    p = LearnedPredictor()
    with pytest.raises(ValueError, match="output lengths"):
        p.fit(prompts, outputs)
    assert p.weights is None


def test_features_shape_and_normalisation() -> None:
    v = features([5, 6, 7, 8], dims=64)
    assert v.shape == (66,)
    assert v[0] == pytest.approx(np.log1p(4))
    assert v[1] == 1.0
    assert np.linalg.norm(v[2:]) == pytest.approx(1.0)
    assert not features([], dims=64)[2:].any()


def test_make_predictor() -> None:
    assert make_predictor("none") is None
    assert isinstance(make_predictor("oracle", accuracy=0.7), OraclePredictor)
    assert isinstance(make_predictor("learned"), LearnedPredictor)
    with pytest.raises(ValueError, match="none, oracle, learned"):
        make_predictor("psychic")


def test_learned_predictor_does_not_diverge_on_long_prompts() -> None:
    """Prompts of thousands of tokens whose content says nothing of the answer (the SLO matrix's code mix,
    random token ids): the fit learns at least the most common bucket. With the log token count unscaled,
    gradient descent diverged here (1.3% held-out, against 41% for the most common bucket)."""
    from tetri.des.mixes import make_mix

    reqs = make_mix("code", 2000, 1.0, seed=1)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 32_000, r.prompt_len).tolist() for r in reqs]
    outputs = [r.output_len for r in reqs]
    p = LearnedPredictor(200)
    acc = p.fit(prompts, outputs, seed=1)
    buckets = np.bincount(np.minimum([bucket_of(o, 200) for o in outputs], p.buckets - 1))
    assert acc is not None and acc >= buckets.max() / len(outputs) - 0.05
