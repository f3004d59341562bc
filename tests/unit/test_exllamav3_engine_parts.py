"""The exllamav3 engine's parts that run without exllamav3 or a GPU: its options, the
requests it refuses before touching exllamav3, and where the engine loop's wait work runs
in exllamav3's step."""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from exlq.protocol.models import InvalidRequest, Sampling
from exlq.worker.engines.base import UsesDeviceWait
from exlq.worker.engines.exllamav3.device_wait import run_wait_work_after_forward
from exlq.worker.engines.exllamav3.sampling import sampler_for
from exlq.worker.engines.exllamav3.settings import ExLlamaV3Settings


def test_cache_and_chunk_sizes_are_whole_pages() -> None:
    assert ExLlamaV3Settings().cache_tokens == 65_536
    assert ExLlamaV3Settings(cache_tokens=4096, max_chunk_size=512).max_chunk_size == 512
    with pytest.raises(ValidationError, match="multiple of 256"):
        ExLlamaV3Settings(cache_tokens=1000)
    with pytest.raises(ValidationError, match="multiple of 256"):
        ExLlamaV3Settings(max_chunk_size=300)


def test_typical_sampling_is_refused_with_what_to_do() -> None:
    with pytest.raises(InvalidRequest, match=r"sampling\.typical.*leave it at 1\.0"):
        sampler_for(Sampling(temperature=0.7, typical=0.9))


class _Model:
    """Stands for exllamav3's Model: a decode pass through forward, prompts through prefill."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def forward(self, input_ids: Any, params: Any = None) -> str:
        self.log.append(f"forward {input_ids}")
        return "logits"

    def prefill(self, input_ids: Any, params: Any = None) -> None:
        self.log.append(f"prefill {input_ids}")


class _Engine(UsesDeviceWait):
    pass


def test_the_wait_work_runs_once_after_each_decode_pass_is_queued_and_not_in_prefill() -> None:
    log: list[str] = []
    model = _Model(log)
    engine = _Engine()
    run_wait_work_after_forward(model, engine)

    assert model.forward(1) == "logits"  # no loop yet: the pass alone
    engine.set_wait_work(lambda: log.append("wait work"))
    model.prefill(2)
    assert model.forward(input_ids=3, params={}) == "logits"
    engine.set_wait_work(None)
    model.forward(4)
    assert log == ["forward 1", "prefill 2", "forward 3", "wait work", "forward 4"]


torch = pytest.importorskip("torch")

PIECES = [f"t{n}" for n in range(10)]


def _ids(*ids: int) -> Any:
    return torch.tensor([list(ids)])


def test_a_stop_token_ends_the_job_with_the_text_exllamav3_held_and_without_the_token() -> None:
    from exlq.worker.engines.base import JobEnded, TokenChunk
    from exlq.worker.engines.exllamav3.results import outputs_of

    result = {
        "eos": True,
        "eos_reason": "stop_token",
        "held": {"text": " wor", "token_ids": _ids(4, 5, 2)},  # 2: the end-of-text token
        "prompt_tokens": 6,
        "new_tokens": 5,
        "cached_tokens": 0,
    }
    assert outputs_of("j", result, lambda: PIECES, 9) == [
        TokenChunk("j", " wor", [4, 5]),
        JobEnded("j", "stop", 6, 5, 0),
    ]
    streaming = {"eos": False, "text": "Hello", "token_ids": _ids(7, 8)}
    assert outputs_of("j", streaming, lambda: PIECES, 9) == [TokenChunk("j", "Hello", [7, 8])]
    # A stop string's text stays held: it is not the completion's.
    stopped = {**result, "eos_reason": "stop_string", "text": "a", "token_ids": _ids(3)}
    assert outputs_of("j", stopped, lambda: PIECES, 9)[0] == TokenChunk("j", "a", [3])


def test_logprobs_are_logs_of_exllamav3s_probabilities_with_the_chosen_token_listed() -> None:
    from exlq.worker.engines.exllamav3.results import MIN_LOGPROB, token_choices

    result = {
        "token_ids": _ids(3, 1),
        "top_k_tokens": torch.tensor([[[3, 4], [2, 4]]]),
        "top_k_probs": torch.tensor([[[0.5, 0.25], [0.6, 0.0]]]),
        "token_probs": torch.tensor([[0.5, 0.125]]),
    }
    first, second = token_choices(result, 2, lambda: PIECES)
    assert [(t.token, t.token_id) for t in first.top] == [("t3", 3), ("t4", 4)]
    assert first.top[0].logprob == pytest.approx(math.log(0.5))
    # Token 1 was chosen though not among the two likeliest: it comes last.
    assert [t.token_id for t in second.top] == [2, 4, 1]
    assert second.top[1].logprob == pytest.approx(MIN_LOGPROB)  # a probability of 0: no -inf
    assert second.top[2].logprob == pytest.approx(math.log(0.125))
    assert token_choices(result, 1, lambda: PIECES) == [first]
    assert token_choices({"token_ids": _ids(3)}, 1, lambda: PIECES) == []
