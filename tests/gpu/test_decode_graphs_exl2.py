"""EXL2 weights: decode steps replayed from exlq's CUDA graphs compute what exllamav2's own
forward pass computes, on both of exllamav2's quantized matmul paths (up to 32 rows it
multiplies from the quantized weights; above, it dequantizes and calls cuBLAS)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.gpu.greedy import compare_replay_with_eager, greedy_tokens_and_logits

JOBS = 40  # the batch shrinks from 40 rows, through 32, to a few
PROMPT_TOKENS = [5 + (37 * i) % 300 for i in range(JOBS)]
NEW_TOKENS = [4 + (7 * i) % 17 for i in range(JOBS)]


def _load(model_dir: Path, decode_graphs: bool) -> Any:
    from exlq.worker.engines.exllamav2.attention import install_attention
    from exlq.worker.engines.exllamav2.load import load_generator

    install_attention("exlq")
    return load_generator(
        model_dir,
        max_batch_size=JOBS,
        cache_tokens=16384,
        gpu_sampling=False,
        prefill_batch_tokens=0,
        decode_graphs=decode_graphs,
    )


def _generate(generator: Any) -> dict[int, tuple[list[int], Any]]:
    import torch

    rng = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 32000, (1, n), generator=rng) for n in PROMPT_TOKENS]
    return greedy_tokens_and_logits(generator, prompts, NEW_TOKENS)


def test_exl2_graph_replay_matches_the_eager_forward_pass(exl2_model_dir: Path) -> None:
    from exlq.worker.engines.exllamav2.graphs import graphs_unsupported_reason, has_quantized_layers

    loaded = _load(exl2_model_dir, decode_graphs=True)
    try:
        assert has_quantized_layers(loaded.model)
        assert graphs_unsupported_reason(loaded.model, loaded.cache) is None
        graphs, worst = compare_replay_with_eager(loaded.generator, _generate, JOBS, NEW_TOKENS)
        print(
            f"\nEXL2 decode graphs: {len(graphs._graphs)} sizes captured in "
            f"{graphs.capture_seconds:.2f}s, {graphs.replays} replays, "
            f"max abs logit diff vs eager {worst:.3g}"
        )
    finally:
        loaded.unload()


def test_exl2_batches_replayed_padded_match_the_eager_forward_pass(exl2_model_dir: Path) -> None:
    """A batch of up to 32 jobs replayed from the 33-row graph, its spare rows copies of
    the first job's, computes what exllamav2's forward pass computes for the batch alone.
    Every size is padded here, whatever the capture measured, so that each decode step of
    32 jobs or fewer takes the padded path."""
    from exlq.worker.engines.exllamav2 import graphs as exllamav2_graphs

    pad_rows = exllamav2_graphs._QUANT_KERNEL_ROWS + 1
    loaded = _load(exl2_model_dir, decode_graphs=True)

    def pad_every_size(graphs: Any) -> None:
        print(f"\nmeasured at capture: sizes {sorted(graphs.padded)} padded")
        graphs.use_padding({size: pad_rows for size in range(1, pad_rows)})

    try:
        graphs, worst = compare_replay_with_eager(
            loaded.generator, _generate, JOBS, NEW_TOKENS, after_capture=pad_every_size
        )
        # Job i takes NEW_TOKENS[i] - 1 decode steps after its prefill: every step with 32
        # jobs or fewer left replayed padded (14 of the 19 here).
        left = [sum(1 for n in NEW_TOKENS if n - 1 >= step) for step in range(1, max(NEW_TOKENS))]
        assert graphs.padded_replays == sum(1 for jobs in left if jobs < pad_rows)
        print(
            f"EXL2 padded replays: {graphs.padded_replays} of {graphs.replays}, "
            f"max abs logit diff vs eager {worst:.3g}"
        )
    finally:
        loaded.unload()


def test_exl2_loaded_with_exllamav2s_own_graphs_gets_no_decode_graphs(
    exl2_model_dir: Path,
) -> None:
    """A capture cannot hold exllamav2's own module graphs; the reason says how to load."""
    from exlq.worker.engines.exllamav2.graphs import graphs_unsupported_reason

    loaded = _load(exl2_model_dir, decode_graphs=False)
    try:
        reason = graphs_unsupported_reason(loaded.model, loaded.cache)
        assert reason is not None and "decode_graphs=True" in reason
    finally:
        loaded.unload()


def _define(source: Path, name: str) -> int:
    for line in source.read_text().splitlines():
        words = line.split()
        if words[:2] == ["#define", name]:
            return int(words[2])
    raise AssertionError(f"{name} is not defined in {source}")


def test_the_matmul_tuning_that_capture_waits_out_is_as_pinned(cuda: None) -> None:
    """settle_gemm_tuning runs exllamav2's timed matmul calls before a capture; if the
    installed extension times more calls or larger shapes, a capture would break."""
    import exllamav2

    from exlq.worker.engines.exllamav2 import graphs as exllamav2_graphs

    ext = Path(exllamav2.__file__).parent / "exllamav2_ext"
    assert _define(ext / "cuda" / "q_gemm_autotune.cuh", "AT_NUM_MEASURE") == (
        exllamav2_graphs._TUNING_CALLS
    )
    assert _define(ext / "config.h", "MAX_Q_GEMM_ROWS_KERNEL") == exllamav2_graphs._TUNED_ROWS
    kernel = (ext / "cuda" / "q_gemm_kernel.cuh").read_text()
    assert "#define EXL2_BLOCK_M_SIZE_MAX MAX_Q_GEMM_ROWS_KERNEL" in kernel
    gemm = (ext / "cuda" / "q_gemm.cu").read_text()
    assert "if (size_m > EXL2_BLOCK_M_SIZE_MAX)" in gemm and "cudaEventSynchronize" in gemm


def test_the_rows_where_the_matmul_dequantizes_are_as_pinned(cuda: None) -> None:
    """Padded replays (choose_padding) take a batch past the rows up to which exllamav2
    multiplies from the quantized weights; if that bound moves, the padded size is wrong."""
    import exllamav2

    from exlq.worker.engines.exllamav2 import graphs as exllamav2_graphs

    ext = Path(exllamav2.__file__).parent / "exllamav2_ext"
    assert _define(ext / "config.h", "MAX_Q_GEMM_ROWS") == exllamav2_graphs._QUANT_KERNEL_ROWS
    gemm = (ext / "cuda" / "q_gemm.cu").read_text()
    assert "if (size_m > MAX_Q_GEMM_ROWS && !force_cuda && size_k <= row_step)" in gemm
