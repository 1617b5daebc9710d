"""Workloads whose prompts repeat themselves — conversations, agent loops, a shared document set — as
`Request`s with Mooncake-style hash ids (one id per `BLOCK` tokens; equal leading ids, equal leading
tokens), so the simulator's prefix caches see what they share.

A prompt is a list of segments (a system prompt, a user turn, an answer, a tool result, a document), each
an id and a length; a block's hash id names the pieces of segments it holds, so two prompts get the same
ids exactly as far as they hold the same segments. Figures (docs/references.md):

* **chat-sessions** — multi-turn chat: a system prompt every conversation shares, then turns; each turn's
  prompt is the system prompt and the whole conversation so far (its user turns and answers) plus its new
  user turn. Turns per conversation: geometric with mean 2.0 (LMSYS-Chat-1M, Table 1 of its paper); a
  user turn: log-normal with mean 69.5 tokens, an answer with mean 214.5 (LMSYS-Chat-1M's per-turn means,
  Llama-2 tokenizer). Assumed: σ 1.0 (user turn) and 0.8 (answer) of the log-normals, a system prompt of
  1,024 tokens, think time between turns exponential with mean 10 s.
* **agent** — agent loops whose context grows each step: a tool-use system prompt every run shares, the
  task, then steps, each the model's output (a tool call) and the tool's result appended. All assumed (no
  published figures): system prompt 2,000 tokens, task log-normal mean 200 (σ 0.5), steps geometric with
  mean 6, output mean 120 (σ 0.6), tool result mean 400 (σ 1.0), 2 s between steps.
* **rag-docs** — retrieval over a shared document set: a short system prompt, one of the documents, a
  question. Documents: Arxiv-Summarization-4K's prompt lengths (Vidur: normal, median 2,730, σ 758, in
  [512, 4,096]); a question as an LMSYS user turn (mean 69.5); the answer as the RAG mix's (assumed:
  median 80, p90 250). Assumed: 32 documents, Zipf popularity with s = 1.1, a 150-token system prompt.

A model whose context is short for these takes a system prompt of at most a quarter of it and documents
of at most half. Arrivals: sessions start as a Poisson process at `rate` / (mean requests per session) a second over
n / rate seconds, so about n requests arrive at about `rate` a second; a session's next request comes its
gap after the one before (open loop: the simulator does not wait for the answer; `Request.parent` names
the request a live generator must wait for), and those that would come after the window are left out
(the last sessions are cut short). Deterministic for a seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import count

import numpy as np

from .mixes import Lengths
from .workloads import Request, WorkloadSpecError

BLOCK = 16  # tokens per hash id (an engine block: vLLM's default on GPUs)
SESSION_MIXES = ("chat-sessions", "agent", "rag-docs")

CHAT_TURNS_MEAN = 2.0  # LMSYS-Chat-1M: turns per conversation
CHAT_USER_MEAN = 69.5  # LMSYS-Chat-1M: prompt tokens per turn
CHAT_ANSWER_MEAN = 214.5  # LMSYS-Chat-1M: answer tokens per turn
CHAT_SYSTEM = 1024  # assumed
CHAT_THINK_S = 10.0  # assumed
AGENT_SYSTEM, AGENT_STEPS_MEAN, AGENT_GAP_S = 2000, 6.0, 2.0  # assumed
RAG_DOCUMENTS, RAG_ZIPF, RAG_SYSTEM = 32, 1.1, 150  # assumed
RAG_DOCUMENT = Lengths(2730, sigma=758, lo=512, hi=4096)  # Vidur's Arxiv-Summarization-4K prompts
RAG_ANSWER = Lengths(80, 250)  # the rag mix's (assumed)


class _Ids:
    """Hash ids for prompts made of segments: one id per BLOCK tokens, naming the (segment, offset,
    length) pieces the block holds; ids are given in first-seen order (small ints)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[tuple[int, int, int], ...], int] = {}

    def of(self, segments: list[tuple[int, int]]) -> tuple[int, ...]:
        out: list[int] = []
        pieces: list[tuple[int, int, int]] = []
        filled = 0
        for seg, length in segments:
            offset = 0
            while offset < length:
                take = min(length - offset, BLOCK - filled)
                pieces.append((seg, offset, take))
                offset += take
                filled += take
                if filled == BLOCK:
                    out.append(self._id(pieces))
                    pieces, filled = [], 0
        if pieces:
            out.append(self._id(pieces))
        return tuple(out)

    def _id(self, pieces: list[tuple[int, int, int]]) -> int:
        return self._ids.setdefault(tuple(pieces), len(self._ids) + 1)


def _lognormal_mean(rng: np.random.Generator, mean: float, sigma: float, lo: int = 1) -> int:
    """One log-normal draw with this mean and σ (median = mean / e^(σ²/2)), at least `lo`."""
    return max(lo, int(np.rint(rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma))))


