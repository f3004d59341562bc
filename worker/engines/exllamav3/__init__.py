"""The exllamav3 engine: exllamav3's continuous-batching generator, driven by exlq's engine
loop. Only this folder imports exllamav3, and only when the engine is loaded."""

from __future__ import annotations

from exlq.worker.engines.base import Engine
from exlq.worker.engines.exllamav3.settings import ExLlamaV3Settings
from exlq.worker.engines.registry import EngineSpec, LoadRequest


def _load(request: LoadRequest) -> Engine:
    from exlq.worker.engines.exllamav3.engine import load_exllamav3_engine

    return load_exllamav3_engine(request)


ENGINE = EngineSpec(
    name="exllamav3",
    summary="exllamav3 1.6 on a CUDA GPU: EXL3 and Hugging Face fp16/bf16 model directories",
    settings=ExLlamaV3Settings,
    load=_load,
)
