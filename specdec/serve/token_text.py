"""Logprob tokens as text: what each token adds to the decoded text, its bytes, and its offset.

OpenAI and vLLM return logprob tokens as text (``" Berlin"``, ``"\\n"``), not tokenizer pieces (``"ĠBerlin"``,
``"Ċ"``). A token's text here is what it adds to the output in context, by the detokenizer's own rule
(specdec.core.detokenizer: decode a window and take the growth, holding a token back while it ends inside a
multi-byte character). So:

- joining the tokens of a completion gives its text (a token that ends inside a character adds ``""``; the
  one that completes it adds the character; tokens past a matched stop string add what the text kept);
- ``bytes`` are the token's share of the text's UTF-8: its text's bytes, except that the tokens sharing one
  split character each carry their own raw bytes (``[240, 159, 152]`` then ``[138]`` for one emoji), as
  OpenAI does; joining them gives the text's UTF-8;
- ``text_offset`` is where each token's text starts in the returned text (characters, as OpenAI counts);
- an alternative in ``top_logprobs`` is named by the text it would have added at that position; one that
  would have ended inside a character is named by its bytes (``"bytes:\\xe2\\x80"``, OpenAI's form); the
  chosen token is always named by its own token text, so ``top_logprobs[i][tokens[i]]`` finds it.

``return_tokens_as_token_ids`` (vLLM's extension) names every token ``"token_id:{id}"`` instead.
Knows nothing about HTTP, requests or engines: it reads a tokenizer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from specdec.datamodel.sequence import Logprob

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte fallback
_RESYNC = 8  # tokens decoded before a stream chunk's first one: > the 4 bytes of the longest UTF-8 character


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (one printable character per byte) -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class Piece:
    """One token's text in context."""

    __slots__ = ("id", "text", "bytes")

    def __init__(self, tok: int, text: str, raw: bytes | None) -> None:
        self.id = tok
        self.text = text
        self.bytes = raw  # None: its text's UTF-8


