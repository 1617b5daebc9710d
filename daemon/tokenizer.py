"""Text ⇄ token ids, per served model: the model's own tokenizer (a local Hugging Face directory, loaded
with `tokenizers`; its chat template rendered with jinja2 as `transformers` renders it), or the sim
engine's built-in byte tokenizer. Nothing is downloaded.

Decoding is incremental and matches vLLM's own detokenizer (`tokenizers`' DecodeStream primed with the
prompt, special tokens skipped): a character split over several tokens comes out whole, once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

BUILTIN_BYTES = "builtin:bytes"  # the tokenizer source a sim worker announces
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "ba", "do", "fu", "gi", "ho", "ju", "pe")
# the sim's chat template (the model has none of its own): role-tagged turns, then the assistant's cue
BUILTIN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded, or a chat the template refuses (one line, for the client)."""


class Decoder(Protocol):
    def step(self, token_id: int) -> str: ...


class Tokenizer(Protocol):
    vocab_size: int
    eos_ids: frozenset[int]  # the model's end-of-sequence ids (tokenizer's and generation config's)
    defaults: dict[str, float]  # sampling defaults from the model's generation config (vLLM applies them too)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decoder(self, prompt_ids: Sequence[int]) -> Decoder: ...

    def render_chat(self, messages: list[dict[str, Any]]) -> str: ...


class _ByteDecoder:
    def step(self, token_id: int) -> str:
        n = len(_SYLLABLES)
        return " " + _SYLLABLES[token_id % n] + _SYLLABLES[(token_id // n) % n]


class ByteTokenizer:
    """The sim engine's tokenizer: prompts are UTF-8 bytes (ids 0–255); output ids read as pseudo-words."""

    vocab_size = 256
    eos_ids: frozenset[int] = frozenset()
    defaults: dict[str, float] = {}  # noqa: RUF012 - read only

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decoder(self, prompt_ids: Sequence[int]) -> Decoder:
        return _ByteDecoder()

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        return _template(BUILTIN_CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)


class _StreamDecoder:
    """vLLM's FastIncrementalDetokenizer step: DecodeStream primed with the prompt, reset on the rare
    invalid-prefix error."""

    def __init__(self, tok: Any, prompt_ids: Sequence[int]) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tok
        self._new = DecodeStream
        self._stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._tok, token_id) or ""
        except Exception as e:
            if not str(e).startswith("Invalid prefix encountered"):
                raise
            self._stream = self._new(skip_special_tokens=True)
            return self._stream.step(self._tok, token_id) or ""


class HfTokenizer:
    """A model directory's tokenizer: tokenizer.json, tokenizer_config.json (special tokens, chat
    template, or chat_template.jinja beside it) and generation_config.json (EOS ids, sampling defaults)."""

    def __init__(self, directory: str) -> None:
        from tokenizers import Tokenizer as RawTokenizer

        root = Path(directory)
        if not (root / "tokenizer.json").is_file():
            raise TokenizerError(f"no tokenizer.json in {directory}")
        try:
            self._tok = RawTokenizer.from_file(str(root / "tokenizer.json"))
            config = _json(root / "tokenizer_config.json")
            generation = _json(root / "generation_config.json")
        except Exception as e:  # OSError, bad JSON, or tokenizers' own Exception type
            raise TokenizerError(f"cannot load the tokenizer in {directory}: {e}") from None
        self.vocab_size = self._tok.get_vocab_size()
        self.special: dict[str, str] = {}
        for k, v in config.items():
            token = _content(v)
            if k.endswith("_token") and token:
                self.special[k] = token
        eos = {self._tok.token_to_id(self.special["eos_token"])} if "eos_token" in self.special else set()
        gen_eos = generation.get("eos_token_id")
        eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        self.eos_ids = frozenset(int(i) for i in eos if i is not None)
        knobs = ("temperature", "top_p", "top_k")
        self.defaults = {k: float(generation[k]) for k in knobs if isinstance(generation.get(k), int | float)}
        chat = config.get("chat_template")
        jinja = root / "chat_template.jinja"
        if chat is None and jinja.is_file():
            chat = jinja.read_text(encoding="utf-8")
        self.chat_template = chat if isinstance(chat, str) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decoder(self, prompt_ids: Sequence[int]) -> Decoder:
        return _StreamDecoder(self._tok, prompt_ids)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template (use /v1/completions)")
        return _template(self.chat_template).render(messages=messages, add_generation_prompt=True, **self.special)


def load_tokenizer(source: str) -> Tokenizer | None:
    """The tokenizer a worker announced: a directory, the built-in byte tokenizer, or none ("")."""
    if not source:
        return None
    if source == BUILTIN_BYTES:
        return ByteTokenizer()
    return HfTokenizer(source)


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _content(v: object) -> str | None:
    """A special token as tokenizer_config.json gives it: a string, or an AddedToken dict."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


@lru_cache(maxsize=32)
def _template(source: str) -> Any:
    """A chat template compiled the way `transformers` compiles it (sandboxed, trim/lstrip blocks,
    loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII)."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: object, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise TokenizerError(f"the model's chat template does not compile: {e}") from None


def render(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> str:
    """The chat as the model's template renders it; a template that refuses the chat (its own
    `raise_exception`, or a jinja error) is a `TokenizerError` with its message."""
    from jinja2 import TemplateError

    try:
        return tokenizer.render_chat(messages)
    except TemplateError as e:
        raise TokenizerError(f"the chat template refused these messages: {e}") from None


__all__ = ["BUILTIN_BYTES", "ByteTokenizer", "HfTokenizer", "Tokenizer", "TokenizerError", "load_tokenizer", "render"]
