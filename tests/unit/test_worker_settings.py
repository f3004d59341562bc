"""The decode levers are on by default and each can be turned off by flag or variable."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from exlq.cli import app
from exlq.worker.cli import load_settings


def test_cuda_graphs_gpu_sampling_gpu_embedding_and_the_wait_work_default_on() -> None:
    settings = load_settings(engine="echo")
    assert settings.cuda_graphs and settings.gpu_sampling and settings.gpu_embedding
    assert settings.overlap_reports and settings.admit_in_wait
    assert settings.offer_before_start


def test_variables_turn_them_off_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXLQ_CUDA_GRAPHS", "false")
    monkeypatch.setenv("EXLQ_GPU_SAMPLING", "0")
    monkeypatch.setenv("EXLQ_GPU_EMBEDDING", "no")
    monkeypatch.setenv("EXLQ_OVERLAP_REPORTS", "false")
    monkeypatch.setenv("EXLQ_ADMIT_IN_WAIT", "false")
    monkeypatch.setenv("EXLQ_OFFER_BEFORE_START", "false")
    settings = load_settings(engine="echo")
    assert not settings.cuda_graphs and not settings.gpu_sampling and not settings.gpu_embedding
    assert not settings.overlap_reports and not settings.admit_in_wait
    assert not settings.offer_before_start
    assert load_settings(engine="echo", offer_before_start=True).offer_before_start
    assert load_settings(engine="echo", overlap_reports=True).overlap_reports
    assert load_settings(engine="echo", admit_in_wait=True).admit_in_wait
    assert load_settings(engine="echo", cuda_graphs=True).cuda_graphs
    assert load_settings(engine="echo", gpu_embedding=True).gpu_embedding


def test_a_bad_value_names_the_setting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("EXLQ_GPU_SAMPLING", "sometimes")
    with pytest.raises(typer.Exit) as exc:
        load_settings(engine="echo")
    assert exc.value.exit_code == 2
    assert "gpu_sampling" in capsys.readouterr().err


def test_worker_and_up_offer_the_flags() -> None:
    for command in ("worker", "up"):
        result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0
        assert "--no-cuda-graphs" in result.output, command
        assert "--no-gpu-embedding" in result.output, command
        assert "--no-gpu-sampling" in result.output, command
        assert "--no-overlap-reports" in result.output, command
        assert "--no-admit-in-wait" in result.output, command
        assert "--no-offer-before-start" in result.output, command
    worker_help = CliRunner().invoke(app, ["worker", "--help"], env={"COLUMNS": "200"}).output
    assert "--prefill-batch-tokens" in worker_help
    assert "--admit-prompt-tokens" in worker_help


@pytest.mark.parametrize(
    ("field", "default", "flag_value"),
    [
        ("prefill_batch_tokens", 4096, 8192),  # batched prefill, a pass of this many tokens
        ("admit_prompt_tokens", 8192, 4096),  # the admission budget: two such passes a step
    ],
)
def test_the_token_budgets_are_on_by_default_zero_turns_them_off_and_flags_win(
    monkeypatch: pytest.MonkeyPatch, field: str, default: int, flag_value: int
) -> None:
    assert getattr(load_settings(engine="echo"), field) == default
    monkeypatch.setenv(f"EXLQ_{field.upper()}", "0")
    assert getattr(load_settings(engine="echo"), field) == 0
    assert getattr(load_settings(engine="echo", **{field: flag_value}), field) == flag_value
    with pytest.raises(typer.Exit):
        load_settings(engine="echo", **{field: -1})
