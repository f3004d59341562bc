"""The transformers engine's text stream: whole characters only, stop strings held back and
cut, over a byte-level tokenizer (each token one byte, as byte-level BPE's rare characters)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from exlq.worker.engines.transformers.text_stream import IncrementalDecoder, TextStream


def decode_bytes(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def run(text: str, stops: Sequence[str] = (), context: str = "") -> tuple[list[str], bool]:
    """Push ``text`` byte by byte: the pieces given out (finish()'s last, unless a stop
    string ended it) and whether one did."""
    stream = TextStream(decode_bytes, stops, list(context.encode()))
    pieces = []
    for byte in text.encode():
        pieces.append(stream.push(byte))
        if stream.stopped:
            return pieces, True
    pieces.append(stream.finish())
    return pieces, False


def test_a_character_split_over_tokens_goes_out_whole() -> None:
    pieces, _ = run("a€b")  # € is three bytes
    assert pieces == ["a", "", "", "€", "b", ""]


def test_the_first_tokens_decode_after_the_prompt_context() -> None:
    pieces, _ = run(" ok", context="prompt")
    assert "".join(pieces) == " ok"


def test_an_unfinished_character_at_the_end_comes_out_as_a_replacement() -> None:
    decoder = IncrementalDecoder(decode_bytes, [])
    assert decoder.push("€".encode()[0]) == ""
    assert decoder.flush() == "\ufffd"


def test_text_that_may_begin_a_stop_string_is_held_until_it_cannot() -> None:
    pieces, stopped = run("abcabd", stops=["abd!"])
    assert not stopped
    assert pieces == ["", "", "abc", "", "", "", "abd"]


def test_a_stop_string_ends_the_text_before_it() -> None:
    pieces, stopped = run("say STOP now", stops=["STOP"])
    assert stopped
    assert "".join(pieces) == "say "


def test_the_earliest_of_several_stop_strings_wins() -> None:
    pieces, stopped = run("one two three", stops=["three", "two"])
    assert stopped and "".join(pieces) == "one "


def test_a_stop_string_completed_by_the_last_token_still_stops() -> None:
    stream = TextStream(decode_bytes, ["é"], [])
    assert stream.push("é".encode()[0]) == ""
    assert stream.push("é".encode()[1]) == ""
    assert stream.stopped


def up_to_first_stop(text: str, stops: Sequence[str]) -> str:
    """The text a generator stopping at the first stop string to appear gives out: cut at
    the earliest start among the stop strings in the shortest prefix that holds one."""
    for end in range(1, len(text) + 1):
        found = [at for at in (text[:end].find(stop) for stop in stops) if at >= 0]
        if found:
            return text[: min(found)]
    return text


@given(
    st.text(alphabet="ab€ \n", max_size=30),
    st.lists(st.text(alphabet="ab€", min_size=1, max_size=4), max_size=3),
)
def test_the_pieces_are_the_text_up_to_its_first_stop_string(text: str, stops: list[str]) -> None:
    pieces, stopped = run(text, stops)
    assert "".join(pieces) == up_to_first_stop(text, stops)
    assert stopped == any(stop in text for stop in stops)
    for piece in pieces:
        assert "\ufffd" not in piece
