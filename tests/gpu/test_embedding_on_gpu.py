"""The embedding table on the GPU (worker/engines/exllamav2/embedding.py) changes where the
rows are gathered, not what the model computes; a GPU without room keeps the table where
exllamav2 put it."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import pytest

from tests.gpu.greedy import greedy_tokens_and_logits

PROMPTS = [7, 300, 129, 600]  # tokens per job: one page, several, a partial last page
NEW_TOKENS = 24


def _prompts() -> list[Any]:
    import torch

    rng = torch.Generator().manual_seed(3)
    return [torch.randint(3, 32000, (1, n), generator=rng) for n in PROMPTS]


def _greedy(generator: Any) -> dict[int, tuple[list[int], Any]]:
    return greedy_tokens_and_logits(generator, _prompts(), [NEW_TOKENS] * len(PROMPTS))


def test_exllamav2_loads_the_table_on_the_cpu_and_gathers_it_in_forward(
    make_generator: Any,
) -> None:
    """Fails loudly if exllamav2 0.3.2's embedding module moves what the hook relies on."""
    from exllamav2.embedding import ExLlamaV2Embedding

    from exlq.worker.engines.exllamav2.embedding import embedding_device, embedding_module

    model = make_generator().model
    assert isinstance(embedding_module(model), ExLlamaV2Embedding)
    assert embedding_device(model) == "cpu", "exllamav2 no longer keeps the table on the CPU"
    forward = inspect.getsource(ExLlamaV2Embedding.forward)
    assert "hidden_states = self.embedding(hidden_states)" in forward
    assert list(inspect.signature(ExLlamaV2Embedding.forward).parameters)[:2] == [
        "self",
        "hidden_states",
    ]


def test_the_model_computes_the_same_logits_with_the_table_on_the_gpu(
    make_generator: Any,
) -> None:
    import torch

    from exlq.worker.engines.exllamav2.embedding import embedding_device, move_embedding_to_gpu

    model = make_generator().model
    ids = torch.cat([p[:, :64] for p in _prompts()[1:]])  # (3, 64): a batch, one pass
    with torch.inference_mode():
        on_cpu = model.forward(ids).float()
        assert move_embedding_to_gpu(model)
        assert embedding_device(model).startswith("cuda")
        on_gpu = model.forward(ids).float()
    diff = (on_cpu - on_gpu).abs().max().item()
    print(f"\nembedding on the GPU: max abs logit diff against the CPU table {diff:.3g}")
    assert diff == 0.0


def test_exlq_generator_makes_the_same_tokens_with_the_table_on_the_gpu(
    make_loaded: Any,
) -> None:
    """Batched prefill, GPU sampling and decode graphs, with the table on either side."""
    from exlq.worker.engines.exllamav2.load import warm_up

    runs = {}
    for gpu_embedding in (False, True):
        loaded = make_loaded(
            exlq=True,
            max_batch=4,
            prefill_batch_tokens=1024,
            gpu_embedding=gpu_embedding,
            decode_graphs=True,
        )
        generator = loaded.generator
        graphs = warm_up(loaded).graphs
        assert graphs is not None
        runs[gpu_embedding] = _greedy(generator)
        assert graphs.replays >= NEW_TOKENS - 1
        graphs.uninstall()
    worst = 0.0
    for i, (want_tokens, want_logits) in runs[False].items():
        got_tokens, got_logits = runs[True][i]
        assert got_tokens == want_tokens, f"job {i}"
        worst = max(worst, (want_logits - got_logits).abs().max().item())
    print(f"\nexlq generator, table on the GPU against the CPU: max abs logit diff {worst:.3g}")
    assert worst == 0.0


def test_a_gpu_without_room_keeps_the_table_in_system_memory(
    make_generator: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import torch

    from exlq.worker.engines.exllamav2 import embedding as exllamav2_embedding

    def full(tensor: Any, device: Any) -> Any:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(exllamav2_embedding, "_copy_to", full)
    model = make_generator().model
    with caplog.at_level(logging.WARNING, logger=exllamav2_embedding.__name__):
        assert not exllamav2_embedding.move_embedding_to_gpu(model)
    assert "no room" in caplog.text and "--cache-tokens" in caplog.text
    assert exllamav2_embedding.embedding_device(model) == "cpu"
    with torch.inference_mode():
        logits = model.forward(_prompts()[1][:, :16])
    assert logits.shape[:2] == (1, 16) and torch.isfinite(logits.float()).all()