class TokenText:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special = set(tokenizer.all_special_ids)
        self._raw: dict[int, bytes] = {}

    # ------------------------------------------------------------------ one token
    def _decode(self, ids: Sequence[int], skip: bool) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip) if ids else ""

    def raw_bytes(self, tok: int) -> bytes:
        """The bytes a token stands for: byte-level BPE pieces through GPT-2's alphabet, ``<0xNN>`` pieces as
        that byte, anything else (specials, sentencepiece words) as the UTF-8 of its decoded text."""
        raw = self._raw.get(tok)
        if raw is None:
            piece = self.tokenizer.convert_ids_to_tokens(tok)
            dec = _byte_decoder()
            if piece is None:
                raw = b""
            elif tok in self.special:
                raw = piece.encode()
            elif m := _BYTE_PIECE.fullmatch(piece):
                raw = bytes([int(m.group(1), 16)])
            elif piece and all(c in dec for c in piece):
                raw = bytes(dec[c] for c in piece)
            else:
                raw = self._decode([tok], False).encode()
            self._raw[tok] = raw
        return raw

    @staticmethod
    def bytes_name(raw: bytes) -> str:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    # ------------------------------------------------------------------ a sequence
    def pieces(self, ids: Sequence[int], skip_special_tokens: bool = True, text: str | None = None,
               start: int = 0) -> list[Piece]:
        """Each token's text (and, where it shares a split character, its raw bytes) for ``ids[start:]``,
        decoded in the context of the tokens before it. With ``text`` (the text ``ids[start:]`` finally made:
        a whole answer's, a stream's last chunk's) the pieces are fitted to it: joined they equal it (a stop
        string cut off, a final partial character decoded as U+FFFD)."""
        out, _ = self._walk(ids, skip_special_tokens, start, alternatives=None)
        if text is not None:
            _fit(out, text)
        return out

    def _walk(self, ids: Sequence[int], skip: bool, start: int, alternatives: Sequence[Sequence[int]] | None,
              ) -> tuple[list[Piece], list[dict[int, tuple[str, bytes]]]]:
        """The detokenizer's walk (see specdec.core.detokenizer.IncrementalDetokenizer.add) from ``start``
        (resynchronised a few tokens before it); ``alternatives[i]``: ids whose text at position start+i is
        wanted too, with its bytes (raw where it would complete a character split before it)."""
        begin = max(0, start - _RESYNC)
        prefix_off = read_off = begin
        out: list[Piece] = []
        alts: list[dict[int, tuple[str, bytes]]] = []
        group: list[Piece] = []  # pieces since the last one that added text (a split character's tokens)
        for i in range(begin, len(ids)):
            prefix = self._decode(ids[prefix_off:read_off], skip)
            if alternatives is not None and i >= start:
                names = {}
                for alt in alternatives[i - start]:
                    if alt == ids[i]:
                        continue
                    raw = self.raw_bytes(alt)
                    if alt in self.special or not raw:  # named as written ("<|im_end|>"), whatever skipping
                        # hides; an id past the tokenizer's vocabulary (a padded embedding row) as vLLM does
                        names[alt] = (self.tokenizer.convert_ids_to_tokens(alt) or f"token_id:{alt}", raw)
                        continue
                    full = self._decode([*ids[prefix_off:i], alt], skip)
                    if len(full) > len(prefix) and not full.endswith("\ufffd"):
                        text = full[len(prefix):]
                        names[alt] = (text, raw if read_off < i else text.encode())
                    else:
                        names[alt] = (self.bytes_name(raw), raw)
                alts.append(names)
            full = self._decode(ids[prefix_off:i + 1], skip)
            piece = Piece(ids[i], "", None)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                piece.text = full[len(prefix):]
                prefix_off, read_off = read_off, i + 1
                group.append(piece)
                # a split character's tokens carry their raw bytes, if all of them are in this answer (a
                # stream sent the earlier ones already, each with its text's bytes: none)
                _share_bytes(group, [self.raw_bytes(p.id) for p in group] if i - len(group) + 1 >= start else None)
                group = []
            else:
                group.append(piece)
            if i >= start:
                out.append(piece)
        return out, alts

    # ------------------------------------------------------------------ OpenAI's shapes
    def completion_logprobs(self, ids: Sequence[int], logprobs: Sequence[dict[int, Logprob] | None],
                            top: int | None = None, *, skip_special_tokens: bool = True, text: str | None = None,
                            start: int = 0, offset: int = 0, as_ids: bool = False) -> dict[str, Any]:
        """/v1/completions' ``logprobs`` for ``ids[start:]`` (``logprobs[j]`` belongs to ``ids[start + j]``;
        None: no logprob, the prompt's first token). ``top``: the ranked entries kept (None: all); ids the
        request named (logprob_token_ids) come unranked and stay. ``offset``: where ``ids[start]``'s text
        starts in the returned text."""
        pieces, names = self._named(ids, logprobs, skip_special_tokens, text, start, as_ids)
        tokens, lps, tops, offsets = [], [], [], []
        pos = offset
        for p, d, alt in zip(pieces, logprobs, names):
            tokens.append(p.text)
            offsets.append(pos)
            pos += len(p.text)
            if d is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(d[p.id].logprob if p.id in d else None)
            entry: dict[str, float] = {p.text: d[p.id].logprob} if p.id in d else {}
            for t, lp in _kept(d, p.id, top):
                if t != p.id:
                    entry.setdefault(alt[t][0], lp.logprob)  # a name taken: the better-ranked keeps it
            tops.append(entry)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]], top: int | None = None,
                      *, skip_special_tokens: bool = True, text: str | None = None, start: int = 0,
                      as_ids: bool = False) -> dict[str, Any]:
        """/v1/chat/completions' ``logprobs`` for ``ids[start:]``: per token its text, logprob, bytes and its
        top alternatives (the chosen token among them only where it ranks)."""
        pieces, names = self._named(ids, logprobs, skip_special_tokens, text, start, as_ids)
        content = []
        for p, d, alt in zip(pieces, logprobs, names):
            tops = []
            for t, lp in _kept(d, p.id, top):
                if t == p.id and lp.rank is None:
                    continue  # the chosen token outside the top: not an alternative
                name, raw = (p.text, _piece_bytes(p)) if t == p.id else alt[t]
                tops.append({"token": name, "logprob": lp.logprob, "bytes": list(raw)})
            content.append({"token": p.text, "logprob": d[p.id].logprob if p.id in d else -9999.0,
                            "bytes": list(_piece_bytes(p)), "top_logprobs": tops})
        return {"content": content}

    def _named(self, ids, logprobs, skip, text, start, as_ids
               ) -> tuple[list[Piece], list[dict[int, tuple[str, bytes]]]]:
        alternatives = [list(d) if d else [] for d in logprobs]
        if as_ids:
            pieces = [Piece(t, f"token_id:{t}", None) for t in ids[start:]]
            return pieces, [{t: (f"token_id:{t}", self.raw_bytes(t)) for t in a} for a in alternatives]
        pieces, names = self._walk(ids, skip, start, alternatives)
        if text is not None:
            _fit(pieces, text)
        return pieces, names


def _kept(d: dict[int, Logprob], chosen: int, top: int | None):
    """The entries of one position's dict to show: ranked ones up to ``top``, the chosen token, unranked ids."""
    for t, lp in d.items():
        if t == chosen or lp.rank is None or top is None or lp.rank <= top:
            yield t, lp


def _share_bytes(group: list[Piece], raws: list[bytes] | None) -> None:
    """The tokens of one split character (or of skipped specials before a token) share the group's text."""
    if len(group) == 1:
        return
    if raws is not None and b"".join(raws) == group[-1].text.encode():
        for p, raw in zip(group, raws):
            p.bytes = raw
    else:  # e.g. a skipped special token inside: the bytes go with the text
        for p in group[:-1]:
            p.bytes = b""


def _piece_bytes(p: Piece) -> bytes:
    return p.text.encode() if p.bytes is None else p.bytes


def _fit(pieces: list[Piece], text: str) -> None:
    """Make the pieces join to ``text``: each keeps what agrees with ``text`` (a stop string cut off), the
    last one takes any rest (a final partial character's U+FFFD; its raw bytes stay, they are that U+FFFD)."""
    pos = 0
    for p in pieces:
        keep = 0
        while keep < len(p.text) and pos + keep < len(text) and p.text[keep] == text[pos + keep]:
            keep += 1
        if keep < len(p.text):
            p.text, p.bytes = p.text[:keep], None
        pos += keep
    if pos < len(text) and pieces:
        pieces[-1].text += text[pos:]
