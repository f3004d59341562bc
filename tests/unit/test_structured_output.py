"""Structured output's shared module (worker/engines/structured_output.py) on a small
byte-level tokenizer: constraints compiled or refused naming the request's field, masks
filled one by one and together, and masks applied to logits on the CPU."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from exlq.protocol.models import GenerationRequest, InvalidRequest
from tests.ws_tokenizer import EOS_TOKEN, make_tokenizer_folder

torch = pytest.importorskip("torch")
pytest.importorskip("llguidance")
tokenizers = pytest.importorskip("tokenizers")

from exlq.worker.engines.structured_output import (  # noqa: E402 - torch and llguidance first
    GrammarCompiler,
    TokenConstraint,
    allocate_bitmask,
    apply_bitmask,
    fill_masks,
    mask_words,
)

# Wider than the tokenizer (a model's padded vocabulary): the mask's width, and not a multiple
# of 32, so the last word has bits past it.
VOCAB = 403


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(folder: Path) -> Any:
    return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def eos(tokenizer: Any) -> int:
    eos_id: int = tokenizer.token_to_id(EOS_TOKEN)
    return eos_id


@pytest.fixture
def compiler(folder: Path, eos: int) -> GrammarCompiler:
    return GrammarCompiler.from_tokenizer_json(folder / "tokenizer.json", VOCAB, [eos])


def request(**fields: Any) -> GenerationRequest:
    return GenerationRequest.model_validate({"prompt": "x", **fields})


def schema_request(schema: dict[str, Any]) -> GenerationRequest:
    return request(response_format={"type": "json_schema", "json_schema": {"schema": schema}})


def encode(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False).ids
    return ids


def allowed(constraint: TokenConstraint) -> set[int]:
    bitmask = allocate_bitmask(1, VOCAB)
    constraint.fill_mask(bitmask, 0)
    return tokens_of(bitmask[0])


def tokens_of(row: Any) -> set[int]:
    words = [w & 0xFFFFFFFF for w in row.tolist()]
    return {32 * i + bit for i, w in enumerate(words) for bit in range(32) if w >> bit & 1}


def walk(compiler: GrammarCompiler, tokenizer: Any, req: GenerationRequest, text: str) -> Any:
    constraint = compiler.compile(req)
    assert constraint is not None
    for token in encode(tokenizer, text):
        assert token in allowed(constraint)
        assert constraint.accept(token), constraint.error
    return constraint


# -- compiling ---------------------------------------------------------------------------


def test_a_request_without_a_constraint_compiles_to_none(compiler: GrammarCompiler) -> None:
    assert compiler.compile(request()) is None
    assert compiler.compile(request(response_format={"type": "text"})) is None
    assert compiler.vocab_size == VOCAB


def test_the_compiler_reads_tokens_as_the_tokenizer_does(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    text = "The quick brown fox, héllo 🦊"
    assert compiler.decode_bytes(encode(tokenizer, text)) == text.encode()


def test_a_byte_level_vocabulary_behind_a_sequence_of_decoders_reads_as_bytes(
    folder: Path, tmp_path: Path, tokenizer: Any, eos: int
) -> None:
    # As transformers 5 saves a tokenizer converted from a GGUF file: read as it is, the
    # byte-level tokens would be literal text to llguidance ("\u010a" for a newline).
    config = json.loads((folder / "tokenizer.json").read_text())
    config["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            config["decoder"],
        ],
    }
    saved = tmp_path / "tokenizer.json"
    saved.write_text(json.dumps(config))
    text = "The quick\nfox"
    ids = encode(tokenizer, text)
    read = GrammarCompiler.from_tokenizer_json(saved, VOCAB, [eos])
    assert read.decode_bytes(ids) == text.encode()
    in_memory = tokenizers.Tokenizer.from_str(json.dumps(config))
    assert in_memory.decode(ids) == text  # the tokenizer itself reads it so


def test_a_tokenizer_without_a_rust_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="fast tokenizers"):
        GrammarCompiler.from_hf_tokenizer(object(), VOCAB, [0])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"regex": "("}, "regex: regex parse error"),
        ({"regex": "a(?=b)"}, "regex: regex parse error"),  # look-around: not a DFA's
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "frobnicate"}},
                }
            },
            "response_format.json_schema.schema: Invalid type: frobnicate",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"$ref": "#/$defs/nope"}},
                }
            },
            "response_format.json_schema.schema: Pointer '/$defs/nope' does not exist",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "string", "minLength": 5, "maxLength": 2}},
                }
            },
            "response_format.json_schema.schema: Unsatisfiable schema",
        ),
    ],
)
def test_what_llguidance_cannot_compile_is_refused_naming_the_field(
    compiler: GrammarCompiler, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        compiler.compile(request(**fields))
    assert str(caught.value).startswith(message)
    assert "start:" not in str(caught.value)  # not the grammar llguidance wrapped it in


def test_a_regex_holds_the_output_to_a_full_match(
    compiler: GrammarCompiler, tokenizer: Any, eos: int
) -> None:
    constraint = compiler.compile(request(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"))
    assert constraint is not None
    first = allowed(constraint)
    assert first and eos not in first
    assert all(tokenizer.decode([t])[0].isdigit() for t in first)
    assert not constraint.allows_end and not constraint.finished
    for token in encode(tokenizer, "2024-05-17"):
        assert token in allowed(constraint)
        assert constraint.accept(token)
    assert constraint.allows_end and constraint.finished
    assert allowed(constraint) == {eos}  # the end of text alone


def test_a_token_the_grammar_does_not_allow_breaks_the_constraint(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    constraint = compiler.compile(request(regex=r"[0-9]+"))
    assert constraint is not None
    (letter,) = encode(tokenizer, "a")
    assert letter not in allowed(constraint)
    assert not constraint.accept(letter)
    assert constraint.error and constraint.finished


def test_json_object_takes_any_object_and_nothing_else(
    compiler: GrammarCompiler, tokenizer: Any, eos: int
) -> None:
    req = request(response_format={"type": "json_object"})
    done = walk(compiler, tokenizer, req, '{"quick":[1,"fox"],"lazy":{"dog":null}}')
    assert done.allows_end and done.finished
    fresh = compiler.compile(req)
    assert fresh is not None
    assert {tokenizer.decode([t]) for t in allowed(fresh)} == {"{"}


def test_a_schema_holds_the_output_to_it_written_compactly(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    schema = {
        "type": "object",
        "properties": {"word": {"enum": ["quick", "lazy"]}, "n": {"type": "integer"}},
        "required": ["word", "n"],
        "additionalProperties": False,
    }
    req = schema_request(schema)
    assert walk(compiler, tokenizer, req, '{"word":"lazy","n":12}').finished
    spaced = compiler.compile(req)
    assert spaced is not None
    for token in encode(tokenizer, '{"word":'):
        assert spaced.accept(token)
    (space,) = encode(tokenizer, " ")
    assert space not in allowed(spaced)  # no free whitespace (JSON_OPTIONS)
    # ... unless the schema asks for it (llguidance's own options).
    flexible = compiler.compile(
        schema_request({**schema, "x-guidance": {"whitespace_flexible": True}})
    )
    assert flexible is not None
    for token in encode(tokenizer, '{"word":'):
        assert flexible.accept(token)
    assert space in allowed(flexible)


def test_each_job_gets_its_own_state_of_a_shared_grammar(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    req = request(regex="(quick|lazy) (fox|dog)")
    first = compiler.compile(req)
    second = compiler.compile(req)
    assert first is not None and second is not None and first is not second
    before = allowed(second)
    for token in encode(tokenizer, "quick "):
        assert first.accept(token)
    assert allowed(second) == before != allowed(first)


# -- filling masks -------------------------------------------------------------------------


def test_masks_filled_together_are_the_masks_filled_one_by_one(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    texts = ['{"a":', '{"quick":[1,', '{"b":"fo', "{", '{"x":tr']
    constraints = []
    for text in texts:
        constraint = compiler.compile(request(response_format={"type": "json_object"}))
        assert constraint is not None
        for token in encode(tokenizer, text):
            assert constraint.accept(token)
        constraints.append(constraint)
    # Rows given out of order, one row left as it was.
    rows = [4, 0, 2, 1, 5]
    together = allocate_bitmask(6, VOCAB)
    fill_masks(list(zip(constraints, rows, strict=True)), together)
    for constraint, row in zip(constraints, rows, strict=True):
        assert tokens_of(together[row]) == allowed(constraint)
    assert (together[3] == -1).all()
    # Bits past the vocabulary are never set.
    assert max(tokens_of(together[0])) < VOCAB


def test_a_bitmask_of_the_wrong_shape_is_refused_before_llguidance_writes(
    compiler: GrammarCompiler,
) -> None:
    constraint = compiler.compile(request(regex="a"))
    assert constraint is not None
    words = mask_words(VOCAB)
    for bad in (
        torch.zeros((2, words - 1), dtype=torch.int32),
        torch.zeros((2, words), dtype=torch.int64),
        torch.zeros((2, 2 * words), dtype=torch.int32)[:, ::2],
        torch.zeros(words, dtype=torch.int32),
    ):
        with pytest.raises(ValueError):
            constraint.fill_mask(bad, 0)
    with pytest.raises(ValueError, match="row outside"):
        constraint.fill_mask(allocate_bitmask(2, VOCAB), 2)
    with pytest.raises(ValueError, match="row outside"):
        fill_masks([(constraint, 0), (constraint, 3)], allocate_bitmask(2, VOCAB))


# -- applying masks -------------------------------------------------------------------------


def test_apply_sets_disallowed_and_padding_columns_to_minus_infinity() -> None:
    width = 100  # logits wider than the mask's 64 tokens
    bitmask = torch.zeros((3, 2), dtype=torch.int32)
    bitmask[0, 0] = 0b1011  # tokens 0, 1, 3
    bitmask[0, 1] = -(2**31)  # bit 31 of word 1: token 63
    bitmask[1] = -1  # everything the mask covers
    bitmask[2, 1] = 1 << 4  # token 36
    logits = torch.randn(3, width)
    before = logits.clone()
    apply_bitmask(logits, bitmask)
    expected = [{0, 1, 3, 63}, set(range(64)), {36}]
    for row, kept in enumerate(expected):
        for token in range(width):
            value = float(logits[row, token])
            if token in kept:
                assert value == float(before[row, token])
            else:
                assert value == -math.inf


def test_apply_reads_only_the_bitmasks_first_rows_and_cuts_a_narrower_row() -> None:
    bitmask = allocate_bitmask(4, 40)  # 2 words, 64 bits; logits only 40 wide
    bitmask[0, 1] = 0  # tokens 32..63 off
    logits = torch.zeros(1, 40, dtype=torch.float16)
    apply_bitmask(logits, bitmask)
    assert (logits[0, :32] == 0).all() and (logits[0, 32:] == -math.inf).all()
    with pytest.raises(ValueError, match="rows"):
        apply_bitmask(torch.zeros(5, 40), bitmask)


# -- the transformers engine without a tokenizer llguidance reads ----------------------------


def test_an_engine_whose_tokenizer_llguidance_cannot_read_refuses_constraints_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from exlq.worker.engines.transformers.constrained import Constraints

    constraints = Constraints(object(), VOCAB, {0})  # no fast tokenizer: nothing to convert
    assert "constrained output is off" in caplog.text
    assert constraints.compile(request()) is None
    with pytest.raises(InvalidRequest) as caught:
        constraints.compile(request(regex="[0-9]+"))
    assert str(caught.value).startswith("regex: this worker cannot constrain output: ")
    assert "tokenizer" in str(caught.value)
