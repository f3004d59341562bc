"""exlq_worker_info says how the engine runs, as loading turned out, not as asked."""

from __future__ import annotations

from prometheus_client import generate_latest

from exlq.worker.engine_loop import EngineLoop
from exlq.worker.engines.base import EngineSetup
from exlq.worker.engines.echo.engine import EchoEngine
from exlq.worker.metrics import Metrics


def test_worker_info_carries_the_engine_setup() -> None:
    metrics = Metrics("q")
    metrics.info("1.0", "exllamav2", "llama", EngineSetup("exlq", True, False, 4096, 8192, True))
    lines = [
        line
        for line in generate_latest(metrics.registry).decode().splitlines()
        if line.startswith("exlq_worker_info{")
    ]
    assert len(lines) == 1
    for label in (
        'attention="exlq"',
        'decode_graphs="on"',
        'gpu_sampling="off"',
        'prefill_batch_tokens="4096"',
        'admit_prompt_tokens="8192"',
        'gpu_embedding="on"',
        'engine="exllamav2"',
    ):
        assert label in lines[0]


class _GraphsFellBack(EchoEngine):
    """An engine whose graphs were asked for and could not be captured."""

    attention = "exlq"
    decode_graphs = False
    gpu_sampling = True
    prefill_batch_tokens = 2048
    admit_prompt_tokens = 1024


def test_the_runner_reports_what_the_engine_ended_up_with() -> None:
    runner = EngineLoop(_GraphsFellBack(capacity=2, tokens_per_second=100))
    assert runner.setup == EngineSetup("exlq", False, True, 2048, 1024)
    assert EngineLoop(EchoEngine(2, 100)).setup == EngineSetup()
