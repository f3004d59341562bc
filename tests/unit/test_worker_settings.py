"""Worker settings: flags over EXLQ_* variables, grouped by concern, an engine's options its
own, and combinations in which a setting would do nothing refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from exlq.cli import app
from exlq.worker.cli import load_settings
from exlq.worker.engines.exllamav2.settings import ExLlamaV2Settings


def _model_dir(tmp_path: Path) -> Path:
    """A Hugging Face model directory, as far as the settings look: --engine auto gives it
    exllamav2."""
    model = tmp_path / "Llama-3-8B"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    return model


def test_flags_win_over_variables_and_land_in_their_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EXLQ_REDIS_URL", "redis://from-env:6379/0")
    monkeypatch.setenv("EXLQ_MAX_BATCH_SIZE", "16")
    settings = load_settings(engine="echo", max_batch_size=4, claim_idle_ms=5000)
    assert settings.broker.redis_url == "redis://from-env:6379/0"
    assert settings.serving.max_batch_size == 4
    assert settings.broker.claim_idle_ms == 5000
    assert settings.queue_name == "default"


def test_the_exllamav2_levers_are_on_by_default_and_options_turn_them_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model_dir(tmp_path)
    options = load_settings(model=model).engine_options
    assert isinstance(options, ExLlamaV2Settings)
    assert options.cuda_graphs and options.gpu_sampling and options.gpu_embedding
    assert (options.prefill_batch_tokens, options.admit_prompt_tokens) == (4096, 8192)
    monkeypatch.setenv("EXLQ_EXLLAMAV2_GPU_SAMPLING", "false")
    options = load_settings(["cuda_graphs=false", "admit-prompt-tokens=0"], model=model)
    assert isinstance(options.engine_options, ExLlamaV2Settings)
    off = options.engine_options
    assert not off.cuda_graphs and not off.gpu_sampling and off.admit_prompt_tokens == 0
    assert load_settings(model=model).queue_name == "Llama-3-8B"


@pytest.mark.parametrize(
    ("args", "flags", "expected"),
    [
        (["-o", "gpu_sampling=sometimes"], {}, "gpu_sampling"),  # a bad value names its option
        (["-o", "cache_tokens=1000000", "-o", "warp=9"], {}, "warp"),  # an unknown one too
        (["-o", "tokens_per_second"], {"engine": "echo"}, "NAME=VALUE"),
        ([], {"engine": "warp-drive"}, "unknown engine 'warp-drive'"),
        ([], {"engine": "exllamav2"}, "needs --model"),
        ([], {"max_batch_size": 0}, "max_batch_size"),
    ],
)
def test_a_bad_setting_exits_naming_what_to_fix(
    args: list[str],
    flags: dict[str, object],
    expected: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    given = {"model": _model_dir(tmp_path)} if not flags else {}
    with pytest.raises(typer.Exit) as exc:
        load_settings(args[1::2] if args and args[0] == "-o" else args, **given, **flags)
    assert exc.value.exit_code == 2
    assert expected in capsys.readouterr().err


def test_echo_refuses_a_model_it_would_ignore(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(typer.Exit):
        load_settings(engine="echo", model=_model_dir(tmp_path))
    assert "takes no model" in capsys.readouterr().err


def test_engines_lists_each_engine_with_its_options() -> None:
    result = CliRunner().invoke(app, ["engines"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "echo:" in result.output and "exllamav2:" in result.output
    assert "-o cache_tokens=65536" in result.output
    assert "$EXLQ_EXLLAMAV2_CACHE_TOKENS" in result.output


def test_worker_and_up_take_engine_options_and_no_path_switches() -> None:
    for command in ("worker", "up"):
        result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0
        assert "--option" in result.output, command
        for gone in ("--overlap-reports", "--admit-in-wait", "--offer-before-start"):
            assert gone not in result.output, command
