"""A request's output as text: incremental detokenization, stop strings and stop tokens, the way vLLM's
output processor does them, so Tetri's answers match a plain vLLM server's character for character.

Fed the token ids a worker streams, one chunk at a time. Per token: a stop token (the model's EOS unless
`ignore_eos`) ends the output and is counted but not rendered; otherwise the token's text is appended and
the stop strings are searched in the new tail; the first that completes ends the output just before it
(tokens after the one completing it are dropped). While streaming, the last `max(len(stop)) − 1`
characters are held back so a stop string is never half sent; `rest()` releases them at the end. Only
the text not sent yet is kept (a stop string completing now starts in it): a token costs the same at the
4,000th token as at the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..tokenizer import Decoder


@dataclass(slots=True)  # one per chunk of tokens: not frozen (a frozen dataclass's __init__ costs 4×)
class Delta:
    ids: list[int]  # the chunk's tokens that count (up to and including a stop)
    text: str  # text that may be sent now
    stopped: bool = False  # a stop token or stop string ended the output


class TextStream:
    def __init__(self, decoder: Decoder, stop: Sequence[str] = (), stop_ids: frozenset[int] = frozenset()) -> None:
        self._decoder = decoder
        self._stop = [s for s in stop if s]
        self._stop_ids = stop_ids
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""  # text not sent yet (truncated at a stop string)
        self.stopped = False

    def feed(self, ids: Sequence[int]) -> Delta:
        kept: list[int] = []
        for tok in ids:
            if self.stopped:
                break
            kept.append(tok)
            if tok in self._stop_ids:
                self.stopped = True
                break
            piece = self._decoder.step(tok)
            if not piece:
                continue
            self._pending += piece
            if self._stop:
                self._check_stop(len(piece))
        return Delta(kept, self._take(self._hold if not self.stopped else 0), self.stopped)

    def rest(self) -> str:
        """The held-back text, at the end of the output."""
        return self._take(0)

    def _check_stop(self, new_chars: int) -> None:
        """A stop string completed by the last piece starts at most its length − 1 characters before that
        piece, which is held back: in the pending text."""
        text = self._pending
        best: tuple[int, int] | None = None  # (end, start) of the stop string completing earliest
        for s in self._stop:
            at = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
            if at != -1 and (best is None or at + len(s) < best[0]):
                best = (at + len(s), at)
        if best is not None:
            self._pending = text[: best[1]]
            self.stopped = True

    def _take(self, hold: int) -> str:
        text = self._pending
        end = max(0, len(text) - hold)
        self._pending = text[end:]
        return text[:end]
