"""Text ⇄ token ids for engines without a tokenizer (the sim engine).

Prompts given as text are byte-tokenised (UTF-8 bytes, ids 0–255); output ids are rendered as short
pseudo-words so responses are readable. A real model's tokenizer replaces this in the vLLM issue.
"""

from __future__ import annotations

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "ba", "do", "fu", "gi", "ho", "ju", "pe")


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return "".join(self._word(i) for i in ids)

    @staticmethod
    def _word(i: int) -> str:
        n = len(_SYLLABLES)
        return " " + _SYLLABLES[i % n] + _SYLLABLES[(i // n) % n]
