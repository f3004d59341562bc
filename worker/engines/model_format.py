"""A model's format, read from what is on disk, and the engine that serves it by default.

``--engine auto`` (the default) picks the engine from the model: a ``.gguf`` file is
served by transformers; a directory by its ``config.json``: its ``quantization_config``'s
``quant_method`` says EXL2 or EXL3 (each converter writes it), and a directory without one
holds Hugging Face weights (fp16, bf16), which exllamav2 serves faster than the others
(docs/PERFORMANCE.md). Reading the format costs one small JSON file; no library is imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from exlq.worker.engines.registry import available

ModelFormat = Literal["exl2", "exl3", "hf", "gguf"]
AUTO = "auto"

# The engine each format gets from --engine auto.
DEFAULT_ENGINE: dict[ModelFormat, str] = {
    "exl2": "exllamav2",
    "exl3": "exllamav3",
    "hf": "exllamav2",
    "gguf": "transformers",
}
_QUANT_METHODS: dict[str, ModelFormat] = {"exl2": "exl2", "exl3": "exl3"}


def model_format(model: Path) -> ModelFormat:
    """The format of the model at ``model``; ValueError says why none can be told."""
    if model.is_file():
        if model.suffix.lower() == ".gguf":
            return "gguf"
        raise ValueError(
            f"model {str(model)!r} is a file but not a .gguf: give a model directory "
            "(EXL2, EXL3 or Hugging Face weights) or a .gguf file"
        )
    config = model / "config.json"
    if not config.is_file():
        raise ValueError(
            f"model directory {str(model)!r} has no config.json: give the directory of an "
            "EXL2, EXL3 or Hugging Face model, or choose the engine with --engine"
        )
    try:
        settings = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config} cannot be read as JSON ({exc})") from None
    quantization = settings.get("quantization_config") if isinstance(settings, dict) else None
    if not isinstance(quantization, dict):
        return "hf"
    method = str(quantization.get("quant_method", "")).lower()
    if method in _QUANT_METHODS:
        return _QUANT_METHODS[method]
    raise ValueError(
        f"model {str(model)!r} is quantized with {method or 'an unnamed method'!r}, which no "
        "exlq engine serves: use an EXL2 or EXL3 conversion, Hugging Face fp16/bf16 weights, "
        "or a .gguf file"
    )


def engine_for(model: Path | None) -> str:
    """The engine --engine auto gives ``model``; ValueError where there is none to read."""
    if model is None:
        raise ValueError(
            "--engine auto picks the engine from the model: give --model PATH (or "
            "EXLQ_MODEL), or choose an engine (--engine echo needs no model)"
        )
    if not model.exists():
        raise ValueError(f"model {str(model)!r} does not exist")
    found = model_format(model)
    engine = DEFAULT_ENGINE[found]
    if engine not in available():
        raise ValueError(
            f"model {str(model)!r} holds {found.upper()} weights, which the {engine} engine "
            f"serves; this install has no {engine} engine (`exlq engines` lists those it has)"
        )
    return engine
