"""Where the model's weights go (one GPU, whole layers per GPU, or every layer split by
tensor parallelism) and the speculative decoding the generator runs (a draft model or
n-grams): the two choices load_generator makes beyond one model on one GPU.

exllamav2's tensor parallelism runs its own paged attention in C++, which calls flash-attn's
compiled ``flash_attn_2_cuda.fwd_kvcache`` by import. Without flash-attn, exlq registers a
module of that name whose ``fwd_kvcache`` runs exlq's Triton kernel on the stream and device
exllamav2 made current for the call, so tensor parallelism works where flash-attn is absent.
"""

from __future__ import annotations

import logging
import sys
import types
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exlq.worker.engines.base import EngineUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Placement:
    gpu_split_gb: list[float] | None = None  # GB of weights per GPU; None: autosplit
    tensor_parallel: bool = False


def load_weights(model: Any, cache_tokens: int, placement: Placement) -> Any:
    """Load ``model``'s weights as ``placement`` says; returns its cache of cache_tokens."""
    from exllamav2 import ExLlamaV2Cache

    if placement.tensor_parallel:
        from exllamav2 import ExLlamaV2Cache_TP

        install_tp_attention()
        try:
            model.load_tp(placement.gpu_split_gb, progress=False, expect_cache_tokens=cache_tokens)
        except Exception as exc:
            if "quantized" not in str(exc):
                raise
            raise EngineUnavailable(
                "tensor_parallel: exllamav2 splits only EXL2-quantized weights, and this "
                f"model's are not ({exc}); use gpu_split to give each GPU whole layers"
            ) from None
        return ExLlamaV2Cache_TP(model, max_seq_len=cache_tokens)
    if placement.gpu_split_gb is not None:
        model.load(placement.gpu_split_gb, progress=False)
        return ExLlamaV2Cache(model, max_seq_len=cache_tokens)
    cache = ExLlamaV2Cache(model, max_seq_len=cache_tokens, lazy=True)
    model.load_autosplit(cache, progress=False)
    return cache


def where_loaded(model: Any) -> str:
    """Where the loaded model's weights sit, in words: its modules (attention, MLP, head)
    per GPU, or the GPUs tensor parallelism splits every layer over."""
    context = getattr(model, "tp_context", None)
    if context is not None:
        return "tensor parallel over " + ", ".join(f"cuda:{d}" for d in context.all_devs)
    on_gpus = Counter(
        module.device_idx
        for module in model.modules
        if module.device_idx is not None and module.device_idx >= 0
    )
    return ", ".join(f"cuda:{d} {n} modules" for d, n in sorted(on_gpus.items()))


def install_tp_attention() -> None:
    """Stand exlq's paged kernel in for flash-attn's compiled module, which exllamav2's
    tensor-parallel attention imports by name, unless flash-attn is installed."""
    from exlq.worker.engines.exllamav2.attention import flash_attn_available

    if flash_attn_available() or "flash_attn_2_cuda" in sys.modules:
        return
    module = types.ModuleType("flash_attn_2_cuda")
    module.fwd_kvcache = _fwd_kvcache  # type: ignore[attr-defined]
    sys.modules["flash_attn_2_cuda"] = module


def _fwd_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    k: Any,
    v: Any,
    cache_seqlens: Any,
    rotary_cos: Any,
    rotary_sin: Any,
    cache_batch_idx: Any,
    cache_leftpad: Any,
    block_table: Any,
    alibi_slopes: Any,
    out: Any,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    rotary_interleaved: bool,
    num_splits: int,
) -> list[Any]:
    """flash-attn 2's fwd_kvcache, as exllamav2's C++ calls it (positionally), on exlq's
    kernel: the result goes into ``out``."""
    from exlq.worker.kernels.paged_attention import paged_attention_with_kvcache

    result = paged_attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        k=k,
        v=v,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
        block_table=block_table,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=(window_left, window_right),
        softcap=softcap,
        rotary_interleaved=rotary_interleaved,
        alibi_slopes=alibi_slopes,
        num_splits=num_splits,
    )
    out.copy_(result)
    return [out, None]


@dataclass(frozen=True, slots=True)
class Drafting:
    """Speculative decoding: ``tokens`` drafted a step by a draft model or from n-grams of
    the job's own text, verified by the model in one pass."""

    tokens: int
    draft_model: Path | None = None  # None: n-grams

    def describe(self) -> str:
        source = "n-grams" if self.draft_model is None else f"draft model {self.draft_model.name}"
        return f"{self.tokens} tokens a step from {source}"

    def generator_options(
        self, model: Any, cache_tokens: int, max_batch_size: int
    ) -> dict[str, Any]:
        """The generator's arguments for this drafting; loads the draft model and its cache
        (as large as the model's, as exllamav2 requires)."""
        options: dict[str, Any] = {"num_draft_tokens": self.tokens}
        if self.draft_model is None:
            options["use_ngram_draft"] = True
            return options
        from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config

        from exlq.worker.engines.exllamav2.generator import size_model_config

        if not (self.draft_model / "config.json").exists():
            raise EngineUnavailable(f"draft_model {self.draft_model} has no config.json")
        config = ExLlamaV2Config(str(self.draft_model))
        if config.vocab_size != model.config.vocab_size:
            raise EngineUnavailable(
                f"draft_model {self.draft_model} has a vocabulary of {config.vocab_size} "
                f"tokens, the model {model.config.vocab_size}: a draft must share the "
                "model's tokenizer"
            )
        config.max_seq_len = max(config.max_seq_len, model.config.max_seq_len)
        size_model_config(config, max_batch_size, 0)
        draft = ExLlamaV2(config)
        draft_cache = ExLlamaV2Cache(draft, max_seq_len=cache_tokens, lazy=True)
        draft.load_autosplit(draft_cache, progress=False)
        options.update(draft_model=draft, draft_cache=draft_cache)
        return options
