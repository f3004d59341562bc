"""The transformers engine: any Hugging Face causal LM (a model directory, or a GGUF file
that transformers dequantizes), its running jobs decoded together as one left-padded batch.
Only this folder imports torch and transformers, and only when the engine is loaded."""

from __future__ import annotations

from exlq.worker.engines.base import Engine
from exlq.worker.engines.registry import EngineSpec, LoadRequest
from exlq.worker.engines.transformers.settings import TransformersSettings


def _load(request: LoadRequest) -> Engine:
    from exlq.worker.engines.transformers.engine import load_transformers_engine

    return load_transformers_engine(request)


ENGINE = EngineSpec(
    name="transformers",
    summary="Hugging Face transformers on the CPU or a CUDA GPU: causal-LM model directories "
    "and GGUF files",
    settings=TransformersSettings,
    load=_load,
)
