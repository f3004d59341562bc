"""load_model: the transformers engine's model and tokenizer, from a model directory or a
GGUF file, on the device and in the dtype the settings ask for."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exlq.worker.engines.base import EngineUnavailable
from exlq.worker.engines.transformers.settings import TransformersSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """Where from_pretrained reads a model: a directory, and the GGUF file in it, if any."""

    directory: Path
    gguf_file: str | None

    @property
    def format(self) -> str:
        return "gguf" if self.gguf_file else "transformers"


def find_model_files(path: Path) -> ModelFiles:
    """A model directory (config.json), a .gguf file, or a directory holding one .gguf."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise EngineUnavailable(f"{path} is a file but not a .gguf: give a model directory")
        return ModelFiles(path.parent, path.name)
    if (path / "config.json").exists():
        return ModelFiles(path, None)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelFiles(path, ggufs[0].name)
    raise EngineUnavailable(
        f"{path} has no config.json and "
        f"{'several .gguf files: name one' if ggufs else 'no .gguf file'}"
    )


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: Any  # a transformers PreTrainedModel with a causal-LM head
    tokenizer: Any  # its PreTrainedTokenizer(Fast)
    files: ModelFiles
    device: Any  # torch.device
    context_tokens: int  # the model's context length, where its config says


def load_model(path: Path, settings: TransformersSettings) -> LoadedModel:
    """The model in eval mode on its device; EngineUnavailable says why it cannot be."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise EngineUnavailable(
            f"the transformers engine needs torch and transformers ({exc}): install the "
            "transformers extra (pip install 'exlq[transformers]')"
        ) from None
    files = find_model_files(path)
    device = torch.device(_device(settings.device, torch))
    dtype = _dtype(settings.dtype, device, torch)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        tokenizer: Any = AutoTokenizer.from_pretrained(files.directory, gguf_file=files.gguf_file)
        model: Any = AutoModelForCausalLM.from_pretrained(
            files.directory, gguf_file=files.gguf_file, dtype=dtype
        )
    except (OSError, ValueError, ImportError, KeyError) as exc:
        # A missing file or package (gguf and accelerate for GGUF files), or an
        # architecture this transformers does not know.
        raise EngineUnavailable(f"cannot load the model from {path}: {exc}") from exc
    model.to(device)
    model.eval()
    _check_full_attention(model)
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return LoadedModel(model, tokenizer, files, device, int(context or 0))


def _device(choice: str, torch: Any) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise EngineUnavailable("device=cuda, but torch sees no CUDA GPU")
    return choice


def _dtype(choice: str, device: Any, torch: Any) -> Any:
    if choice != "auto":
        return getattr(torch, choice)
    if device.type == "cpu":
        return torch.float32  # the CPU's half-precision matmuls are slow without AMX
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def _check_full_attention(model: Any) -> None:
    """The batch pads and trims every layer's cache the same way: a sliding-window or
    recurrent layer's cache has another shape."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    layers = DynamicCache(config=model.config).layers
    odd = {type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer}
    if odd:
        raise EngineUnavailable(
            f"the transformers engine runs models whose every layer attends to the whole "
            f"context; this one has {', '.join(sorted(odd))} layers"
        )
