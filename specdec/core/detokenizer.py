"""Incremental detokenizing and stop strings, for one output sequence.

Text grows a few tokens at a time (1..k+1 per step under speculation). Decoding only a window of the
last tokens keeps each step O(window), and a byte-level token that ends inside a multi-byte character
(decoded as U+FFFD) is held back until the character is complete (vLLM's prefix/read offsets).

Stop strings are matched in the text as it grows; the output ends before the first match (or after it
with ``include_stop_str_in_output``). While running, the last ``max(len(stop)) - 1`` characters are held
back from streaming, so that streamed text is never taken back. Knows nothing about models or requests.
"""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars that may start a stop string
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0  # tokens before this are settled text
        self.read_offset = 0  # tokens before this have been turned into text
        self.stop_reason: str | None = None  # the stop string that matched
        self.streamed = 0  # characters of text handed out by stream_delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def add(self, new_token_ids: Sequence[int]) -> str | None:
        """Append tokens; returns the stop string when one has matched (the text is then final).
        Tokens after the one that completes a stop string are ignored: the caller truncates to
        ``len(token_ids)``."""
        for tok in new_token_ids:
            if self.stop_reason is not None:
                break
            self.token_ids.append(tok)
            prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.token_ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                delta = full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
                self.text += delta
                self._match_stop(len(delta))
        return self.stop_reason

    def _match_stop(self, delta_len: int) -> None:
        if not self.stop:
            return
        start = max(0, len(self.text) - delta_len - self.hold)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            i, s = min(hits)
            self.stop_reason = s
            self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]

    def finish(self) -> str:
        """The final text: any held-back partial character is decoded as it is (U+FFFD)."""
        if self.stop_reason is None and self.read_offset < len(self.token_ids):
            prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.token_ids[self.prefix_offset:])
            self.text += full[len(prefix):]
            self.read_offset = len(self.token_ids)
        return self.text

    def stream_delta(self, finished: bool) -> str:
        """The text not yet streamed that can no longer change (all of it once finished)."""
        end = len(self.text) if finished or self.stop_reason is not None else max(self.streamed, len(self.text) - self.hold)
        delta = self.text[self.streamed:end]
        self.streamed = end
        return delta
