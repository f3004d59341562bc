"""The token-embedding table on the GPU, where exllamav2 keeps it in system memory.

exllamav2's load_autosplit always puts the embedding module on the CPU, to save VRAM. Every
forward pass then gathers its rows on the CPU and copies them to the GPU from pageable
memory. For a prefill pass of 4,096 tokens of an 8B Llama shape that is a 32 MB gather and
a 32 MB copy, in which the GPU waits: CPU time that follows the CPU's speed and a fresh
buffer's page faults, then a copy from pageable memory (docs/PERFORMANCE.md, "On the GPU
(exllamav2 engine options)"). On the GPU the same gather is one small kernel, and the pass
sends only its token ids.

The table costs vocab x hidden x 2 bytes of GPU memory (1.05 GB for Llama 3 8B, 0.5 GB for
its 1B). The weight moves to the device of the first layer, and the module's forward moves
the ids it is given there first, so exllamav2's forward pass, exlq's batched prefill and
the decode graphs all call it as before. When the GPU has no room left, the table stays
where exllamav2 put it.

Pinned to exllamav2 0.3.2 like the attention hook: tests/gpu/test_embedding_on_gpu.py fails
if the module's layout moves, and checks that the logits do not change.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def embedding_module(model: Any) -> Any:
    """The model's token-embedding module (exllamav2 keeps it first)."""
    from exllamav2.embedding import ExLlamaV2Embedding

    module = model.modules[0]
    if not isinstance(module, ExLlamaV2Embedding):
        raise TypeError(f"the model's first module is {type(module).__name__}, not an embedding")
    return module


def embedding_device(model: Any) -> str:
    """Where the model's embedding table is: "cpu" or "cuda:N"."""
    return str(embedding_module(model).embedding.weight.device)


def move_embedding_to_gpu(model: Any) -> bool:
    """Put the embedding table on the GPU of the model's first layer; False (and the table
    left in system memory) when the model's layers are not on one GPU or the GPU is full."""
    import torch

    from exlq.worker.engines.exllamav2.attention import on_pinned_exllamav2

    try:
        module = embedding_module(model)
    except TypeError as exc:
        log.info("embedding table stays where it is: %s", exc)
        return False
    if not on_pinned_exllamav2("embedding table stays in system memory"):
        return False
    if getattr(model, "tp_context", None) is not None:
        log.info("embedding table stays in system memory: the model is split by tensor parallelism")
        return False
    devices = {m.device_idx for m in model.modules[1:]}
    if len(devices) != 1 or None in devices or -1 in devices:
        log.info("embedding table stays in system memory: the layers sit on %s", sorted(devices))
        return False
    index = devices.pop()
    device = torch.device("cuda", index)
    weight = module.embedding.weight
    if weight.device == device:
        return True
    try:
        on_gpu = _copy_to(weight.data, device)
    except torch.cuda.OutOfMemoryError:
        size_mb = weight.numel() * weight.element_size() / 2**20
        log.warning(
            "embedding table stays in system memory: no room for its %.0f MB on %s (a smaller "
            "--cache-tokens frees room); prefill passes gather their rows on the CPU",
            size_mb,
            device,
        )
        return False
    module.embedding.weight = torch.nn.Parameter(on_gpu, requires_grad=False)
    module.set_device_idx(index)
    exllamav2_forward = module.forward

    def forward(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        # The ids arrive on the CPU from exllamav2's callers; a (batch, tokens) long tensor
        # is small beside the rows it stands for.
        return exllamav2_forward(hidden_states.to(device, non_blocking=True), *args, **kwargs)

    module.forward = forward
    return True


def _copy_to(tensor: Any, device: Any) -> Any:
    return tensor.to(device)
