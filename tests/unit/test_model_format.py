"""--engine auto: a model's format read from disk, and the engine each format gets."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from exlq.worker.cli import load_settings
from exlq.worker.engines.model_format import engine_for, model_format


def _directory(tmp_path: Path, config: object) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize(
    ("quantization", "expected"),
    [
        (None, "hf"),
        ({"quant_method": "exl2", "version": "0.3.2", "bits": 4.0}, "exl2"),
        ({"quant_method": "exl3", "version": "1.6.5", "bits": 4.0}, "exl3"),
        ({"quant_method": "EXL2"}, "exl2"),
    ],
)
def test_a_directory_says_its_format_in_its_config(
    tmp_path: Path, quantization: object, expected: str
) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "torch_dtype": "float16"}
    if quantization is not None:
        config["quantization_config"] = quantization
    assert model_format(_directory(tmp_path, config)) == expected


def test_a_gguf_file_is_gguf_and_any_other_file_is_refused(tmp_path: Path) -> None:
    gguf = tmp_path / "SmolLM2.Q4_1.GGUF"
    gguf.write_bytes(b"GGUF")
    assert model_format(gguf) == "gguf"
    other = tmp_path / "model.safetensors"
    other.write_bytes(b"")
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        model_format(other)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quantization_config": {"quant_method": "gptq"}}, "'gptq', which no exlq engine"),
        ("[not json", "cannot be read as JSON"),
    ],
)
def test_a_format_no_engine_serves_is_named(tmp_path: Path, config: object, message: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    text = config if isinstance(config, str) else json.dumps(config)
    (model / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        model_format(model)


def test_auto_picks_exllamav2_for_exl2_and_hugging_face_and_transformers_for_gguf(
    tmp_path: Path,
) -> None:
    exl2 = _directory(tmp_path, {"quantization_config": {"quant_method": "exl2"}})
    assert engine_for(exl2) == "exllamav2"
    (exl2 / "config.json").write_text("{}")
    assert engine_for(exl2) == "exllamav2"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert engine_for(gguf) == "transformers"
    assert load_settings(model=gguf).serving.engine == "transformers"
    assert load_settings(model=exl2).serving.engine == "exllamav2"
    assert load_settings(model=exl2, engine="transformers").serving.engine == "transformers"


def test_auto_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="give --model PATH"):
        engine_for(None)
    with pytest.raises(ValueError, match="does not exist"):
        engine_for(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"no config\.json"):
        engine_for(tmp_path)


def test_auto_picks_exllamav3_for_exl3_and_loading_it_without_exllamav3_says_what_to_install(
    tmp_path: Path,
) -> None:
    exl3 = _directory(tmp_path, {"quantization_config": {"quant_method": "exl3"}})
    assert engine_for(exl3) == "exllamav3"
    settings = load_settings(model=exl3)
    assert settings.serving.engine == "exllamav3"
    if importlib.util.find_spec("exllamav3") is not None:
        pytest.skip("exllamav3 is installed here")
    from exlq.worker.engines import EngineUnavailable, build_engine

    with pytest.raises(EngineUnavailable, match=r"pip install 'exlq\[exllamav3\]'"):
        build_engine("exllamav3", settings.load_request())
