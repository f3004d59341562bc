"""load_generator: the one way exlq loads a model for exllamav2's dynamic generator, and
warm_up: the one way it readies that generator before the first job.

config -> model scratch sized for the batch -> model -> paged cache -> load_autosplit ->
the embedding table to the GPU (asked for) -> tokenizer -> generator (exlq's subclass where
its levers are asked for). The worker's
engine, the benchmarks and the GPU tests all load through here, so what they measure and
test is what the worker runs. Attention is installed by the caller, before this runs
(attention.install_attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exlq.worker.engines.exllamav2.embedding import move_embedding_to_gpu
from exlq.worker.engines.exllamav2.generator import make_dynamic_generator, size_model_config
from exlq.worker.engines.exllamav2.graphs import DecodeGraphs, install_decode_graphs
from exlq.worker.engines.exllamav2.placement import Drafting, Placement, load_weights

PAGE_TOKENS = 256  # exllamav2's PAGED_PAGE_SIZE


@dataclass(frozen=True, slots=True)
class LoadedGenerator:
    model: Any  # ExLlamaV2
    cache: Any  # ExLlamaV2Cache
    tokenizer: Any  # ExLlamaV2Tokenizer
    generator: Any  # ExLlamaV2DynamicGenerator or ExlqDynamicGenerator
    cache_tokens: int  # what the cache holds, in whole pages
    gpu_embedding: bool  # the embedding table sits on the GPU
    # The decode step is to be captured whole (load_generator's decode_graphs): the model
    # was loaded for it, and warm_up captures it.
    decode_graphs: bool

    def capture_graphs(self) -> DecodeGraphs | None:
        """Capture and install the decode step's CUDA graphs for 1..max_batch_size jobs,
        where the load asked for them; None where it did not, or the model cannot have them
        (the log says why)."""
        if not self.decode_graphs:
            return None
        return install_decode_graphs(self.generator, self.generator.max_batch_size)

    def unload(self) -> None:
        """Stop the generator's thread pools and free the model's GPU memory."""
        for name in ("sampling_pool", "filter_pool"):
            pool = getattr(self.generator, name, None)
            if pool is not None:
                pool.shutdown(wait=False)
        draft = getattr(self.generator, "draft_model", None)
        if draft is not None:
            draft.unload()
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
    # exllamav2's CPU sampler threads; its default of 16 did no better than 1 (the GPU
    # samples the common cases), so the engine loads with 1 and the benchmarks may vary it.
    sampling_threads: int = 1,
    paged: bool = True,
    gpu_embedding: bool = False,
    decode_graphs: bool = False,
    placement: Placement | None = None,
    drafting: Drafting | None = None,
) -> LoadedGenerator:
    """Load the model in ``model_dir`` with a cache of ``cache_tokens`` (rounded down to whole
    pages, at least one) and a generator for ``max_batch_size`` jobs. ``max_chunk_size``
    (None: exllamav2's default) is held to what the model's scratch allows, in whole pages.
    ``admit_prompt_tokens`` > 0: the jobs one step starts hold at most that many prompt
    tokens together (exlq's generator). ``gpu_embedding``: the embedding table moves to the
    GPU where there is room (embedding.py); else it stays in system memory, as
    exllamav2 loads it. ``decode_graphs``: warm_up captures the decode step whole, so
    quantized modules are loaded without exllamav2's own graphs, which a capture cannot
    hold; fp16 modules have none either way. One flag, here, decides both. ``placement``:
    how the weights spread over several GPUs (None: exllamav2's autosplit, which fills one
    GPU before the next). ``drafting``: speculative decoding, with a draft model or n-grams.
    """
    from exllamav2 import ExLlamaV2, ExLlamaV2Config, ExLlamaV2Tokenizer

    config = ExLlamaV2Config(str(model_dir))
    size_model_config(config, max_batch_size, prefill_batch_tokens)
    if decode_graphs:
        config.no_graphs = True
    cache_tokens = max(PAGE_TOKENS, cache_tokens // PAGE_TOKENS * PAGE_TOKENS)
    model = ExLlamaV2(config)
    cache = load_weights(model, cache_tokens, placement or Placement())
    embedding_on_gpu = move_embedding_to_gpu(model) if gpu_embedding else False
    tokenizer = ExLlamaV2Tokenizer(config)
    options: dict[str, Any] = {}
    if max_chunk_size is not None:
        chunk = min(max_chunk_size, config.max_input_len)
        options["max_chunk_size"] = max(PAGE_TOKENS, chunk // PAGE_TOKENS * PAGE_TOKENS)
    if drafting is not None:
        options.update(drafting.generator_options(model, cache_tokens, max_batch_size))
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
    return LoadedGenerator(
        model, cache, tokenizer, generator, cache_tokens, embedding_on_gpu, decode_graphs
    )


@dataclass(frozen=True, slots=True)
class WarmedUp:
    graphs: DecodeGraphs | None  # None: no graphs asked for, or the model cannot have them
    prefill_seconds: float | None  # compiling the batched prefill's kernels; None: no batching


def warm_up(loaded: LoadedGenerator) -> WarmedUp:
    """What the worker's engine does before it takes a job: exllamav2's warm-up, compiling
    the batched prefill's kernels (exlq's generator), then capturing the decode step's CUDA
    graphs for 1..max_batch_size jobs where the load asked for them (decode_graphs), from
    which exlq's generator then overlaps its decode steps where it can (overlap.py)."""
    generator = loaded.generator
    generator.warmup()
    prefill_seconds = generator.warm_up_prefill() if hasattr(generator, "warm_up_prefill") else None
    graphs = loaded.capture_graphs()
    if graphs is not None and hasattr(generator, "use_overlap"):
        generator.use_overlap(graphs)
    return WarmedUp(graphs, prefill_seconds)
