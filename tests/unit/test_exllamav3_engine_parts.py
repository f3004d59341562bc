"""The exllamav3 engine's parts that run without exllamav3 or a GPU: its options, the
requests it refuses before touching exllamav3, and where the engine loop's wait work runs
in exllamav3's step."""

from __future__ import annotations

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
