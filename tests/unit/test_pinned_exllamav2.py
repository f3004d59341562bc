"""exlq's hooks into exllamav2 run only on the version they are written for; on another,
the log says what stays as exllamav2 does it."""

from __future__ import annotations

import logging

import pytest

from exlq.worker.engines.exllamav2 import attention as exllamav2_attention
from exlq.worker.engines.exllamav2.attention import PINNED_EXLLAMAV2, on_pinned_exllamav2


def test_the_pinned_version_is_on_without_a_word(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(exllamav2_attention, "installed_exllamav2", lambda: PINNED_EXLLAMAV2)
    with caplog.at_level(logging.WARNING):
        assert on_pinned_exllamav2("job buffers as exllamav2 makes them")
    assert caplog.text == ""


def test_another_version_is_off_and_the_log_says_what_and_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(exllamav2_attention, "installed_exllamav2", lambda: "0.3.3")
    with caplog.at_level(logging.WARNING):
        assert not on_pinned_exllamav2("job buffers as exllamav2 makes them")
    assert (
        "job buffers as exllamav2 makes them: exllamav2 0.3.3 is installed; exlq's hook is "
        f"written for {PINNED_EXLLAMAV2}" in caplog.text
    )
