"""How a colocated instance (prefill and decode on one engine) schedules its iterations: the baselines
TetriInfer is compared with, by name (`PolicySet.colocated_schedule`; `tetrictl up --mode colocated
--baseline NAME`; docs/scheduling.md).

* ``prefill-first``: vLLM's schedule as the first benches modelled it — when the admission policy lets
  waiting prompts in, one prefill iteration over them, whole and unpadded, up to the prefill budget;
  otherwise one decode step of every running request.
* ``vllm-v0``: vLLM of early 2024, the paper's baseline: prefill-first, and a prompt batch is padded to
  its longest prompt (the budget counts the padded tokens, and the padding is computed); preemption by
  recomputation (vLLM v0's default for one sequence per request; swapping is not modelled); `max_num_seqs`.
* ``vllm-v1``: today's vLLM (v1 engine, chunked prefill on): every iteration schedules each running
  request's next token first, then the prompts part-way through their prefill, then new prompts, each
  prompt taking as many tokens as the token budget (`max_num_batched_tokens`) has left, so prefill
  chunks run in the same batch as decodes (a *mixed* iteration, `CostModel.mixed_batch_time`).
  Preemption by recomputation of the most recently admitted request when the next step's KV does not fit.
  One difference from vLLM: a prompt's whole KV is charged when it is admitted, not chunk by chunk.

The rules live once, in `InstanceScheduler` (tetri/scheduling/instance.py); the simulator and the live
sim engine both run them.
"""

from __future__ import annotations

COLOCATED_SCHEDULES = ("prefill-first", "vllm-v0", "vllm-v1")
BASELINES = ("vllm-v0", "vllm-v1")  # the named baselines `tetrictl bench` and `--baseline` take
