"""The daemon's length predictor: predicts each request's output bucket before routing it, learns
from completed requests in the status table, and tracks its live accuracy.

The model objects are pure (`tetri.scheduling.predictor`); this shell owns retraining (periodically
in a thread, from `Store.training_samples`) and accounting. The prediction travels with the request
(GenerateRequest.predicted_lo/hi) to the prefill instance's dispatcher and the decode instance's
admission policy. (The paper runs the predictor on each prefill instance; running it once here keeps
one model for the cluster and needs no weight shipping — a worker still predicts for requests that
arrive without a prediction.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.predictor import LearnedPredictor, OraclePredictor, Range

from .db.store import Store

log = logging.getLogger(__name__)
PROMPT_SAMPLE = 256  # prompt tokens kept per request for training
TRAINING_SAMPLES = 5000  # newest finished requests a retrain fits


@dataclass
class PredictorStats:
    live_hits: int = 0
    live_total: int = 0
    holdout_accuracy: float | None = None
    trained_on: int = 0
    trained_ts: float | None = None

    @property
    def live_accuracy(self) -> float | None:
        return self.live_hits / self.live_total if self.live_total else None


class PredictorService:
    def __init__(self, store: Store, now: Callable[[], float] = time.time, from_store: bool = True) -> None:
        self.store = store
        # prompt samples in the status table (opted in: they survive restarts) or only in memory here
        self.from_store = from_store
        self.recent: deque[tuple[list[int], int]] = deque(maxlen=TRAINING_SAMPLES)
        self.now = now  # the cluster clock (trained_ts)
        self.learned: LearnedPredictor | None = None
        self.stats = PredictorStats()
        self._lock = asyncio.Lock()

    def predict(self, policies: PolicySet, prompt_ids: Sequence[int], rid: str, max_tokens: int) -> Range | None:
        if policies.predictor == "oracle":  # simulation: the sim engine's true output length is max_tokens
            return OraclePredictor(policies.predictor_accuracy, policies.predictor_granularity).predict(
                prompt_ids, rid, true_output=max_tokens
            )
        if policies.predictor == "learned" and self.learned is not None:
            return self.learned.predict(prompt_ids, rid)
        return None

    def observe(self, predicted: Range | None, output_tokens: int, prompt_head: list[int] | None = None) -> None:
        """A finished request: its output length scores the prediction and (with its prompt's first
        tokens, when samples are not stored in the table) becomes a training sample."""
        if prompt_head is not None and not self.from_store and output_tokens > 0:
            self.recent.append((prompt_head, output_tokens))
        if predicted is None or output_tokens <= 0:
            return
        self.stats.live_total += 1
        self.stats.live_hits += predicted[0] <= output_tokens <= predicted[1]

    async def retrain(self, granularity: int = 200) -> dict[str, Any]:
        """Fit a new model on the newest finished requests (off the event loop) and swap it in."""
        async with self._lock:
            if self.from_store:
                samples = await asyncio.to_thread(self.store.training_samples, TRAINING_SAMPLES)
            else:
                samples = list(self.recent)
            if len(samples) < 10:
                return self.describe() | {"retrained": False, "reason": f"only {len(samples)} finished requests"}
            model = LearnedPredictor(granularity)
            acc = await asyncio.to_thread(model.fit, [p for p, _ in samples], [o for _, o in samples])
            self.learned = model
            self.stats.holdout_accuracy, self.stats.trained_on = acc, len(samples)
            self.stats.trained_ts = self.now()
            self.stats.live_hits = self.stats.live_total = 0  # live accuracy of the new model
            return self.describe() | {"retrained": True}

    async def loop(self, policies: Any, every_s: float) -> None:
        """Retrain periodically while the `learned` predictor is selected."""
        while True:
            await asyncio.sleep(every_s)
            current: PolicySet = policies()
            if current.predictor == "learned":
                try:
                    await self.retrain(current.predictor_granularity)
                except Exception:  # a failed fit keeps the previous model; the loop goes on
                    log.exception("retraining the length predictor failed")

    def describe(self) -> dict[str, Any]:
        s = self.stats
        return {
            "trained": self.learned is not None,
            "trained_on": s.trained_on,
            "trained_ts": s.trained_ts,
            "holdout_accuracy": s.holdout_accuracy,
            "live_accuracy": s.live_accuracy,
            "live_samples": s.live_total,
        }
