"""Structured output's masks on CUDA logits (worker/engines/structured_output.py): the same
result as on the CPU from a pinned, an unpinned or a GPU bitmask, in each dtype an engine
samples from; masks filled by llguidance for a batch, then applied on the GPU."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from exlq.protocol.models import GenerationRequest
from tests.ws_tokenizer import EOS_TOKEN, make_tokenizer_folder

torch: Any = pytest.importorskip("torch")
pytest.importorskip("llguidance")

from exlq.worker.engines.structured_output import (  # noqa: E402 - torch and llguidance first
    GrammarCompiler,
    allocate_bitmask,
    apply_bitmask,
    fill_masks,
)

VOCAB = 32_003  # not a multiple of 32; the logits are wider still (a padded vocabulary)
WIDTH = 32_064


def _random_bitmask(rows: int, pin: bool) -> Any:
    bitmask = allocate_bitmask(rows, VOCAB, pin=pin)
    bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, bitmask.shape, dtype=torch.int32))
    return bitmask


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("where", ["pinned", "unpinned", "gpu"])
def test_a_mask_applied_on_the_gpu_is_the_cpus(cuda: None, dtype: str, where: str) -> None:
    rows = 37
    bitmask = _random_bitmask(rows + 3, pin=where == "pinned")  # more rows than logits
    assert bitmask.is_pinned() == (where == "pinned")
    logits = torch.randn(rows, WIDTH, dtype=getattr(torch, dtype))
    on_cpu = logits.clone()
    apply_bitmask(on_cpu, bitmask)
    on_gpu = logits.cuda()
    apply_bitmask(on_gpu, bitmask.cuda() if where == "gpu" else bitmask)
    assert torch.equal(on_gpu.cpu(), on_cpu)
    covered = 32 * bitmask.shape[1]  # llguidance leaves the bits past VOCAB unset
    assert (on_cpu[:, covered:] == -math.inf).all()  # past the mask
    kept = on_cpu[:, :covered] != -math.inf
    assert kept.any() and not kept.all()


def test_masks_filled_for_a_batch_keep_its_sampled_tokens_inside_the_grammar(
    cuda: None, tmp_path: Path
) -> None:
    import tokenizers

    folder = make_tokenizer_folder(tmp_path)
    tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = tokenizer.token_to_id(EOS_TOKEN)
    compiler = GrammarCompiler.from_tokenizer_json(folder / "tokenizer.json", 416, [eos])
    request = GenerationRequest(prompt="x", regex="(quick|lazy) (fox|dog)s?")
    jobs = [compiler.compile(request) for _ in range(16)]
    bitmask = allocate_bitmask(len(jobs), 416, pin=True)
    generator = torch.Generator(device="cuda").manual_seed(0)
    texts = [""] * len(jobs)
    for _ in range(40):
        live = [(job, row) for row, job in enumerate(jobs) if job is not None and not job.finished]
        if not live:
            break
        fill_masks(live, bitmask)
        logits = torch.randn(len(jobs), 416, device="cuda", generator=generator)
        apply_bitmask(logits, bitmask)
        tokens = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        for job, row in live:
            token = int(tokens[row])
            assert job.accept(token), job.error
            texts[row] += "" if token == eos else tokenizer.decode([token])
    assert all(job is not None and job.finished for job in jobs)
    assert all(text.split(" ")[0] in ("quick", "lazy") for text in texts)
