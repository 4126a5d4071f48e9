"""Token ids in, text out, as a reply grows: incremental detokenization and `stop` strings.

Each token's text comes from the tokenizer library's own incremental decoder (a token that ends
inside a multi-byte UTF-8 character yields nothing until the character completes), so the text is
what decoding the whole id list gives, never a stray replacement character. The stream only hands
out text together with the tokens that produced it: while `stop` strings are set it holds back the
tail that could still be the start of one. When a stop string appears, the text ends right before
it and the tokens end with the one that carries the text's last character; the reply's token ids
(and its token hash) are those tokens. Without a stop string the final text is what decoding all the
reply's ids gives.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer as Backend
from tokenizers.decoders import DecodeStream


@dataclass
class Delta:
    """New text and the token ids that produced it."""

    text: str
    tokens: list[int]

    def __bool__(self) -> bool:
        return bool(self.text or self.tokens)


class TextStream:
    def __init__(self, backend: Backend, stop: list[str] | None = None, skip_special_tokens: bool = True):
        self.backend = backend
        self.stop = list(stop or ())
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars a stop string may still need
        self.skip_special_tokens = skip_special_tokens
        self.decoder = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self.ends: list[int] = [0]  # ends[k]: text length once ids[:k] are decoded
        self.complete: list[bool] = [True]  # complete[k]: ids[k-1] finished its characters
        self.text = ""
        self.sent = 0  # tokens handed out
        self.sent_chars = 0  # text handed out
        self.stopped = False

    @property
    def tokens(self) -> list[int]:
        """The tokens of the reply so far (those handed out, plus any held back)."""
        return self.ids

    def feed(self, tokens: list[int]) -> Delta:
        """Take one round's tokens; return what can be sent now (nothing more once a stop string is hit)."""
        if self.stopped:
            return Delta("", [])
        searched_from = max(0, len(self.text) - self.hold)
        for t in tokens:
            piece = self.decoder.step(self.backend, t)
            self.ids.append(t)
            self.text += piece or ""
            self.ends.append(len(self.text))
            self.complete.append(piece is not None)
        cut = self._find_stop(searched_from)
        if cut is not None:
            self._cut(cut)
            return self._take(len(self.ids))
        return self._take(self._safe())

    def finish(self) -> Delta:
        """Everything still held back (the reply has ended). Without a stop string the text becomes
        exactly what decoding all ids gives: bytes of an unfinished character decode as U+FFFD."""
        if not self.stopped and self.ids:
            whole = self.backend.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
            if whole.startswith(self.text):
                self.text = whole
                self.ends[-1] = len(whole)
        return self._take(len(self.ids))

    def _find_stop(self, start: int) -> int | None:
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _cut(self, at: int) -> None:
        """End the reply right before text position `at`, keeping the tokens that carry text before it."""
        k = max(self.sent, next(k for k in range(len(self.ends)) if self.ends[k] >= at))
        self.ids, self.ends, self.complete = self.ids[:k], self.ends[: k + 1], self.complete[: k + 1]
        self.text = self.text[:at]
        self.ends[-1] = min(self.ends[-1], at)
        self.stopped = True

    def _safe(self) -> int:
        """How many tokens can go out now: not those in the tail a stop string may still claim, and
        (with stop strings) not a last token whose character is unfinished."""
        if not self.stop:
            return len(self.ids)
        limit = len(self.text) - self.hold
        k = len(self.ids)
        while k > self.sent and (self.ends[k] > limit or not self.complete[k]):
            k -= 1
        return k

    def _take(self, k: int) -> Delta:
        end = max(self.sent_chars, self.ends[k])
        delta = Delta(self.text[self.sent_chars : end], self.ids[self.sent : k])
        self.sent, self.sent_chars = max(self.sent, k), end
        return delta
