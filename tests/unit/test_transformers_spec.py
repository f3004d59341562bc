"""The transformers engine's spec, options and model files, without torch or a model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from exlq.worker.engines.base import EngineUnavailable
from exlq.worker.engines.registry import find
from exlq.worker.engines.transformers.load import ModelFiles, find_model_files


def test_finding_the_engine_imports_neither_torch_nor_transformers() -> None:
    # In a fresh interpreter: this session's other tests may have imported them.
    code = (
        "import sys; from exlq.worker.engines.registry import find; find('transformers'); "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_options_come_from_flags_over_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = find("transformers")
    monkeypatch.setenv("EXLQ_TRANSFORMERS_DTYPE", "bfloat16")
    monkeypatch.setenv("EXLQ_TRANSFORMERS_THREADS", "3")
    options = spec.options({"threads": "1"})
    assert options.model_dump() == {
        "device": "auto",
        "dtype": "bfloat16",
        "threads": 1,
        "max_seq_len": 0,
        "prefill_batch_tokens": 4096,
    }
    with pytest.raises(ValueError, match="device"):
        spec.options({"device": "tpu"})
    with pytest.raises(ValueError, match="its options: device, dtype"):
        spec.options({"cache_tokens": "4096"})


def test_a_model_is_a_directory_a_gguf_file_or_a_directory_with_one(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "extra.gguf").write_text("")
    assert find_model_files(hf) == ModelFiles(hf, None)

    one = tmp_path / "one"
    one.mkdir()
    (one / "model.gguf").write_text("")
    assert find_model_files(one) == ModelFiles(one, "model.gguf")
    assert find_model_files(one / "model.gguf").format == "gguf"

    (one / "other.gguf").write_text("")
    with pytest.raises(EngineUnavailable, match=r"several \.gguf files"):
        find_model_files(one)
    with pytest.raises(EngineUnavailable, match=r"no \.gguf file"):
        find_model_files(tmp_path)
    with pytest.raises(EngineUnavailable, match=r"not a \.gguf"):
        find_model_files(hf / "config.json")
