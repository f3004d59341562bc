"""A worker's TokenChoices in OpenAI's chat and completions logprobs shapes."""

from __future__ import annotations

from exlq.producer.gateways.openai_api.logprobs import (
    UNKNOWN_LOGPROB,
    CompletionLogprobs,
    chat_content,
)
from exlq.protocol.models import TokenChoices, TokenEvent, TokenLogprob


def _choices(*pairs: tuple[str, int, float]) -> TokenChoices:
    return TokenChoices(top=[TokenLogprob(token=t, token_id=i, logprob=lp) for t, i, lp in pairs])


# Two tokens: the first chosen among the top two, the second appended after them (the
# transformers engine appends a chosen token that is not among the top K).
EVENT = TokenEvent(
    id="j",
    seq=0,
    text="Hé!",
    token_ids=[7, 9],
    logprobs=[
        _choices(("Hé", 7, -0.1), ("Ho", 8, -2.5)),
        _choices(("?", 3, -0.5), (".", 4, -1.0), ("!", 9, -3.0)),
    ],
)


def test_chat_content_names_the_chosen_token_and_its_top_alternatives() -> None:
    content = chat_content(EVENT, top_count=2)
    assert content == [
        {
            "token": "Hé",
            "logprob": -0.1,
            "bytes": list("Hé".encode()),
            "top_logprobs": [
                {"token": "Hé", "logprob": -0.1, "bytes": list("Hé".encode())},
                {"token": "Ho", "logprob": -2.5, "bytes": [72, 111]},
            ],
        },
        {
            "token": "!",
            "logprob": -3.0,
            "bytes": [33],
            "top_logprobs": [
                {"token": "?", "logprob": -0.5, "bytes": [63]},
                {"token": ".", "logprob": -1.0, "bytes": [46]},
            ],
        },
    ]
    assert [entry["top_logprobs"] for entry in chat_content(EVENT, top_count=0)] == [[], []]


def test_a_chosen_token_the_engine_did_not_list_is_very_unlikely() -> None:
    event = TokenEvent(id="j", seq=0, text="x", token_ids=[5], logprobs=[_choices(("y", 6, -0.2))])
    [entry] = chat_content(event, top_count=1)
    assert (entry["token"], entry["logprob"]) == ("x", UNKNOWN_LOGPROB)


def test_completion_logprobs_count_offsets_across_events() -> None:
    logprobs = CompletionLogprobs(top_count=1)
    first = logprobs.add(EVENT)
    assert first == {
        "tokens": ["Hé", "!"],
        "token_logprobs": [-0.1, -3.0],
        "top_logprobs": [{"Hé": -0.1}, {"?": -0.5}],
        "text_offset": [0, 2],
    }
    second = logprobs.add(
        TokenEvent(id="j", seq=1, text=" ok", token_ids=[1], logprobs=[_choices((" ok", 1, 0.0))])
    )
    assert second["text_offset"] == [3]
    assert logprobs.body()["tokens"] == ["Hé", "!", " ok"]
    assert logprobs.body()["text_offset"] == [0, 2, 3]
