"""GPU fixtures: skip where CUDA is absent; a random-weight checkpoint made on the spot."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Without exllamav2 (and torch) these modules cannot even be imported; CPU runs, which may
# have torch for the transformers engine, deselect them (-m "not gpu") and skip collecting.
collect_ignore_glob = [] if importlib.util.find_spec("exllamav2") else ["test_*.py"]


@pytest.fixture(scope="session")
def cuda() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("exllamav2")


@pytest.fixture(scope="session")
def model_dir(cuda: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """EXLQ_TEST_MODEL if set, else a fresh random-weight 1B-shape Llama."""
    given = os.environ.get("EXLQ_TEST_MODEL")
    if given:
        return Path(given)
    from bench.make_checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("models") / "llama-1b-random", "1b")


@pytest.fixture(scope="session")
def exl2_model_dir(cuda: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight shape, quantized to 4.0 bpw by exllamav2's own converter."""
    from bench.exl2 import convert_exl2
    from bench.make_checkpoint import make_checkpoint

    root = tmp_path_factory.mktemp("exl2")
    out = root / "llama-tiny-exl2-4.0bpw"
    convert_exl2(make_checkpoint(root / "llama-tiny-random", "tiny"), out, bits=4.0)
    return out


@pytest.fixture
def make_loaded(model_dir: Path) -> Iterator[Callable[..., Any]]:
    """make_loaded(exlq=False, max_batch=8, prefill_batch_tokens=0, admit_prompt_tokens=0,
    gpu_embedding=False, decode_graphs=False): a fresh load of the test model, as
    load_generator returns it, with a paged generator on exlq's attention (exlq=True: exlq's
    subclass with GPU sampling; prefill_batch_tokens > 0: with batched prefill;
    admit_prompt_tokens > 0: with that budget of prompt tokens for the jobs a step starts;
    gpu_embedding: the embedding table on the GPU; decode_graphs: warm_up captures the
    decode step); unloaded after the test."""
    from exlq.worker.engines.exllamav2.attention import install_attention
    from exlq.worker.engines.exllamav2.load import LoadedGenerator, load_generator

    loads: list[LoadedGenerator] = []

    def make(
        exlq: bool = False,
        max_batch: int = 8,
        prefill_batch_tokens: int = 0,
        admit_prompt_tokens: int = 0,
        gpu_embedding: bool = False,
        decode_graphs: bool = False,
    ) -> LoadedGenerator:
        install_attention("exlq")
        loaded = load_generator(
            model_dir,
            max_batch_size=max_batch,
            cache_tokens=8192,
            gpu_sampling=exlq,
            prefill_batch_tokens=prefill_batch_tokens,
            admit_prompt_tokens=admit_prompt_tokens,
            gpu_embedding=gpu_embedding,
            decode_graphs=decode_graphs,
        )
        assert loaded.gpu_embedding == gpu_embedding
        loads.append(loaded)
        return loaded

    yield make
    for loaded in loads:
        loaded.unload()


@pytest.fixture
def make_generator(make_loaded: Callable[..., Any]) -> Callable[..., Any]:
    """make_generator(**options): the generator of make_loaded(**options); the model is
    `generator.model`."""
    return lambda **options: make_loaded(**options).generator
