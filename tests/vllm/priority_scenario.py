"""Run by test_priority.py in a child process (vLLM's engines leave warnings the suite treats as errors): a
colocated vLLM engine under vLLM's priority scheduling policy, one sequence at a time. A long request holds
the sequence; then one predicted long and one predicted short arrive, in that order. Prints one JSON line:
per `queue_order` (fcfs, then srpt, hot-swapped on the same engine), the order of their first tokens; and
the KV-event IPC socket files this process left behind once the engine stopped (none).

    python tests/vllm/priority_scenario.py MODEL_DIR
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import sys
import tempfile

from tetri.sampling import Sampling
from tetri.scheduling.policyset import PolicySet
from workers.engines.base import EngineRequest
from workers.engines.vllm.engine import VllmEngine, VllmOptions

PAST_EOS = Sampling(ignore_eos=True)


def _request(rid: str, max_tokens: int, predicted: tuple[int, int] | None = None) -> EngineRequest:
    prompt = tuple((5 * k + len(rid)) % 400 + 1 for k in range(16))
    return EngineRequest(rid, prompt, max_tokens, predicted, sampling=PAST_EOS)


async def first_tokens(engine: VllmEngine, order: str) -> list[str]:
    engine.configure(PolicySet(queue_order=order, predictor="oracle"))
    started: list[str] = []
    holding = asyncio.Event()

    async def run(req: EngineRequest) -> None:
        async for _ in engine.generate(req):
            if req.request_id not in started:
                started.append(req.request_id)
                holding.set()

    hold = asyncio.create_task(run(_request(f"hold-{order}", 600)))
    await asyncio.wait_for(holding.wait(), 120)
    long = asyncio.create_task(run(_request(f"long-{order}", 4, (801, 1000))))
    await asyncio.sleep(0.2)  # vLLM has it before the short one (the holder has hundreds of steps to go)
    short = asyncio.create_task(run(_request(f"short-{order}", 4, (1, 200))))
    await asyncio.wait_for(asyncio.gather(hold, long, short), 300)
    return [rid.split("-")[0] for rid in started]


async def scenario(model: str) -> dict[str, list[str]]:
    """The first-token orders; `left`: this process's KV-event socket files left once the engine stopped."""
    opts = VllmOptions(
        model=model, max_model_len=1024, block_size=32, dtype="float32", max_num_seqs=1, scheduling_policy="priority"
    )
    engine = VllmEngine(opts, "colocated", "co-priority")
    await engine.start()
    try:
        got = {order: await first_tokens(engine, order) for order in ("fcfs", "srpt")}
    finally:
        await engine.stop()
    return got | {"left": sorted(glob.glob(os.path.join(tempfile.gettempdir(), f"tetri-kv-{os.getpid()}-*")))}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(scenario(sys.argv[1]))))
