"""Named policy sets: what `--policies NAME` on `tetrictl up` and `tetrictl policy set` starts from.

- `vllm-v1`: vLLM as it runs today: colocated instances schedule as vLLM v1 (chunked prefill mixed into
  decode batches); prefill and decode instances take prompts first come first served, no length predictor,
  the least-loaded decode instance, greedy admission, no flips. `tetrictl up`'s default (README: the bench
  finds TetriInfer's policies even with it below capacity, and the wins past it need the workload's SLO).
- `tetriinfer`: the paper's (docs/references.md): ChunkSize 512, shortest prompt first within
  PrefillSchedBatch 16, a length predictor over 200-token buckets (the learned one: it trains on the
  cluster's own finished requests), power-of-two dispatch, reserve-dynamic admission, idle flips.
- `advised`: the policies of an advice (`tetrictl advise --json`); the shell reads the file.
"""

from __future__ import annotations

from .policyset import PolicyError, PolicySet

TETRIINFER = PolicySet(
    prefill_policy="sjf",
    prefill_sched_batch=16,  # refs: PrefillSchedBatch 16
    chunk_size=512,  # refs: ChunkSize 512 for OPT-13B
    predictor="learned",
    predictor_granularity=200,  # refs: 200-token buckets
    dispatch="pot",
    decode_admission="reserve-dynamic",
    flip_policy="idle",
)
VLLM_V1 = PolicySet(colocated_schedule="vllm-v1")
PRESETS = {"vllm-v1": VLLM_V1, "tetriinfer": TETRIINFER}
PRESET_NAMES = (*PRESETS, "advised")
DEFAULT_PRESET = "vllm-v1"


class PresetError(ValueError):
    pass


def advised_policies(doc: object) -> PolicySet:
    """The policies of `tetrictl advise --json`'s document (its `advice.policies`); PresetError naming what
    is missing or wrong."""
    advice = doc.get("advice") if isinstance(doc, dict) else None
    policies = advice.get("policies") if isinstance(advice, dict) else None
    if not isinstance(policies, dict):
        raise PresetError("the advice file has no advice.policies (write it with tetrictl advise --json)")
    try:
        return PolicySet().changed(**policies)
    except (PolicyError, TypeError) as e:
        raise PresetError(f"the advice file's advice.policies: {e}") from None
