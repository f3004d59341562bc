"""The exllamav2 engine: exllamav2's dynamic generator with exlq's paged attention, decode
graphs, batched prefill and GPU sampling. Only this folder imports exllamav2, and only
when the engine is loaded."""

from __future__ import annotations

from exlq.worker.engines.base import Engine
from exlq.worker.engines.exllamav2.settings import ExLlamaV2Settings
from exlq.worker.engines.registry import EngineSpec, LoadRequest


def _load(request: LoadRequest) -> Engine:
    from exlq.worker.engines.exllamav2.engine import load_exllamav2_engine

    return load_exllamav2_engine(request)


ENGINE = EngineSpec(
    name="exllamav2",
    summary="exllamav2 0.3 on a CUDA GPU: EXL2 and Hugging Face fp16/bf16 Llama-family "
    "model directories",
    settings=ExLlamaV2Settings,
    load=_load,
)
