"""The exllamav2 engine's generation options and the plain parts behind them, without a GPU:
drafting and placement settings, logprobs from raw logits, the tensor-parallel attention
stand-in, and the check that llguidance reads a model's tokenizer as the model does."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

from exlq.worker.engines.exllamav2.settings import ExLlamaV2Settings

torch: Any = pytest.importorskip("torch")


def test_drafting_and_placement_settings() -> None:
    assert not ExLlamaV2Settings().drafting
    assert ExLlamaV2Settings(ngram_draft=True).drafting
    assert ExLlamaV2Settings(draft_model=Path("/m")).drafting
    assert ExLlamaV2Settings().gpu_split_gb is None
    assert ExLlamaV2Settings(gpu_split="20,12.5").gpu_split_gb == [20.0, 12.5]


def test_where_the_weights_sit_is_said_per_gpu() -> None:
    from types import SimpleNamespace

    from exlq.worker.engines.exllamav2.placement import where_loaded

    def module(device: int | None) -> SimpleNamespace:
        return SimpleNamespace(device_idx=device)

    # The embedding table on the CPU (-1) is not counted; the layers are, per GPU.
    split = SimpleNamespace(modules=[module(-1), module(0), module(0), module(1), module(1)])
    assert where_loaded(split) == "cuda:0 2 modules, cuda:1 2 modules"
    parallel = SimpleNamespace(modules=[], tp_context=SimpleNamespace(all_devs=[0, 1]))
    assert where_loaded(parallel) == "tensor parallel over cuda:0, cuda:1"


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"gpu_split": "20 GB"}, "gpu_split"),
        ({"gpu_split": "20,"}, "gpu_split"),
        ({"draft_tokens": 9}, "draft_tokens"),
        ({"draft_model": "/m", "ngram_draft": True}, "choose one way to draft"),
    ],
)
def test_bad_options_are_refused_naming_them(options: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        ExLlamaV2Settings(**options)


def test_logprobs_are_the_raw_distributions_with_the_chosen_token_last() -> None:
    from exlq.worker.engines.exllamav2.logprobs import MIN_LOGPROB, token_choices, top_logprobs

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 50.0], [0.0, 3.0, 1.0, float("-inf"), 9.0]])
    # Column 4 is the output layer's padding: never reported, though its logit is largest.
    ids, values = top_logprobs(logits, torch.tensor([3, 3]), 2, vocab_size=4)
    assert ids.tolist() == [[0, 1, 3], [1, 2, 3]]
    expected = torch.log_softmax(logits[0, :4], dim=-1)
    assert values[0].tolist() == pytest.approx([float(expected[i]) for i in (0, 1, 3)])
    assert values[1, 2] == MIN_LOGPROB  # -inf has no JSON form
    pieces = ["a", "b", "c", "d"]
    first, second = token_choices(ids[None, :, :], values[None, :, :], pieces)
    assert [t.token for t in first.top] == ["a", "b", "d"]  # chosen "d" listed last
    assert math.isclose(first.top[0].logprob, float(expected[0]), rel_tol=1e-6)
    ids, values = top_logprobs(logits, torch.tensor([0, 1]), 2, vocab_size=4)
    first, second = token_choices(ids[None, :, :], values[None, :, :], pieces)
    assert [t.token for t in first.top] == ["a", "b"]  # chosen among the top: not twice
    assert [t.token for t in second.top] == ["b", "c"]


def test_the_tensor_parallel_stand_in_runs_exlqs_kernel_into_the_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from exlq.worker.engines.exllamav2 import placement
    from exlq.worker.kernels import paged_attention

    calls: list[dict[str, Any]] = []

    def kernel(q: Any, k_cache: Any, v_cache: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return q * 2

    monkeypatch.setattr(paged_attention, "paged_attention_with_kvcache", kernel)
    monkeypatch.delitem(sys.modules, "flash_attn_2_cuda", raising=False)
    monkeypatch.setattr(
        "exlq.worker.engines.exllamav2.attention.flash_attn_available", lambda: False
    )
    placement.install_tp_attention()
    module = sys.modules.pop("flash_attn_2_cuda")
    q, out = torch.ones(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)
    seqlens, table = torch.tensor([5]), torch.zeros(1, 3, dtype=torch.int32)
    # As exllamav2's C++ calls it: positionally, flash-attn 2's order.
    result = module.fwd_kvcache(
        q, "kc", "vc", "k", "v", seqlens, None, None, None, None, table, None, out,
        0.125, True, 10_000_000, -1, 0.0, True, 0,
    )  # fmt: skip
    assert result[0] is out and torch.equal(out, q * 2)
    (kwargs,) = calls
    assert kwargs["k"] == "k" and kwargs["block_table"] is table
    assert kwargs["cache_seqlens"] is seqlens and kwargs["softmax_scale"] == 0.125
    assert kwargs["window_size"] == (10_000_000, -1) and kwargs["causal"] is True


def test_llguidance_must_read_the_tokenizer_as_the_model_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("llguidance")
    from tokenizers import Tokenizer

    from exlq.worker.engines.structured_output import PROBE_TEXT, model_grammar_compiler
    from tests.ws_tokenizer import make_tokenizer_folder

    folder = make_tokenizer_folder(tmp_path)
    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))

    class ModelTokenizer:  # exllamav2's encode(), over the same tokenizer.json
        def __init__(self, shift: int = 0) -> None:
            self.shift = shift

        def encode(self, text: str, **_: Any) -> Any:
            ids = [(i + self.shift) % hf.get_vocab_size() for i in hf.encode(text).ids]
            return torch.tensor([ids])

    vocab = hf.get_vocab_size()
    assert model_grammar_compiler(folder, ModelTokenizer(), vocab, [0]) is not None
    assert PROBE_TEXT.encode() == bytes(
        model_grammar_compiler(folder, ModelTokenizer(), vocab, [0]).decode_bytes(  # type: ignore[union-attr]
            hf.encode(PROBE_TEXT).ids
        )
    )
    # A model whose ids mean other text than llguidance reads: structured output off.
    assert model_grammar_compiler(folder, ModelTokenizer(shift=7), vocab, [0]) is None
    assert "structured output off" in caplog.text
