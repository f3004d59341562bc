"""Decode steps replayed from CUDA graphs compute what exllamav2's own forward pass computes."""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest

from tests.gpu.greedy import compare_replay_with_eager, greedy_tokens_and_logits

# Ragged on purpose: one page, several pages, a page boundary crossed mid-generation, and
# jobs ending at different steps so the batch shrinks through several captured sizes.
PROMPT_TOKENS = [5, 100, 300, 600, 250, 40, 511]
NEW_TOKENS = [20, 33, 40, 12, 25, 30, 9]


def _generate(generator: Any) -> dict[int, tuple[list[int], Any]]:
    import torch

    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 32000, (1, n), generator=rng) for n in PROMPT_TOKENS]
    return greedy_tokens_and_logits(generator, prompts, NEW_TOKENS)


@pytest.mark.parametrize("gpu_embedding", [False, True], ids=["table-on-cpu", "table-on-gpu"])
def test_graph_replay_matches_the_eager_forward_pass(
    make_generator: Any, gpu_embedding: bool
) -> None:
    """With the embedding table on the GPU the graph gathers the rows itself; in system
    memory it is given rows gathered on the CPU. Either way it computes the eager pass."""
    generator = make_generator(max_batch=8, gpu_embedding=gpu_embedding)
    graphs, worst = compare_replay_with_eager(generator, _generate, 8, NEW_TOKENS)
    print(
        f"\ndecode graphs (embedding table on the {'GPU' if gpu_embedding else 'CPU'}): "
        f"{len(graphs._graphs)} sizes captured in {graphs.capture_seconds:.2f}s, "
        f"{graphs.replays} replays, max abs logit diff vs eager {worst:.3g}"
    )


def test_warm_up_captures_the_decode_step_only_where_the_load_asked(make_loaded: Any) -> None:
    """One flag, load_generator's decode_graphs, decides both how the model is loaded and
    whether warm_up captures its decode step, for 1..max_batch_size jobs."""
    from exlq.worker.engines.exllamav2.load import warm_up

    plain = make_loaded(max_batch=4)
    assert warm_up(plain).graphs is None
    assert "forward_chunk" not in plain.model.__dict__  # exllamav2's own forward pass

    captured = make_loaded(max_batch=4, decode_graphs=True)
    graphs = warm_up(captured).graphs
    assert graphs is not None
    assert sorted(graphs._graphs) == [1, 2, 3, 4]
    assert captured.model.__dict__["forward_chunk"] == graphs.forward_chunk
    graphs.uninstall()


def test_generator_still_makes_the_decode_call_the_graphs_replace(cuda: None) -> None:
    """Fails loudly if exllamav2 changes the forward_chunk call that graphs stand in for."""
    from exllamav2.attn import ExLlamaV2Attention
    from exllamav2.generator import ExLlamaV2DynamicGenerator

    from exlq.worker.engines.exllamav2.graphs import _DECODE_KWARGS

    source = inspect.getsource(ExLlamaV2DynamicGenerator.iterate_gen)
    call = re.search(r"self\.model\.forward_chunk\((.*?)\n\s*\)", source, re.S)
    assert call, "iterate_gen no longer calls self.model.forward_chunk"
    keywords = set(re.findall(r"(\w+)\s*=", call.group(1)))
    assert keywords == {"input_ids", *_DECODE_KWARGS}, keywords
    params = inspect.signature(ExLlamaV2Attention.PagedParams.__init__).parameters
    assert {"block_index", "cache_seqlens", "page_size", "q_len"} <= params.keys()
    paged = inspect.getsource(ExLlamaV2Attention.forward_paged)
    assert "attn_params.is_sequential" in paged
    assert "get_cache_seqlens(self.device_idx)" in paged
