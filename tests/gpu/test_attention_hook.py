"""Fails loudly if exllamav2 moves what exlq's attention hook relies on."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re


def test_exllamav2_still_calls_flash_attn_with_kvcache_the_way_we_serve_it(cuda: None) -> None:
    from exlq.worker.engines.exllamav2.attention import PINNED_EXLLAMAV2, check_hook_points

    attn = importlib.import_module("exllamav2.attn")
    check_hook_points(attn)
    assert importlib.metadata.version("exllamav2") == PINNED_EXLLAMAV2
    source = inspect.getsource(attn.ExLlamaV2Attention.forward_paged)
    call = re.search(r"flash_attn_with_kvcache\((.*?)\n\s*\)", source, re.S)
    assert call, "forward_paged no longer calls flash_attn_with_kvcache"
    keywords = set(re.findall(r"(\w+)\s*=", call.group(1)))
    assert keywords == {
        "q",
        "k",
        "v",
        "k_cache",
        "v_cache",
        "cache_seqlens",
        "block_table",
        "causal",
        "softmax_scale",
    }, keywords
    assert "window_size" in source and "softcap" in source


def test_installing_the_hook_enables_paged_mode(cuda: None) -> None:
    from exlq.worker.engines.exllamav2.attention import install_attention, padding_supported

    assert install_attention("exlq") == "exlq"
    attn = importlib.import_module("exllamav2.attn")
    assert attn.flash_attn_with_kvcache.__module__ == "exlq.worker.engines.exllamav2.attention"
    assert padding_supported()
    assert attn.has_flash_attn is False  # unpaged paths must keep their own attention
    attn.assert_paged_attn()  # what ExLlamaV2DynamicGenerator(paged=True) checks
