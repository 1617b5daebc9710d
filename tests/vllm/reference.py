"""Greedy tokens from one colocated vLLM engine (the reference the disaggregated cluster must match).

python -m tests.vllm.reference MODEL_DIR MAX_MODEL_LEN BLOCK_SIZE < prompts.json > tokens.json
"""

from __future__ import annotations

import asyncio
import json
import sys

from workers.engines.base import EngineRequest
from workers.engines.vllm.engine import VllmEngine, VllmOptions


async def main(model: str, max_len: int, block_size: int, jobs: list[dict]) -> list[list[int]]:
    opts = VllmOptions(model=model, max_model_len=max_len, block_size=block_size, dtype="float32")
    engine = VllmEngine(opts, "colocated", "ref")
    await engine.start()
    try:
        out = []
        for k, job in enumerate(jobs):
            req = EngineRequest(f"ref-{k}", tuple(job["prompt"]), job["max_tokens"])
            out.append([t async for t in engine.generate(req)])
        return out
    finally:
        await engine.stop()


if __name__ == "__main__":
    jobs = json.load(sys.stdin)
    print(json.dumps(asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), jobs))))
