"""exlq's exllamav3 engine against exllamav3's own generator on a real model (SmolLM2-135M):
the same prompts, greedy, give the same text and token ids, and exlq's logprobs are the
log-softmax of the logits exllamav3 computes. (Both load the model with exlq's trim of the
MLP outputs, without which exllamav3 1.6.5 cannot load a hidden size of 576.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from exlq.protocol.models import GenerationRequest
from tests.gpu.engine_runs import run

PROMPTS = [
    "The lighthouse keeper looked at the sea and",
    "A list of the planets of the solar system:",
    "def fibonacci(n):",
    "Paris is the capital of",
]
NEW_TOKENS = 48


def own_generator_texts(
    model_dir: Path, eos_ids: list[int]
) -> tuple[dict[int, tuple[str, list[int]]], Any]:
    """exllamav3's own Generator, as its examples drive it: greedy, stopping at the end-of-text
    tokens; and the first prompt's logits, a row a token."""
    import torch
    from exllamav3 import ArgmaxSampler, Cache, Config, Generator, Job, Model, Tokenizer

    from exlq.worker.engines.exllamav3.engine import trim_mlp_outputs

    config = Config.from_directory(str(model_dir))
    model = Model.from_config(config)
    trim_mlp_outputs(model)
    cache = Cache(model, max_num_tokens=16_384)
    model.load()
    tokenizer = Tokenizer.from_config(config)
    generator = Generator(model, cache, tokenizer, max_batch_size=16)
    texts: dict[int, tuple[str, list[int]]] = {n: ("", []) for n in range(len(PROMPTS))}
    for n, prompt in enumerate(PROMPTS):
        generator.enqueue(
            Job(
                input_ids=tokenizer.encode(prompt, add_bos=True),
                max_new_tokens=NEW_TOKENS,
                sampler=ArgmaxSampler(),
                stop_conditions=list(eos_ids),
                return_logits=n == 0,
                identifier=n,
            )
        )
    logits = []
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["stage"] != "streaming":
                continue
            text, ids = texts[result["identifier"]]
            if result.get("logits") is not None:
                logits.append(result["logits"].view(-1, result["logits"].shape[-1]).float().cpu())
            ids_tensor = result.get("token_ids")
            texts[result["identifier"]] = (
                text + result.get("text", ""),
                ids + (ids_tensor.view(-1).tolist() if ids_tensor is not None else []),
            )
    generator.close()
    model.unload()
    return texts, torch.cat(logits)


def test_greedy_text_equals_exllamav3s_own_generator(smollm2: tuple[Path, Any, Any]) -> None:
    pytest.importorskip("exllamav3")
    import torch

    from exlq.worker.engines import build_engine
    from exlq.worker.settings import WorkerSettings

    model_dir = smollm2[0]
    settings = WorkerSettings.load(
        {"cache_tokens": 16_384}, engine="exllamav3", model=model_dir, max_batch_size=16
    )
    engine = build_engine("exllamav3", settings.load_request())
    try:
        requests = {
            str(n): GenerationRequest(
                prompt=prompt,
                max_new_tokens=NEW_TOKENS,
                sampling={"temperature": 0.0},
                logprobs=3 if n == 0 else 0,
            )
            for n, prompt in enumerate(PROMPTS)
        }
        out = run(engine, requests)
        got = {n: (out["texts"][str(n)], out["ids"][str(n)]) for n in range(len(PROMPTS))}
        choices = out["logprobs"]["0"]
        eos_ids = list(engine._eos_ids)  # type: ignore[attr-defined]
    finally:
        engine.close()
    own, own_logits = own_generator_texts(model_dir, eos_ids)
    for n in range(len(PROMPTS)):
        print(f"\n{PROMPTS[n]!r}: {got[n][0]!r}")
    assert got == own
    assert all(len(ids) > 8 for _, ids in got.values())
    assert len(choices) == len(got[0][1]) == own_logits.shape[0]
    for row, choice in zip(own_logits, choices, strict=True):
        expected = torch.log_softmax(row, dim=-1)
        for token in choice.top:
            assert abs(token.logprob - float(expected[token.token_id])) < 0.02
