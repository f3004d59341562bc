"""TextStream: a job's new tokens in, the text it may send out: never half a character, never
text that may be the start of a stop string, and nothing from a stop string on."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from exlq.worker.engines.stop_strings import first_stop, held_back

# Decoded text ends in U+FFFD while a character's bytes are split over tokens: byte-level
# BPE tokenizers give each byte of a rare character its own token.
_INCOMPLETE = "\ufffd"
# Prompt tokens a job's first window of text is decoded after: a tokenizer may decode a
# window's first token differently (SentencePiece drops its leading space), so every window
# starts with tokens whose text has already been counted, and only what follows is new.
CONTEXT_TOKENS = 5


class IncrementalDecoder:
    """Token ids in, text out, decoding a short window of recent tokens at a time (whole-text
    decoding would cost a job time that grows with its length at every token)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], context: Sequence[int]) -> None:
        self._decode = decode
        self._ids = list(context[-CONTEXT_TOKENS:])
        self._prefix = 0  # the window's start: its text up to _read was already given out
        self._read = len(self._ids)

    def push(self, token_id: int) -> str:
        """The new text ``token_id`` completes: empty while a character is incomplete."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the job's end: what is left, an incomplete character's replacement included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        window = self._ids[self._prefix :]
        before = self._decode(window[: self._read - self._prefix])
        after = self._decode(window)
        if not final and after.endswith(_INCOMPLETE):
            return ""  # wait for the tokens that finish the character
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]


class StopStrings:
    """Text in, the part that may go out now; ``stopped`` once a stop string has appeared
    (the text before it goes out, the stop string and anything after it never)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [stop for stop in stops if stop]
        self._pending = ""  # text not yet given out: it may begin a stop string
        self.stopped = False

    def add(self, text: str) -> str:
        if self.stopped:
            return ""
        # Given-out text never holds the start of a stop string (it was held back while it
        # could have), so a stop string can only begin inside the pending text.
        pending = self._pending + text
        found = first_stop(self._stops, pending)
        if found is not None:
            self.stopped = True
            self._pending = ""
            return pending[:found]
        keep = held_back(self._stops, pending)
        self._pending = pending[len(pending) - keep :]
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        """At the job's end: the text held back, which turned out not to begin a stop."""
        pending, self._pending = self._pending, ""
        return "" if self.stopped else pending


class TextStream:
    """The text of one job's completion, as it may be sent."""

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        stops: Sequence[str],
        context: Sequence[int],
    ) -> None:
        self._decoder = IncrementalDecoder(decode, context)
        self._stops = StopStrings(stops)

    @property
    def stopped(self) -> bool:
        """A stop string has appeared: the job ends; what push() returned was its last text."""
        return self._stops.stopped

    def push(self, token_id: int) -> str:
        return self._stops.add(self._decoder.push(token_id))

    def finish(self) -> str:
        """The rest of the text, at a job's end for any reason but a stop string."""
        text = self._stops.add(self._decoder.flush())
        return text + self._stops.flush()
