"""HostKVConnector: Tetri's vLLM KV connector for a prefill and a decode engine that share a filesystem
(one host: a tmpfs such as /dev/shm; or a shared mount).

A hand-over is one file named by its key (`connectors.kv_file`; the prefill engine picks a fresh key per
prompt). The prefill engine's request carries ``{"tetri_store": key}``: in the step that computes the
prompt each attention layer's KV blocks of **the whole prompt** are kept, and when the step's forward is
done they are written as one file (aside, then renamed: it appears whole). The decode engine's request
(the prompt plus the first token) carries ``{"tetri_load": key}``: its scheduler counts every prompt
token as loaded but those its own prefix cache holds already (vLLM asks the connector after its local
lookup), the model worker reads only the other blocks from the file into the request's own blocks and
removes it, and the step computes the first token only — an ordinary decode step. A decode engine that
holds the whole prompt loads nothing and removes the file at once. When the request finishes the connector
reports how many prompt tokens its prefix cache gave (``kv_transfer_params["tetri_local_tokens"]`` on
vLLM's last output), so the engine can tell those from the ones the hand-over brought.

vLLM's ExampleConnector, which Tetri used before, hands over whole blocks only: the decode engine then
recomputes up to a block of prompt tokens plus the first token in a prefill-shaped step, and it names
folders by a hash of the tokens, never removes them and kills its engine on a prompt of whole blocks
(docs/vllm.md).

Whole blocks move, the partial last one included: a block's interior is the attention backend's own (the
CPU backend keeps a block's keys, then its values, under each head), so copying blocks is right for any
backend, and the positions past the prompt are written by the decode engine's own steps. The file is the
blocks' raw bytes, layer after layer in the order of the layers' names; the reader knows the shape from
its own cache and the request, and a file of any other size is refused.

A file missing or refused when the model worker loads it (its lease ran out on the prefill side: the
decode engine held the request back that long) is reported as failed blocks and vLLM recomputes them
(``kv_load_failure_policy = "recompute"``, `connectors.transfer_config`).

Loaded by vLLM in its engine-core and model-worker processes (``kv_connector_module_path``).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from .connectors import LOAD, LOCAL, STORE, complete, kv_file

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass
class _Move:
    key: str
    blocks: list[int]  # the request's KV blocks holding the handed-over tokens, in token order
    skip: int = 0  # the file's blocks before them (held by the decode engine's prefix cache: not read)


@dataclass
class HostKVMetadata(KVConnectorMetadata):
    stores: list[_Move] = field(default_factory=list)
    loads: list[_Move] = field(default_factory=list)


def _params(request_or_sampling: Any) -> dict[str, Any]:
    """A request's kv_transfer_params (vLLM's Request has them; a scheduled request's SamplingParams
    carries them in extra_args)."""
    params = getattr(request_or_sampling, "kv_transfer_params", None)
    if params is None:
        params = (getattr(request_or_sampling, "extra_args", None) or {}).get("kv_transfer_params")
    return params or {}


def _covering(block_ids: list[int], block_size: int, tokens: int) -> list[int]:
    return block_ids[: -(-tokens // block_size)]


class HostKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        root = self._kv_transfer_config.get_from_extra_config("shared_storage_path", None)
        if not root:
            raise ValueError("HostKVConnector needs kv_connector_extra_config.shared_storage_path")
        self._root = str(root)
        self._to_load: dict[str, str] = {}  # scheduler: vLLM request id -> key, for the next step's metadata
        self._local: dict[str, int] = {}  # scheduler: request id -> prompt tokens its prefix cache held
        self._storing: dict[str, dict[str, torch.Tensor]] = {}  # worker: key -> layer name -> blocks, this step
        self._failed: set[int] = set()  # worker: blocks whose load failed in this step

    # --- scheduler side ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Asked after vLLM's own prefix-cache lookup (`num_computed_tokens`: the prompt tokens it holds, in
        whole blocks): the hand-over brings the rest of the prompt."""
        key = _params(request).get(LOAD)
        if not key:
            return 0, False
        self._local[request.request_id] = num_computed_tokens
        if not complete(self._root, key):
            return 0, False  # it is gone: the engine computes what its cache does not hold
        handed = len(request.prompt_token_ids or []) - 1  # the prompt; the last token is the first output
        if handed <= num_computed_tokens:  # the prefix cache holds it all: nothing to read
            with contextlib.suppress(FileNotFoundError):
                os.remove(kv_file(self._root, key))
            return 0, False
        return handed - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._to_load[request.request_id] = str(_params(request)[LOAD])

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A decode request's end: how much of its prompt came from the prefix cache (the engine subtracts it
        from vLLM's cached count to get what the hand-over brought)."""
        local = self._local.pop(request.request_id, None)
        return False, None if local is None else {LOCAL: local}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HostKVMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            tokens = len(new.prompt_token_ids or [])
            key = self._to_load.pop(new.req_id, None)
            if key is not None:
                skip = self._local.get(new.req_id, 0) // self._block_size  # held here: not read
                covering = _covering(new.block_ids[0], self._block_size, tokens - 1)
                meta.loads.append(_Move(key, covering[skip:], skip))
                continue
            store = _params(new.sampling_params).get(STORE)
            if store:  # the prefill engine fits any prompt in its first step (VllmEngine._engine_args)
                meta.stores.append(_Move(str(store), _covering(new.block_ids[0], self._block_size, tokens)))
        # a request preempted before its load ran comes back as a new one and is matched again
        self._to_load.clear()
        return meta

    # --- worker side ---------------------------------------------------------------------------------
    def _meta(self) -> HostKVMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HostKVMetadata)
        return meta

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        for move in self._meta().loads:
            path = kv_file(self._root, move.key)
            layers = sorted(
                (name, _layer(layer.kv_cache))
                for name, layer in forward_context.no_compile_layers.items()
                if getattr(layer, "kv_cache", None) is not None
            )
            try:
                _read(path, [cache for _, cache in layers], move.blocks, move.skip)
            except (OSError, ValueError):  # gone (its lease ran out) or not this request's shape
                self._failed.update(move.blocks)
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)  # one hand-over, one load

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        for move in self._meta().stores:
            self._storing.setdefault(move.key, {})[layer_name] = _layer(kv_layer)[move.blocks].cpu()

    def wait_for_save(self) -> None:
        storing, self._storing = self._storing, {}
        for key, layers in storing.items():
            path = kv_file(self._root, key)
            aside = path + ".part"
            try:
                with open(aside, "wb") as f:
                    for name in sorted(layers):
                        f.write(_bytes(layers[name]))
                os.replace(aside, path)
            except OSError as e:  # no hand-over then: the decode side recomputes or fails, per its on_missing_kv
                logger.warning("HostKVConnector: cannot write %s: %s", path, e)
                with contextlib.suppress(OSError):
                    os.remove(aside)


