"""A request's generated text, released piece by piece as its tokens arrive.

The text of the tokens so far cannot always be sent as it is:
- a character of several bytes may be split between tokens: decoding the first part alone ends in
  U+FFFD, which must wait for the rest of the character;
- its end may be the start of a stop string, which is never sent: it waits until the stop string
  either completes (and the text ends before it) or cannot any more.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence gives


class IncrementalDecoder:
    """The decoded text of a growing list of tokens, extended by whole characters only.

    Each new token decodes a short window, not the whole list: the tokens not yet in the text plus one
    before them, and the text grows by what the new tokens add to that one's text. The token before
    gives the new ones their context, which decoding needs for some tokenizers (SentencePiece drops
    the leading space of the first token it decodes). Special tokens (end of sequence) decode to nothing.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._start = 0  # where the window starts
        self._read = 0  # the tokens before this one are in `text`

    def push(self, token: int) -> str:
        """Add one token; returns the text it completes (often all of its own, possibly nothing)."""
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text of the tokens held back, once no more will come (an incomplete character as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        known = self._decode(self.ids[self._start:self._read])
        window = self._decode(self.ids[self._start:])
        if not final and (len(window) <= len(known) or window.endswith(REPLACEMENT)):
            return ""
        new = window[len(known):]
        self._start, self._read = self._read, len(self.ids)
        self.text += new
        return new

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


class TextStream:
    """A request's text, cut before its first stop string, released once it is sure to be sent."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop = tuple(stop)
        self.sent = 0  # characters of the decoded text released so far
        self.stopped = False  # a stop string matched: the text ends where it began

    @property
    def tokens(self) -> int:
        return len(self.decoder.ids)

    def push(self, token: int) -> str:
        """Add one token; returns the text that can be sent now (may be empty)."""
        if self.stopped:
            return ""
        self.decoder.push(token)
        return self._release(final=False)

    def finish(self) -> str:
        """Everything held back, once no more tokens will come (less any stop string it completes)."""
        if self.stopped:
            return ""
        self.decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self.decoder.text
        # No stop string starts before `sent`: text that could begin one is held back until it cannot.
        matches = [at for at in (text.find(s, self.sent) for s in self.stop) if at != -1]
        if matches:
            end = min(matches)
            self.stopped = True
        else:
            end = len(text) if final else self._hold_from(text)
        piece = text[self.sent:end]
        self.sent = end
        return piece

    def _hold_from(self, text: str) -> int:
        """Where the longest end of `text` that is the start of a stop string begins (len(text) if none)."""
        start = len(text)
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text) - self.sent), 0, -1):
                if text.endswith(s[:n]):
                    start = min(start, len(text) - n)
                    break
        return start