def _geometric(rng: np.random.Generator, mean: float) -> int:
    return int(rng.geometric(1.0 / mean))


Session = list[tuple[list[tuple[int, int]], int, float]]  # (prompt segments, answer length, gap before)


def _chat(rng: np.random.Generator, seg: Callable[[], int], max_len: int) -> Session:
    history: list[tuple[int, int]] = [(1, min(CHAT_SYSTEM, max_len // 4))]
    out: Session = []
    for turn in range(_geometric(rng, CHAT_TURNS_MEAN)):
        user = (seg(), _lognormal_mean(rng, CHAT_USER_MEAN, 1.0))
        answer = _lognormal_mean(rng, CHAT_ANSWER_MEAN, 0.8)
        prompt = [*history, user]
        if sum(n for _, n in prompt) + answer > max_len:
            break
        out.append((prompt, answer, 0.0 if turn == 0 else float(rng.exponential(CHAT_THINK_S))))
        history = [*prompt, (seg(), answer)]
    return out


def _agent(rng: np.random.Generator, seg: Callable[[], int], max_len: int) -> Session:
    context: list[tuple[int, int]] = [(2, min(AGENT_SYSTEM, max_len // 4)), (seg(), _lognormal_mean(rng, 200, 0.5))]
    out: Session = []
    for step in range(_geometric(rng, AGENT_STEPS_MEAN)):
        answer = _lognormal_mean(rng, 120, 0.6)
        if sum(n for _, n in context) + answer > max_len:
            break
        out.append((list(context), answer, 0.0 if step == 0 else float(rng.exponential(AGENT_GAP_S))))
        context += [(seg(), answer), (seg(), _lognormal_mean(rng, 400, 1.0))]  # its call, then the tool's result
    return out


def _rag(
    rng: np.random.Generator, seg: Callable[[], int], docs: np.ndarray, weights: np.ndarray, max_len: int
) -> Session:
    doc = int(rng.choice(len(docs), p=weights))
    prompt = [(3, RAG_SYSTEM), (1000 + doc, int(docs[doc])), (seg(), _lognormal_mean(rng, CHAT_USER_MEAN, 1.0))]
    answer = int(RAG_ANSWER.draw(rng, 1)[0])
    if sum(n for _, n in prompt) + answer > max_len:
        return []
    return [(prompt, answer, 0.0)]


def make_sessions(name: str, n: int, rate: float, seed: int = 0, *, max_model_len: int = 8192) -> list[Request]:
    """About `n` requests of session mix `name`, arriving at about `rate` a second over n / rate seconds
    (sessions start in that window; their requests after it are left out), in arrival order."""
    if name not in SESSION_MIXES:
        raise WorkloadSpecError(f"unknown session mix {name!r} (choose from {', '.join(SESSION_MIXES)})")
    if n < 1:
        raise WorkloadSpecError(f"need at least one request, got n = {n}")
    if not rate > 0 or math.isinf(rate):
        raise WorkloadSpecError(f"arrival rate must be positive and finite, got {rate}")
    rng = np.random.default_rng([seed, 1000 + SESSION_MIXES.index(name)])
    counter = count(10_000)
    seg = counter.__next__
    ids = _Ids()
    docs = np.minimum(RAG_DOCUMENT.draw(rng, RAG_DOCUMENTS), max_model_len // 2)  # a short context: shorter
    ranks = np.arange(1, RAG_DOCUMENTS + 1, dtype=float) ** -RAG_ZIPF
    weights = ranks / ranks.sum()
    per_session = {"chat-sessions": CHAT_TURNS_MEAN, "agent": AGENT_STEPS_MEAN, "rag-docs": 1.0}[name]
    out: list[Request] = []
    horizon = n / rate  # sessions start in [0, horizon); what would arrive after it is left out
    start = 0.0
    s = 0
    while start < horizon:
        if name == "chat-sessions":
            session = _chat(rng, seg, max_model_len)
        elif name == "agent":
            session = _agent(rng, seg, max_model_len)
        else:
            session = _rag(rng, seg, docs, weights, max_model_len)
        if not session:  # nothing of it fits the context: draw another
            continue
        at, parent = start, ""
        for k, (segments, answer, gap) in enumerate(session):
            at += gap
            if at >= horizon:
                break
            prompt = sum(length for _, length in segments)
            rid = f"{name}-{s}-{k}"
            out.append(
                Request(
                    rid,
                    at,
                    prompt,
                    answer,
                    max_model_len - prompt,
                    hash_ids=ids.of(segments),
                    hash_block=BLOCK,
                    session=f"{name}-{s}",
                    parent=parent,
                )
            )
            parent = rid
        s += 1
        start += float(rng.exponential(per_session / rate))
    return sorted(out, key=lambda r: (r.arrival, r.request_id))
