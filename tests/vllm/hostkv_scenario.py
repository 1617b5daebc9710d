"""Run by test_hostkv.py in a child process: a prefill and a decode engine over HostKVConnector; the hand-over
file is cut short before the decode engine loads it. Prints one JSON line: the decode engine's tokens for
that request ("broken") and for the same prompt and first token without a hand-over ("computed"), and the
hand-over files left in the store.

    python tests/vllm/hostkv_scenario.py MODEL_DIR STORE_DIR
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from tetri.sampling import Sampling
from workers.engines.base import EngineRequest
from workers.engines.vllm import connectors
from workers.engines.vllm.engine import VllmEngine, VllmOptions


async def scenario(model: str, store: str) -> dict[str, object]:
    opts = VllmOptions(model=model, kv_store=store, dtype="float32", block_size=32, max_model_len=1024)
    greedy = Sampling(temperature=0.0, ignore_eos=True)
    prompt = tuple((5 * k) % 500 + 1 for k in range(150))
    prefill, decode = VllmEngine(opts, "prefill", "p"), VllmEngine(opts, "decode", "d")
    await prefill.start()
    await decode.start()
    try:
        req = EngineRequest("r1", prompt, 6, None, 0, greedy)
        first = await prefill.prefill(req)
        path = Path(connectors.kv_file(store, first.kv.params[connectors.KEY]))
        path.write_bytes(path.read_bytes()[:1000])  # there, by its name complete, and unreadable
        await decode.load_kv(req, first.kv)
        broken = [t async for t in decode.decode(req, first.first_token)]
        plain = EngineRequest("r2", prompt, 6, None, 0, greedy)  # no hand-over: computed here
        computed = [t async for t in decode.decode(plain, first.first_token)]
    finally:
        await decode.stop()
        await prefill.stop()
    return {"broken": broken, "computed": computed, "left": sorted(p.name for p in Path(store).glob("*.kv"))}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(scenario(sys.argv[1], sys.argv[2]))))
