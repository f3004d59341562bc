"""GPU fixtures: skip where CUDA is absent; a random-weight checkpoint made on the spot."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# Without torch these modules cannot even be imported; CPU runs deselect them (-m "not gpu").
collect_ignore_glob = [] if importlib.util.find_spec("torch") else ["test_*.py"]


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
