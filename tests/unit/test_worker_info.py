"""exlq_worker_info says the version, the engine and how it runs, as loading turned out."""

from __future__ import annotations

from prometheus_client import generate_latest

from exlq import __version__
from exlq.worker.engine_loop import EngineLoop
from exlq.worker.engines.echo.engine import EchoEngine
from exlq.worker.metrics import Metrics


def _info_line(metrics: Metrics) -> str:
    lines = [
        line
        for line in generate_latest(metrics.registry).decode().splitlines()
        if line.startswith("exlq_worker_info{")
    ]
    assert len(lines) == 1
    return lines[0]


def test_worker_info_carries_the_version_engine_model_and_the_engines_own_labels() -> None:
    metrics = Metrics("q", "llama")
    metrics.info(__version__, "exllamav2", {"attention": "exlq", "decode_graphs": "off"})
    line = _info_line(metrics)
    for label in (
        'queue="q"',
        f'version="{__version__}"',
        'engine="exllamav2"',
        'model="llama"',
        'attention="exlq"',
        'decode_graphs="off"',
    ):
        assert label in line


class _GraphsFellBack(EchoEngine):
    """An engine whose graphs were asked for and could not be captured."""

    def info(self) -> dict[str, str]:
        return {"decode_graphs": "off"}


def test_the_runner_reports_what_the_engine_ended_up_with() -> None:
    assert EngineLoop(_GraphsFellBack(capacity=2, tokens_per_second=100)).info == {
        "decode_graphs": "off"
    }
    assert EngineLoop(EchoEngine(2, 100)).info == {}


def test_the_version_is_the_packages_own_from_a_checkout_too() -> None:
    from importlib.metadata import version

    assert __version__ == version("exlq")
