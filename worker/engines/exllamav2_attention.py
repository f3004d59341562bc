"""Chooses exllamav2's attention backend: flash-attn when installed, else exlq's paged kernels.

Placeholder until the paged kernels land: without flash-attn the engine runs unpaged.
"""

from __future__ import annotations

import logging

from worker.engines.base import EngineUnavailable
from worker.settings import AttentionChoice

log = logging.getLogger(__name__)


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def install_attention(choice: AttentionChoice) -> str:
    """Returns the backend in use: 'flash-attn', 'exlq', or 'none' (unpaged, no batching)."""
    has_flash = flash_attn_available()
    if choice == "flash-attn" and not has_flash:
        raise EngineUnavailable("--attention flash-attn, but flash-attn is not installed")
    if has_flash and choice in ("auto", "flash-attn"):
        log.info("attention: flash-attn")
        return "flash-attn"
    if choice == "exlq":
        raise EngineUnavailable("--attention exlq is not available in this build yet")
    log.warning("attention: no flash-attn found; running unpaged")
    return "none"
