"""A seeded request continued on another engine samples what the undisturbed run would have (issue 31).

vLLM's V1 model runner (the CPU build's) gives a request with a ``seed`` its own ``torch.Generator``,
seeded when the request reaches the model runner, and its sampler draws from it once per step in which
the request samples a token: on the CPU (`TopKTopPSampler.forward_cpu`) one
``torch.randint(0, 2**31, (1,))`` that seeds the step's Gumbel noise; elsewhere (``forward_native``, and
``forward_cuda`` / ``forward_hip``, which fall back to it for seeded requests) one ``exponential_`` over a
vocabulary-wide row. So output token i of a request is sampled with draw i + 1 of a fresh generator.

An engine that continues a request whose first ``n`` output tokens were sampled elsewhere gets them as
prompt tokens: a migrated request (``resumed_tokens``; the prompt is the original one plus the tokens
already streamed), and a decode engine (the prefill engine sampled the first token). Its generator would
start again at draw 1. The engine puts ``n`` in the request's ``SamplingParams.extra_args``
(`DRAWS`), and `install` (run by the Tetri vLLM plugin in the engine's processes) makes the model runner
advance a new request's generator by exactly those ``n`` draws, made as the sampler makes them, before
its first step: token i then gets draw i + 1 wherever it is sampled, as in one undisturbed run on one
engine, and as plain vLLM gives it. Without a seed there is no generator to advance: the continuation
is a valid sample, not the one the undisturbed run would have given.

The hook wraps `GPUModelRunner._update_states` (the CPU runner's, by inheritance), where vLLM seeds
the generator; `tests/vllm/test_seeded_migration.py` pins the draws against vLLM's own sampler and the
version (`CHECKED_VLLM`). It also wraps ``_sample`` and ``_bookkeeping_sync`` so that a seeded request
whose prompt is prefilled in several chunks does not kill a CPU engine (`_hold`): the draws stay one per
token kept, as on a GPU, where vLLM rewinds a discarded chunk's draw.

vLLM's V2 model runner (the CUDA default where Triton is present) keys its Gumbel noise on the seed and
the token's position instead, which a continuation keeps: there nothing needs carrying and this hook does
not apply. Exact only if the continuation's logits equal the undisturbed run's (float32 here: a prompt
computed whole and one computed a token at a time may differ in the last bits) and without
presence/frequency penalties (vLLM counts those over output tokens; a continuation has the earlier
outputs in its prompt).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

CHECKED_VLLM = "0.32."  # the vLLM whose internals `install` wraps (tests/vllm/test_seeded_migration.py)
DRAWS = "tetri_seed_draws"  # SamplingParams.extra_args: output tokens sampled before this engine's first
_DONE = "_tetri_seed_advanced"  # on vLLM's CachedRequestState: advanced already (a streaming update reuses it)


def draws(sampling_params: Any) -> int:
    extra = getattr(sampling_params, "extra_args", None) or {}
    return max(0, int(extra.get(DRAWS, 0) or 0))


def advance(generator: Any, n: int, sampler: Any, vocab_size: int) -> None:
    """Advance a request's generator by the draws `n` steps of vLLM's sampler (`TopKTopPSampler`) make."""
    import torch

    if n <= 0:
        return
    fp64 = bool(getattr(sampler, "use_fp64_gumbel", False))
    if sampler.forward == getattr(sampler, "forward_cpu", None) and not fp64:
        for _ in range(n):  # forward_cpu: one noise seed per step and seeded request
            torch.randint(0, 2**31, (1,), generator=generator, dtype=torch.long)
        return
    # random_sample: q[i].exponential_(generator=...) over the request's row, float32 (or float64)
    row = torch.empty(vocab_size, dtype=torch.float64 if fp64 else torch.float32, device=generator.device)
    for _ in range(n):
        row.exponential_(generator=generator)


def _hold(runner: Any) -> None:
    """Take the CPU generators of the requests whose sample this step discards (a prompt chunk before its
    last) out of the batch's generators while the sampler runs: vLLM rewinds such a draw with
    ``set_offset``, which a CPU generator does not have (vLLM 0.32: "CPU Generator does not use offset",
    and the engine dies). Their rows get unseeded noise for the discarded sample instead, and the
    request's generator is drawn from only for the tokens it keeps, as on a GPU."""
    _release(runner)  # anything a step left held (`_bookkeeping_sync` follows `_sample` in every step)
    batch = runner.input_batch
    gens = batch.generators
    if not gens:
        return
    n = batch.num_reqs
    discard = runner.discard_request_mask.np[:n]
    held = {}
    for i in [i for i, g in gens.items() if i < n and discard[i] and g.device.type == "cpu"]:
        held[batch.req_ids[i]] = gens.pop(i)
    runner._tetri_held = held


def _release(runner: Any) -> None:
    held = getattr(runner, "_tetri_held", None)
    if not held:
        return
    runner._tetri_held = {}
    batch = runner.input_batch
    for rid, gen in held.items():
        i = batch.req_id_to_index.get(rid)
        if i is not None:
            batch.generators[i] = gen


def install() -> None:
    """Patch vLLM's V1 model runner: a new request with `DRAWS` in its extra_args and a generator (a seeded
    random request) has the generator advanced that far before the runner first samples it; and a seeded
    request's discarded samples (`_hold`) leave its CPU generator alone."""
    import vllm

    if not str(vllm.__version__).startswith(CHECKED_VLLM):  # private internals: only the version checked
        logging.getLogger(__name__).warning(
            "vLLM %s is not %sx: seeded requests continued on another engine (migrated, or decoded after a "
            "prefill engine) sample from a fresh generator, not exactly as one run would",
            vllm.__version__,
            CHECKED_VLLM,
        )
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    cls: Any = GPUModelRunner
    if getattr(cls._update_states, "_tetri_seeded", False):  # vLLM may load plugins more than once
        return
    original, sample, bookkeeping = cls._update_states, cls._sample, cls._bookkeeping_sync

    @functools.wraps(sample)
    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        _hold(self)
        return sample(self, *args, **kwargs)

    @functools.wraps(bookkeeping)
    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return bookkeeping(self, *args, **kwargs)  # rewinds the discarded draws of the generators left
        finally:
            _release(self)

    @functools.wraps(original)
    def _update_states(self: Any, scheduler_output: Any) -> Any:
        out = original(self, scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is None or state.generator is None or getattr(state, _DONE, False):
                continue
            setattr(state, _DONE, True)
            n = draws(state.sampling_params)
            if n:
                advance(state.generator, n, self.sampler.topk_topp_sampler, int(self.input_batch.vocab_size))
        return out

    _update_states._tetri_seeded = True  # type: ignore[attr-defined]
    cls._update_states, cls._sample, cls._bookkeeping_sync = _update_states, _sample, _bookkeeping_sync
