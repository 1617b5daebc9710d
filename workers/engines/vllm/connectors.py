"""vLLM KV connectors, by name: how each is configured per role and what travels with a hand-over.

* ``ExampleConnector`` — a shared storage path (one host, or a shared filesystem): the producer writes
  the KV of the prompt's whole blocks, short of its last token, as safetensors under a folder named by
  a hash of those tokens; the consumer, given ``prompt + [first token]``, finds the folder and injects
  the KV, computing only the rest. Folders are not removed after loading (the same prompt may be in
  flight twice); the store is the operator's to clean.
  For single-host CPU runs and the tests. The engine checks the folder before decoding (a missing one is
  an error or a recompute, per ``on_missing_kv``).
* ``NixlConnector`` — GPU clusters: the decode side pulls the KV over NIXL (UCX/RDMA) from the prefill
  side; the producer's output carries ``kv_transfer_params`` (remote engine, blocks, host, port) that
  the consumer's request must carry back.
* ``P2pNcclConnector`` — GPUs where NIXL is absent: NCCL point-to-point between the two engines;
  the same parameter hand-over.

`kv_role` per worker role: prefill → ``kv_producer``, decode → ``kv_consumer``, colocated → no connector;
``kv_both`` (a worker that may flip without restarting its engine) → ``kv_both`` in either role.
"""

from __future__ import annotations

import json
import os
from typing import Any

CONNECTORS = ("ExampleConnector", "NixlConnector", "P2pNcclConnector")
PARAMS_KEY = "kv_transfer_params"  # KVHandle.params key: the producer's transfer parameters, JSON


def kv_role(role: str, kv_both: bool) -> str | None:
    if role == "colocated":
        return None
    if kv_both:
        return "kv_both"
    return "kv_producer" if role == "prefill" else "kv_consumer"


def transfer_config(
    connector: str, role: str, kv_both: bool, store: str, extra: dict[str, Any]
) -> dict[str, Any] | None:
    """The `KVTransferConfig` fields for this worker, or None (no connector: colocated)."""
    if connector not in CONNECTORS:
        raise ValueError(f"unknown KV connector {connector!r} (choose from {', '.join(CONNECTORS)})")
    r = kv_role(role, kv_both)
    if r is None:
        return None
    cfg: dict[str, Any] = {"kv_connector": connector, "kv_role": r, "kv_connector_extra_config": dict(extra)}
    if connector == "ExampleConnector":
        cfg["kv_connector_extra_config"].setdefault("shared_storage_path", store)
    return cfg


def prefill_params(connector: str) -> dict[str, Any] | None:
    """kv_transfer_params on the prefill request (NIXL/NCCL: keep the blocks for a remote decode)."""
    if connector == "ExampleConnector":
        return None
    return {"do_remote_decode": True, "do_remote_prefill": False}


def handoff_params(connector: str, produced: dict[str, Any] | None) -> dict[str, str]:
    """What the KVHandle carries to the decode worker."""
    if connector == "ExampleConnector" or not produced:
        return {"connector": connector}
    return {"connector": connector, PARAMS_KEY: json.dumps(produced)}


def decode_params(kv_params: dict[str, str]) -> dict[str, Any] | None:
    """kv_transfer_params on the decode request: the producer's parameters, if the connector has any."""
    raw = kv_params.get(PARAMS_KEY)
    if not raw:
        return None
    params: dict[str, Any] = json.loads(raw)
    params["do_remote_prefill"] = True
    params["do_remote_decode"] = False
    return params


def empty_prefix_folder(store: str) -> str:
    """The folder ExampleConnector writes (with no KV in it) for a prompt shorter than a block."""
    import torch
    from vllm.utils.hashing import safe_hash

    return os.path.join(
        store, safe_hash(torch.tensor([], dtype=torch.int64).numpy().tobytes(), usedforsecurity=False).hexdigest()
    )


def example_folder(store: str, prompt: list[int], block_size: int) -> str | None:
    """Where ExampleConnector keeps the KV of ``prompt`` (None: too short to store a whole block).

    ``prompt`` is the consumer's (the original prompt plus the first token). Mirrors the connector's own
    naming (a hash of the int64 bytes of the block-aligned tokens); `tests/vllm` checks the two agree on
    real files."""
    import torch
    from vllm.utils.hashing import safe_hash

    n = (len(prompt) - 2) // block_size * block_size  # ExampleConnector's align_to_block_size(len - 1)
    if n <= 0:
        return None
    digest = safe_hash(torch.tensor(prompt)[:n].numpy().tobytes(), usedforsecurity=False).hexdigest()
    return os.path.join(store, digest)


def stored_tokens(prompt_len: int, block_size: int) -> int:
    """Prompt tokens whose KV ExampleConnector hands over: the whole blocks before the prompt's last token."""
    return max(0, (prompt_len - 1) // block_size * block_size)
