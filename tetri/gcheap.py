"""The startup heap out of the garbage collector's way, for long-running servers (the daemon, workers).

A full (oldest-generation) collection walks every tracked object; after imports (vLLM and torch in a vLLM
worker; FastAPI, SQLAlchemy, grpc in the daemon) that is hundreds of thousands of objects that live as
long as the process, and each full pass stops the event loop for tens of milliseconds — a request in
flight sees it as a late first token (Tetri colocated's TTFT outliers against vLLM's server, docs/vllm.md).
`freeze_startup_heap()` moves what is alive at the end of startup to the permanent generation, which the
collector never walks; what serving allocates is collected as usual. vLLM's own server does the same.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    gc.collect()
    gc.freeze()