def _layer(cache: Any) -> torch.Tensor:
    """One attention layer's cache as vLLM's standardized [blocks, …] view."""
    return cache[0] if isinstance(cache, (list, tuple)) else cache


def _bytes(t: torch.Tensor) -> memoryview:
    """A tensor's raw bytes, flat (any dtype, bfloat16 included)."""
    return t.contiguous().view(torch.uint8).numpy().reshape(-1).data


def _read(path: str, caches: list[torch.Tensor], blocks: list[int], skip: int = 0) -> None:
    """Read a hand-over's blocks `skip` … into `blocks` of each cache (in layer-name order); the file must
    hold exactly `skip + len(blocks)` blocks of each layer."""
    n = skip + len(blocks)
    with open(path, "rb") as f:
        for cache in caches:
            block_bytes = cache[0].numel() * cache.element_size()
            f.seek(skip * block_bytes, os.SEEK_CUR)  # past the blocks the decode engine holds
            part = torch.empty((len(blocks), *cache.shape[1:]), dtype=cache.dtype)
            raw = _bytes(part)  # part is contiguous: reading into its bytes fills it
            if f.readinto(raw) != len(raw):
                raise ValueError(f"{path}: shorter than {n} blocks of {len(caches)} layers")
            cache[blocks] = part.to(cache.device)
        if f.read(1):
            raise ValueError(f"{path}: longer than {n} blocks of {len(caches)} layers")
