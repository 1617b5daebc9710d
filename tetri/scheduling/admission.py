"""Intra-decode admission (TetriInfer §3.4): which waiting requests join the running batch.

KV is counted in tokens: a running request holds its context (prompt + tokens so far) and grows by one
per step until it finishes. Policies (each returns the waiting requests to admit now, in order):

* ``greedy`` — vLLM's: admit while the next step fits in memory now. Ignores the future, so the batch
  can outgrow memory later and the engine must preempt (swap/recompute) — thrashing.
* ``reserve-static`` — admit only if the batch's predicted memory at completion fits: the sum over
  running and admitted requests of context + predicted remaining tokens ≤ capacity.
* ``reserve-dynamic`` — also admit when memory suffices until the shortest predicted remaining job
  finishes and frees its memory: usage grows for r_min steps, the candidate's included.
* ``plan`` — admit in the order of a Sorted-F plan, while the future fits (the planner's own admission
  test, `tetri.planner.profile.KVProfile`, with M = capacity). `plan_order` lists the planned ids not
  yet admitted; one that has not arrived is skipped and takes its place in the order when it comes (a
  prefill instance holds a prompt's KV until the decode instance pulls it, so waiting for a planned
  request that is queued behind that KV would stall the decode instance, or deadlock an idle one).

What a policy counts for a request is `predicted_total`: with a predicted range [lo, hi] (a length
bucket, 200 tokens wide by default) it is one named point of the bucket — ``lower`` (lo), ``mid``
((lo + hi) // 2) or ``upper`` (hi), the `PolicySet.reserve_point` — capped at max_tokens; without a
prediction it is max_tokens (unknown: reserve up to the maximum, safe but conservative). A request's
remaining tokens are that total minus what it has produced, at least 1 (`remaining`). With 200-token
buckets the lower end of every answer under 200 tokens is 1, so ``lower`` reserves (almost) nothing
for most chat answers; the bench's ablation (docs/bench.md) measures all three points.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tetri.planner.profile import KVProfile

from .names import ADMISSION_POLICIES, RESERVE_POINTS


def predicted_total(predicted: tuple[int, int] | None, max_tokens: int, point: str = "lower") -> int:
    """The output length a policy counts for a request: a point of its predicted bucket, or max_tokens."""
    if predicted is None:
        return max_tokens
    lo, hi = predicted
    if point == "lower":
        total = lo
    elif point == "mid":
        total = (lo + hi) // 2
    elif point == "upper":
        total = hi
    else:
        raise ValueError(f"unknown reserve point {point!r} (choose from {', '.join(RESERVE_POINTS)})")
    return max(1, min(total, max_tokens))


def predicted_growth(predicted: tuple[int, int] | None, max_tokens: int, produced: int, point: str = "lower") -> int:
    """Tokens a request is still predicted to add to its KV, for dispatch's load (0 without a prediction:
    nothing is known, unlike admission, which then reserves up to max_tokens)."""
    return 0 if predicted is None else max(0, predicted_total(predicted, max_tokens, point) - produced)


def remaining(predicted: tuple[int, int] | None, max_tokens: int, produced: int, point: str = "lower") -> int:
    """Predicted tokens still to produce (≥ 1): each one is one more KV slot."""
    return max(1, predicted_total(predicted, max_tokens, point) - produced)


def srpt_work(prompt_len: int, token_budget: int | None, remaining_tokens: int | None) -> float:
    """`queue_order` srpt's key: the iterations a request not started yet would take, as far as they are
    known — its prompt's share of iterations (`token_budget` tokens an iteration; None: a decode
    instance, whose requests bring their prompt's KV) and its predicted tokens still to produce (None:
    no prediction, which counts nothing: max_tokens is a client's limit, not a length)."""
    prompt = prompt_len / token_budget if token_budget else 0.0
    return prompt + (remaining_tokens or 0)


@dataclass(frozen=True)
class Running:
    request_id: str
    context: int  # tokens held now
    remaining: int  # predicted tokens still to produce (≥ 1)


@dataclass(frozen=True)
class Waiting:
    request_id: str
    context: int  # prompt (+ first token) the request brings
    remaining: int  # predicted tokens to produce (lower end of the predicted range, or max_tokens)


def _peak(items: Sequence[Running | Waiting]) -> int:
    return sum(x.context + x.remaining for x in items)


def admit(
    policy: str,
    running: Sequence[Running],
    waiting: Sequence[Waiting],
    capacity: int,
    max_running: int = 1 << 30,
    plan_order: Sequence[str] | None = None,
) -> list[str]:
    if policy not in ADMISSION_POLICIES:
        raise ValueError(f"unknown decode admission {policy!r} (choose from {', '.join(ADMISSION_POLICIES)})")
    if policy == "plan":
        return _plan(running, waiting, capacity, plan_order or [], max_running)
    batch: list[Running | Waiting] = list(running)
    used = sum(r.context for r in running) + len(running)  # the next step's memory
    out: list[str] = []
    for w in waiting:
        if len(batch) >= max_running:
            break
        fits_now = used + w.context + 1 <= capacity
        if policy == "greedy":
            ok = fits_now
        else:
            ok = fits_now and _peak([*batch, w]) <= capacity
            if not ok and policy == "reserve-dynamic" and fits_now:
                r_min = min((x.remaining for x in batch), default=0)
                grown = sum(x.context + min(x.remaining, r_min) for x in batch) + w.context + min(w.remaining, r_min)
                ok = r_min > 0 and grown <= capacity
        if not ok and not batch and fits_now:
            ok = True  # alone on the instance: a prediction above capacity must not block the queue forever
        if not ok:
            break  # FCFS within the decode queue: no overtaking
        batch.append(w)
        used += w.context + 1
        out.append(w.request_id)
    return out


def _plan(
    running: Sequence[Running], waiting: Sequence[Waiting], capacity: int, order: Sequence[str], max_running: int
) -> list[str]:
    prof = KVProfile(capacity)
    for i, r in enumerate(running):  # a running request as if started now with its context as prompt
        prof.add(i, r.context, r.remaining, 0)  # holds context + k in its k-th step from now, like a new one
    by_id = {w.request_id: w for w in waiting}
    out: list[str] = []
    for rid in order:
        w = by_id.get(rid)
        if w is None:
            continue  # not here yet: it takes its place in the order when it comes (waiting could stall)
        if len(running) + len(out) >= max_running or not prof.fits(w.context, w.remaining, 0):
            break
        prof.add(len(running) + len(out), w.context, w.remaining, 0)
        out.append(rid)
    return out
