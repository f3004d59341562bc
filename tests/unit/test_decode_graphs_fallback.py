"""A model whose decode step cannot be captured is served without graphs, not refused."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import pytest

from exlq.worker.engines.exllamav2 import graphs as exllamav2_graphs


class _Generator:
    page_size = 256
    paged = True
    max_seq_len = 8192
    model = object()
    cache = object()

    def __init__(self) -> None:
        self.resets = 0

    def reset_page_table(self) -> None:
        self.resets += 1


class _Graphs:
    installed = False
    fail = True
    padded: ClassVar[dict[int, int]] = {}
    made: ClassVar[list[tuple[Any, int]]] = []  # (model, q_len) of each one made

    def __init__(
        self,
        model: Any,
        cache: Any,
        max_batch: int,
        max_pages: int,
        page_size: int,
        q_len: int = 1,
    ) -> None:
        assert (max_batch, max_pages, page_size) == (4, 32, 256)
        self.max_pages = max_pages
        self.q_len = q_len
        _Graphs.made.append((model, q_len))

    def capture(self) -> float:
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        return 0.5

    def install(self) -> None:
        _Graphs.installed = True


@pytest.fixture
def fake_graphs(monkeypatch: pytest.MonkeyPatch) -> type[_Graphs]:
    monkeypatch.setattr(exllamav2_graphs, "graphs_unsupported_reason", lambda m, c: None)
    monkeypatch.setattr(exllamav2_graphs, "DecodeGraphs", _Graphs)
    _Graphs.installed = False
    _Graphs.made = []
    return _Graphs


def test_failed_capture_logs_why_and_leaves_the_forward_pass_alone(
    fake_graphs: type[_Graphs], caplog: pytest.LogCaptureFixture
) -> None:
    generator = _Generator()
    with caplog.at_level(logging.WARNING):
        assert exllamav2_graphs.install_decode_graphs(generator, 4) is None
    assert not fake_graphs.installed
    assert "capture failed (RuntimeError: operation not permitted" in caplog.text
    assert generator.resets == 1  # warm-up passes may have written into page 0


def test_captured_graphs_are_installed_and_pages_forgotten(fake_graphs: type[_Graphs]) -> None:
    fake_graphs.fail = False
    try:
        generator = _Generator()
        assert isinstance(exllamav2_graphs.install_decode_graphs(generator, 4), _Graphs)
        assert fake_graphs.installed and generator.resets == 1
    finally:
        fake_graphs.fail = True


def test_a_drafting_generator_gets_verify_graphs_and_its_draft_models(
    fake_graphs: type[_Graphs], caplog: pytest.LogCaptureFixture
) -> None:
    generator = _Generator()
    generator.num_draft_tokens = 4  # type: ignore[attr-defined]
    generator.draft_model = draft = object()  # type: ignore[attr-defined]
    generator.draft_cache = object()  # type: ignore[attr-defined]
    fake_graphs.fail = False
    try:
        with caplog.at_level(logging.INFO):
            assert exllamav2_graphs.install_decode_graphs(generator, 4) is not None
    finally:
        fake_graphs.fail = True
    # The model verifies its last token and the 4 drafted ones; the draft steps one at a time.
    assert fake_graphs.made == [(_Generator.model, 5), (draft, 1)]
    assert "5 tokens a job captured" in caplog.text and "decode captured" in caplog.text


def test_the_log_names_the_batches_that_replay_padded(
    fake_graphs: type[_Graphs], caplog: pytest.LogCaptureFixture
) -> None:
    fake_graphs.fail = False
    fake_graphs.padded = {size: 33 for size in range(22, 33)}
    try:
        with caplog.at_level(logging.INFO):
            assert exllamav2_graphs.install_decode_graphs(_Generator(), 4) is not None
        assert "batches of 22..32 jobs replay padded to 33 rows" in caplog.text
    finally:
        fake_graphs.fail = True
        fake_graphs.padded = {}


def test_another_exllamav2_version_gets_no_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exllamav2_graphs, "installed_exllamav2", lambda: "0.3.3")
    reason = exllamav2_graphs.graphs_unsupported_reason(object(), object())
    assert reason == "exllamav2 0.3.3 is installed; the graphs are written for 0.3.2"


def test_unsupported_models_say_why(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    monkeypatch.setattr(
        exllamav2_graphs, "graphs_unsupported_reason", lambda m, c: "the weights are quantized"
    )
    with caplog.at_level(logging.INFO):
        assert exllamav2_graphs.install_decode_graphs(_Generator(), 4) is None
    assert "CUDA graphs off: the weights are quantized" in caplog.text
