"""Output-length prediction (TetriInfer §3.3.2): a bucket [lo, hi] of `granularity` tokens (200 by
default); scheduling uses the lower end.

* `OraclePredictor` — knows the true length (simulation): the right bucket with probability
  `accuracy`, else an adjacent one; deterministic per request id (the paper's ideal and 74.9% cases).
* `LearnedPredictor` — trained from completed requests: features are the prompt's token count and
  hashed token unigrams and bigrams; a multinomial logistic regression over buckets fitted with numpy (no extra
  dependency). `fit` is pure; the daemon decides when to retrain.
* `LengthPredictor` is the interface a fine-tuned small LM classifier (the paper's OPT-125M) implements
  on a GPU: `predict(prompt_token_ids, request_id, true_output=None) -> (lo, hi)`.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .names import PREDICTORS

Range = tuple[int, int]


def bucket_range(bucket: int, granularity: int) -> Range:
    return bucket * granularity + 1, (bucket + 1) * granularity


def bucket_of(tokens: int, granularity: int) -> int:
    return (max(1, tokens) - 1) // granularity


class LengthPredictor(Protocol):
    name: str
    granularity: int

    def predict(self, prompt_token_ids: Sequence[int], request_id: str, true_output: int | None = None) -> Range: ...


@dataclass
class OraclePredictor:
    accuracy: float = 1.0
    granularity: int = 200
    seed: int = 0
    name: str = "oracle"

    def predict(self, prompt_token_ids: Sequence[int], request_id: str, true_output: int | None = None) -> Range:
        if true_output is None:
            raise ValueError("the oracle predictor needs the true output length")
        b = bucket_of(true_output, self.granularity)
        h = hashlib.blake2b(f"{self.seed}:{request_id}".encode(), digest_size=8).digest()
        u = int.from_bytes(h[:4], "little") / 2**32
        if u >= self.accuracy:
            b = b + 1 if (b == 0 or h[4] & 1) else b - 1
        return bucket_range(b, self.granularity)


def features(prompt_token_ids: Sequence[int], dims: int = 256) -> np.ndarray:
    """log token count plus hashed token unigrams and bigrams (a bag of `dims` buckets, L2-normalised)."""
    v = np.zeros(dims + 2)
    ids = list(prompt_token_ids)
    v[0] = np.log1p(len(ids))
    v[1] = 1.0  # bias
    for a in ids:  # unigrams: "the prompt contains token X"
        v[2 + (a * 7_919) % dims] += 1.0
    for a, b in itertools.pairwise(ids):  # bigrams
        v[2 + (a * 1_000_003 + b) % dims] += 1.0
    norm = np.linalg.norm(v[2:])
    if norm:
        v[2:] /= norm
    return v


@dataclass
class LearnedPredictor:
    granularity: int = 200
    buckets: int = 11  # the last bucket holds everything longer
    dims: int = 256
    name: str = "learned"
    weights: np.ndarray | None = None
    trained_on: int = 0
    accuracy: float | None = None  # on the held-out part of the last fit
    _prior: int = field(default=0, repr=False)
    # the log token count standardised over the last fit's prompts: unscaled (6–8 for prompts of hundreds
    # or thousands of tokens) it made gradient descent diverge on some training sets
    _length: tuple[float, float] = field(default=(0.0, 1.0), repr=False)

    def _features(self, prompt_token_ids: Sequence[int]) -> np.ndarray:
        v = features(prompt_token_ids, self.dims)
        v[0] = (v[0] - self._length[0]) / self._length[1]
        return v

    def fit(
        self,
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[int],
        epochs: int = 200,
        lr: float = 0.5,
        holdout: float = 0.2,
        seed: int = 0,
    ) -> float | None:
        """Fit on (prompt, output length) pairs; returns held-out bucket accuracy (None if too few)."""
        if len(prompts) != len(outputs) or not prompts:
            raise ValueError("need as many output lengths as prompts, at least one")
        x = np.stack([features(p, self.dims) for p in prompts])
        sd = float(x[:, 0].std())
        self._length = (float(x[:, 0].mean()), sd if sd > 1e-9 else 1.0)
        x[:, 0] = (x[:, 0] - self._length[0]) / self._length[1]
        y = np.minimum(np.array([bucket_of(o, self.granularity) for o in outputs]), self.buckets - 1)
        rng = np.random.default_rng(seed)
        idx = rng.permutation(len(y))
        n_test = int(len(y) * holdout) if len(y) >= 10 else 0
        test, train = idx[:n_test], idx[n_test:]
        w = np.zeros((x.shape[1], self.buckets))
        onehot = np.eye(self.buckets)[y[train]]
        for _ in range(epochs):
            logits = x[train] @ w
            logits -= logits.max(axis=1, keepdims=True)
            p = np.exp(logits)
            p /= p.sum(axis=1, keepdims=True)
            w -= lr * (x[train].T @ (p - onehot) / len(train) + 1e-4 * w)
        self.weights = w
        self.trained_on = len(y)
        self._prior = int(np.bincount(y, minlength=self.buckets).argmax())
        self.accuracy = float(((x[test] @ w).argmax(axis=1) == y[test]).mean()) if n_test else None
        return self.accuracy

    def predict(self, prompt_token_ids: Sequence[int], request_id: str, true_output: int | None = None) -> Range:
        if self.weights is None:
            return bucket_range(self._prior, self.granularity)
        b = int((self._features(prompt_token_ids) @ self.weights).argmax())
        return bucket_range(b, self.granularity)


def make_predictor(name: str, accuracy: float = 1.0, granularity: int = 200, seed: int = 0) -> LengthPredictor | None:
    if name == "none":
        return None
    if name == "oracle":
        return OraclePredictor(accuracy, granularity, seed)
    if name == "learned":
        return LearnedPredictor(granularity)
    raise ValueError(f"unknown predictor {name!r} (choose from {', '.join(PREDICTORS)})")
