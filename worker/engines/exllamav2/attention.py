"""Chooses exllamav2's attention backend: flash-attn when installed, else exlq's Triton kernels.

exllamav2 0.3.2 batches (paged mode) only when flash-attn >= 2.5.7 is importable. Without it
we put exlq's paged kernel in the place of flash-attn's ``flash_attn_with_kvcache`` inside
``exllamav2.attn`` and raise the flags that gate paged mode. This module is the only place
that touches those internals; tests/unit/test_attention_hook.py fails loudly if they move.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from exlq.worker.engines.base import EngineUnavailable
from exlq.worker.engines.exllamav2.settings import AttentionChoice

log = logging.getLogger(__name__)

PINNED_EXLLAMAV2 = "0.3.2"
# Module-level flags of exllamav2.attn that gate paged mode; the hook raises them and binds
# the global `flash_attn_with_kvcache` that forward_paged calls (exllamav2 defines it only when
# flash-attn imports). `has_flash_attn` stays False: with it True the unpaged paths would call
# flash_attn_func, which exlq does not provide.
HOOKED_FLAGS = (
    "has_flash_attn_with_paged",
    "has_flash_attn_with_window",
    "has_flash_attn_with_softcap",
)
_REQUIRED_NAMES = (*HOOKED_FLAGS, "has_flash_attn", "assert_paged_attn", "ExLlamaV2Attention")


def flash_attn_available() -> bool:
    """flash-attn recent enough for paged attention, as exllamav2 itself checks."""
    try:
        version = importlib.metadata.version("flash_attn")
    except importlib.metadata.PackageNotFoundError:
        return False
    parts = [int(p) for p in version.split(".")[:3] if p.isdigit()]
    return parts >= [2, 5, 7]


def installed_exllamav2() -> str:
    """The installed exllamav2's version; exlq's hooks into it are written for PINNED_EXLLAMAV2."""
    return importlib.metadata.version("exllamav2")


def on_pinned_exllamav2(left_as_is: str) -> bool:
    """Whether the installed exllamav2 is the pinned one; if not, a warning that says what
    stays as exllamav2 does it (``left_as_is``) and which versions differ."""
    installed = installed_exllamav2()
    if installed == PINNED_EXLLAMAV2:
        return True
    log.warning(
        "%s: exllamav2 %s is installed; exlq's hook is written for %s",
        left_as_is,
        installed,
        PINNED_EXLLAMAV2,
    )
    return False


def check_hook_points(attn_module: Any) -> None:
    """Raise EngineUnavailable unless exllamav2.attn still has what the hook replaces."""
    missing = [name for name in _REQUIRED_NAMES if not hasattr(attn_module, name)]
    paged = getattr(getattr(attn_module, "ExLlamaV2Attention", None), "forward_paged", None)
    if paged is None or "flash_attn_with_kvcache" not in paged.__code__.co_names:
        missing.append("forward_paged calling flash_attn_with_kvcache")
    installed = installed_exllamav2()
    if missing or installed != PINNED_EXLLAMAV2:
        raise EngineUnavailable(
            f"exlq's attention hook is written for exllamav2 {PINNED_EXLLAMAV2}; found "
            f"{installed}{' without ' + ', '.join(missing) if missing else ''}. Install "
            f"exllamav2=={PINNED_EXLLAMAV2}, or flash-attn and --attention flash-attn"
        )


# The new-token count of each row of a right-padded batch, while one runs (batched prefill).
_padded_lengths: ContextVar[Any] = ContextVar("exlq_padded_lengths", default=None)


@contextmanager
def right_padded(new_lens: Any) -> Iterator[None]:
    """While open, exlq's kernel stores only the first new_lens[b] new keys/values of row b
    (a (batch,) int32 tensor on the GPU): the padding behind them never reaches the cache.
    Only with exlq's kernel installed (padding_supported())."""
    token = _padded_lengths.set(new_lens)
    try:
        yield
    finally:
        _padded_lengths.reset(token)


def _exlq_flash_attn_with_kvcache(*args: Any, **kwargs: Any) -> Any:
    from exlq.worker.kernels.paged_attention import paged_attention_with_kvcache

    new_lens = _padded_lengths.get()
    if new_lens is not None:
        q = kwargs["q"] if "q" in kwargs else args[0]
        kwargs["new_lens"] = new_lens if new_lens.device == q.device else new_lens.to(q.device)
    return paged_attention_with_kvcache(*args, **kwargs)


def padding_supported() -> bool:
    """True when exllamav2's paged attention runs exlq's kernel, which can leave the padding
    of a right-padded batch out of the cache (flash-attn cannot)."""
    attn: Any = importlib.import_module("exllamav2.attn")
    return getattr(attn, "flash_attn_with_kvcache", None) is _exlq_flash_attn_with_kvcache


def install_exlq_kernels() -> None:
    from exlq.worker.kernels.paged_attention import HAS_TRITON

    if not HAS_TRITON:
        raise EngineUnavailable(
            "--attention exlq needs triton (it ships with CUDA builds of torch)"
        )
    attn: Any = importlib.import_module("exllamav2.attn")
    check_hook_points(attn)
    attn.flash_attn_with_kvcache = _exlq_flash_attn_with_kvcache
    for flag in HOOKED_FLAGS:
        setattr(attn, flag, True)


def install_attention(choice: AttentionChoice) -> str:
    """Set up the backend and return its name: 'flash-attn' or 'exlq'."""
    has_flash = flash_attn_available()
    if choice == "flash-attn" and not has_flash:
        raise EngineUnavailable(
            "--attention flash-attn, but flash-attn >= 2.5.7 is not installed; "
            "use --attention exlq (or auto)"
        )
    if has_flash and choice in ("auto", "flash-attn"):
        log.info("attention: flash-attn (paged, batching on)")
        return "flash-attn"
    install_exlq_kernels()
    log.info(
        "attention: exlq Triton paged kernels (paged, batching on)%s",
        "" if choice == "exlq" else "; flash-attn not found",
    )
    return "exlq"
