"""Run by test_core.py in a child process (vLLM's engines leave warnings the suite treats as errors): a
colocated vLLM engine whose requests run through its engine core directly (`workers/engines/vllm/core.py`).
Prints one JSON line:
  * `same`: a greedy request's tokens through `generate_to` equal those through the `generate` iterator;
  * `fault`: a request whose sink raises ends alone, with an EngineError, while one beside it gets all its
    tokens;
  * `aborted`: `abort` ends a running request's `generate_to` with EngineError("aborted").

    python tests/vllm/core_scenario.py MODEL_DIR
"""

from __future__ import annotations

import asyncio
import json
import sys

from tetri.sampling import Sampling
from workers.engines.base import EngineError, EngineRequest
from workers.engines.vllm.engine import VllmEngine, VllmOptions

PAST_EOS = Sampling(ignore_eos=True)


def _request(rid: str, max_tokens: int) -> EngineRequest:
    prompt = tuple((7 * k + len(rid)) % 400 + 1 for k in range(24))
    return EngineRequest(rid, prompt, max_tokens, sampling=PAST_EOS)


class Broken:
    def extend(self, tokens: list[int], /) -> None:
        raise RuntimeError("a broken sink")


async def _error_of(run: asyncio.Future[None] | asyncio.Task[None]) -> str | None:
    try:
        await run
    except EngineError as e:
        return str(e)
    return None


async def scenario(model: str) -> dict[str, object]:
    opts = VllmOptions(model=model, max_model_len=1024, block_size=32, dtype="float32")
    engine = VllmEngine(opts, "colocated", "co-core")
    await engine.start()
    try:
        got: list[int] = []
        await engine.generate_to(_request("a", 12), got)
        again = [t async for t in engine.generate(_request("b", 12))]

        beside: list[int] = []
        broken = asyncio.ensure_future(engine.generate_to(_request("c", 40), Broken()))
        fine = asyncio.ensure_future(engine.generate_to(_request("d", 40), beside))
        fault = await _error_of(broken)
        await fine

        slow: list[int] = []
        running = asyncio.ensure_future(engine.generate_to(_request("e", 400), slow))
        while not slow:
            await asyncio.sleep(0.01)
        await engine.abort("e")
        aborted = await _error_of(running)
        return {
            "same": got == again and len(got) == 12,
            "fault": fault is not None and "broken sink" in fault and len(beside) == 40,
            "aborted": aborted == "aborted" and len(slow) < 400,
        }
    finally:
        await engine.stop()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(scenario(sys.argv[1]))))
