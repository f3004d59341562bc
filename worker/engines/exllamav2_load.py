"""load_generator: the one way exlq loads a model for exllamav2's dynamic generator, and
warm_up: the one way it readies that generator before the first job.

config -> model scratch sized for the batch -> model -> paged cache -> load_autosplit ->
the embedding table to the GPU (asked for) -> tokenizer -> generator (exlq's subclass where
its levers are asked for). The worker's
engine, the benchmarks and the GPU tests all load through here, so what they measure and
test is what the worker runs. Attention is installed by the caller, before this runs
(exllamav2_attention.install_attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.engines.exllamav2_embedding import move_embedding_to_gpu
from worker.engines.exllamav2_generator import make_dynamic_generator, size_model_config
from worker.engines.exllamav2_graphs import DecodeGraphs, install_decode_graphs

PAGE_TOKENS = 256  # exllamav2's PAGED_PAGE_SIZE


@dataclass(frozen=True, slots=True)
class LoadedGenerator:
    model: Any  # ExLlamaV2
    cache: Any  # ExLlamaV2Cache
    tokenizer: Any  # ExLlamaV2Tokenizer
    generator: Any  # ExLlamaV2DynamicGenerator or ExlqDynamicGenerator
    cache_tokens: int  # what the cache holds, in whole pages
    gpu_embedding: bool  # the embedding table sits on the GPU

    def unload(self) -> None:
        """Stop the generator's thread pools and free the model's GPU memory."""
        for name in ("sampling_pool", "filter_pool"):
            pool = getattr(self.generator, name, None)
            if pool is not None:
                pool.shutdown(wait=False)
        self.model.unload()


def load_generator(
    model_dir: str | Path,
    *,
    max_batch_size: int,
    cache_tokens: int,
    gpu_sampling: bool,
    prefill_batch_tokens: int,
    admit_prompt_tokens: int = 0,
    max_chunk_size: int | None = None,
    sampling_threads: int = 16,
    paged: bool = True,
    gpu_embedding: bool = False,
    decode_graphs: bool = False,
) -> LoadedGenerator:
    """Load the model in ``model_dir`` with a cache of ``cache_tokens`` (rounded down to whole
    pages, at least one) and a generator for ``max_batch_size`` jobs. ``max_chunk_size``
    (None: exllamav2's default) is held to what the model's scratch allows, in whole pages.
    ``admit_prompt_tokens`` > 0: the jobs one step starts hold at most that many prompt
    tokens together (exlq's generator). ``gpu_embedding``: the embedding table moves to the
    GPU where there is room (exllamav2_embedding.py); else it stays in system memory, as
    exllamav2 loads it. ``decode_graphs``: the decode step will be captured whole
    (warm_up's graphs_for), so quantized modules are loaded without exllamav2's own graphs,
    which a capture cannot hold; fp16 modules have none either way.
    """
    from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer

    config = ExLlamaV2Config(str(model_dir))
    size_model_config(config, max_batch_size, prefill_batch_tokens)
    if decode_graphs:
        config.no_graphs = True
    cache_tokens = max(PAGE_TOKENS, cache_tokens // PAGE_TOKENS * PAGE_TOKENS)
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, max_seq_len=cache_tokens, lazy=True)
    model.load_autosplit(cache, progress=False)
    embedding_on_gpu = move_embedding_to_gpu(model) if gpu_embedding else False
    tokenizer = ExLlamaV2Tokenizer(config)
    options: dict[str, Any] = {}
    if max_chunk_size is not None:
        chunk = min(max_chunk_size, config.max_input_len)
        options["max_chunk_size"] = max(PAGE_TOKENS, chunk // PAGE_TOKENS * PAGE_TOKENS)
    generator = make_dynamic_generator(
        gpu_sampling=gpu_sampling,
        prefill_batch_tokens=prefill_batch_tokens,
        admit_prompt_tokens=admit_prompt_tokens,
        model=model,
        cache=cache,
        tokenizer=tokenizer,
        max_batch_size=max_batch_size,
        paged=paged,
        max_sampling_threads=sampling_threads,
        **options,
    )
    return LoadedGenerator(model, cache, tokenizer, generator, cache_tokens, embedding_on_gpu)


@dataclass(frozen=True, slots=True)
class WarmedUp:
    graphs: DecodeGraphs | None  # None: no graphs asked for, or the model cannot have them
    prefill_seconds: float | None  # compiling the batched prefill's kernels; None: no batching


def warm_up(generator: Any, graphs_for: int | None) -> WarmedUp:
    """What the worker's engine does before it takes a job: exllamav2's warm-up, compiling
    the batched prefill's kernels (exlq's generator), then capturing the decode step's CUDA
    graphs for 1..graphs_for jobs (None: no graphs)."""
    generator.warmup()
    prefill_seconds = generator.warm_up_prefill() if hasattr(generator, "warm_up_prefill") else None
    graphs = install_decode_graphs(generator, graphs_for) if graphs_for else None
    return WarmedUp(graphs, prefill_seconds)
