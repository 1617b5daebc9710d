"""vLLM KV connectors, by name: how each is configured per role and what travels with a hand-over.

* ``HostKVConnector`` — Tetri's (`hostkv`): a prefill and a decode engine sharing a filesystem (one host:
  a tmpfs; or a shared mount). The prefill engine writes the KV of the whole prompt to a folder named by
  the hand-over's key; the decode engine loads all of it, removes the folder and computes only the first
  token. For single-host runs (the CPU, the tests). Folders the decode side never loads (a failed
  hand-over) are removed by the prefill engine after ``kv_lease_s``.
* ``NixlConnector`` — GPU clusters: the decode side pulls the KV over NIXL (UCX/RDMA) from the prefill
  side; the producer's output carries ``kv_transfer_params`` (remote engine, blocks, host, port) that
  the consumer's request must carry back.
(vLLM 0.32 removed its NCCL point-to-point connector, ``P2pNcclConnector``: NIXL is the GPU path.)

`kv_role` per worker role: prefill → ``kv_producer``, decode → ``kv_consumer``, colocated → no connector;
``kv_both`` (a worker that may flip without restarting its engine) → ``kv_both`` in either role.
"""

from __future__ import annotations

import json
import os
from typing import Any

HOST_KV = "HostKVConnector"
CONNECTORS = (HOST_KV, "NixlConnector")
PARAMS_KEY = "kv_transfer_params"  # KVHandle.params key: the producer's transfer parameters, JSON
KEY = "kv_key"  # KVHandle.params key (HostKVConnector): the hand-over's folder
STORE = "tetri_store"  # kv_transfer_params key on a prefill request (HostKV): the hand-over to write
LOAD = "tetri_load"  # on a decode request: the hand-over to read
LOCAL = "tetri_local_tokens"  # on a decode request's last output (HostKV): prompt tokens its prefix cache held


def kv_file(store: str, key: str) -> str:
    """The file of one HostKV hand-over (keys are the prefill engine's own: hex, no path parts). It
    appears whole (written aside, then renamed) once the prompt's step is done."""
    return os.path.join(store, os.path.basename(key) + ".kv")


def complete(store: str, key: str) -> bool:
    """Whether that hand-over's KV is all written."""
    return os.path.exists(kv_file(store, key))


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
    if connector == HOST_KV:
        cfg["kv_connector_module_path"] = "workers.engines.vllm.hostkv"
        cfg["kv_connector_extra_config"].setdefault("shared_storage_path", store)
        # a hand-over whose folder vanished (its lease ran out) is recomputed, not an engine failure
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


def prefill_params(connector: str, key: str) -> dict[str, Any]:
    """kv_transfer_params on the prefill request: where to store the KV (HostKV), or NIXL/NCCL's "keep the
    blocks for a remote decode"."""
    if connector == HOST_KV:
        return {STORE: key}
    return {"do_remote_decode": True, "do_remote_prefill": False}


def handoff_params(connector: str, key: str, produced: dict[str, Any] | None) -> dict[str, str]:
    """What the KVHandle carries to the decode worker."""
    if connector == HOST_KV:
        return {"connector": connector, KEY: key}
    if not produced:
        return {"connector": connector}
    return {"connector": connector, PARAMS_KEY: json.dumps(produced)}


def decode_params(kv_params: dict[str, str]) -> dict[str, Any] | None:
    """kv_transfer_params on the decode request: where to load the KV from (HostKV), or the producer's
    parameters (NIXL/NCCL); None: nothing to load."""
    if kv_params.get(KEY):
        return {LOAD: kv_params[KEY]}
    raw = kv_params.get(PARAMS_KEY)
    if not raw:
        return None
    params: dict[str, Any] = json.loads(raw)
    params["do_remote_prefill"] = True
    params["do_remote_decode"] = False
    return params
