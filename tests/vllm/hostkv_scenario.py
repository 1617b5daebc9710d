"""Run by test_hostkv.py in a child process (vLLM's engines leave warnings the suite treats as errors): a
prefill and a decode engine over HostKVConnector, one hand-over. Prints one JSON line.

    python tests/vllm/hostkv_scenario.py MODEL_DIR STORE_DIR cut|bfloat16

cut (float32): the hand-over file is cut short before the decode engine loads it; "handed" is the decode
engine's answer for that request, "computed" its answer for the same prompt and first token without a
hand-over. bfloat16: a whole hand-over in bfloat16 (vLLM's AMX attention on CPUs that have AMX); "handed"
as before, "loaded" the prompt tokens vLLM took from it. "left": the hand-over files left in the store.
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


async def scenario(model: str, store: str, mode: str) -> dict[str, object]:
    dtype = "bfloat16" if mode == "bfloat16" else "float32"
    opts = VllmOptions(model=model, kv_store=store, dtype=dtype, block_size=32, max_model_len=1024)
    greedy = Sampling(temperature=0.0, ignore_eos=True)
    prompt = tuple((5 * k) % 500 + 1 for k in range(150))
    prefill, decode = VllmEngine(opts, "prefill", "p"), VllmEngine(opts, "decode", "d")
    await prefill.start()
    await decode.start()
    got: dict[str, object] = {}
    try:
        req = EngineRequest("r1", prompt, 6, None, 0, greedy)
        first = await prefill.prefill(req)
        if mode == "cut":
            path = Path(connectors.kv_file(store, first.kv.params[connectors.KEY]))
            path.write_bytes(path.read_bytes()[:1000])  # there, by its name complete, and unreadable
        await decode.load_kv(req, first.kv)
        got["handed"] = [t async for t in decode.decode(req, first.first_token)]
        got["loaded"] = decode.kv_loaded("r1")
        if mode == "cut":
            plain = EngineRequest("r2", prompt, 6, None, 0, greedy)  # no hand-over: computed here
            got["computed"] = [t async for t in decode.decode(plain, first.first_token)]
    finally:
        await decode.stop()
        await prefill.stop()
    return got | {"left": sorted(p.name for p in Path(store).glob("*.kv"))}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(scenario(sys.argv[1], sys.argv[2], sys.argv[3]))))
