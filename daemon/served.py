"""The models this daemon serves and their tokenizers. A worker announces its model's name and where its
tokenizer is at registration; the first registration of a model loads that tokenizer (off the event
loop), and a tokenizer that cannot be loaded refuses the registration with the reason. Later workers of the
same model share it."""

from __future__ import annotations

import asyncio
import logging

from .cluster import Registration
from .tokenizer import Tokenizer, TokenizerError, load_tokenizer

log = logging.getLogger(__name__)


class ServedModels:
    def __init__(self) -> None:
        self._tokenizers: dict[str, Tokenizer | None] = {}
        self._sources: dict[str, str] = {}
        self._lock = asyncio.Lock()

    def tokenizer(self, model: str) -> Tokenizer | None:
        """The model's tokenizer; None when its workers announced none (token-id prompts only)."""
        return self._tokenizers.get(model)

    async def prepare(self, reg: Registration) -> str | None:
        """Load the registering model's tokenizer if it is new; why the registration is refused, or None."""
        async with self._lock:
            known = reg.model in self._sources
            if known and (self._tokenizers[reg.model] is not None or not reg.tokenizer):  # keep the first one
                if reg.tokenizer and reg.tokenizer != self._sources[reg.model]:
                    log.info("model %s: keeping the tokenizer from %s", reg.model, self._sources[reg.model])
                return None
            try:
                tok = await asyncio.to_thread(load_tokenizer, reg.tokenizer)
            except TokenizerError as e:
                return f"model {reg.model!r}: {e} (the daemon loads the tokenizer from the path the worker announces)"
            self._tokenizers[reg.model] = tok
            self._sources[reg.model] = reg.tokenizer
            return None
