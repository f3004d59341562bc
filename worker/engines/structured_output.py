"""Structured output for the engines that constrain it (transformers, exllamav2, exllamav3):
a request's OutputConstraint compiled into a per-job token constraint (llguidance), the masks
of a step's constrained jobs filled together, and a mask applied to a batch's logits.

llguidance's Rust core computes a job's mask from its grammar's state, with no per-schema
step that blocks the engine; full JSON Schema, regular expressions and Lark grammars. It and
torch are imported only when an engine builds a GrammarCompiler (at load) or fills masks.

A job's grammar allows the end-of-text token only where its output is complete, and nothing
else once nothing more may follow (``finished``): an engine ends a constrained job "stop" on
either. That holds with ``ignore_eos`` too: the grammar decides where a constrained output
ends, so an engine keeps the end-of-text token as a stop for such a job.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exlq.protocol.models import InvalidRequest, OutputConstraint
from exlq.worker.engines.engine_request import EngineRequest

if TYPE_CHECKING:
    import llguidance
    import torch
    from llguidance._lib import JsonCompileOptions

MASK_BITS = 32  # tokens per int32 word of a bitmask row
# Compiled grammars kept per compiler, by constraint: a burst's jobs mostly share one schema,
# and copying a compiled matcher costs microseconds where compiling costs a millisecond
# (far more for a large schema). A job's matcher is always a copy: it holds the job's state.
COMPILED_GRAMMARS = 64
# JSON output as OpenAI writes it: compact, no free whitespace between tokens. A small model
# allowed any whitespace can fill max_new_tokens with newlines and never close the object.
# A schema's own "x-guidance" member overrides these (llguidance's compile options), e.g.
# {"x-guidance": {"whitespace_flexible": true}} or {"x-guidance": {"lenient": true}}.
log = logging.getLogger(__name__)

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
ANY_OBJECT = '{"type": "object"}'


def mask_words(vocab_size: int) -> int:
    """The int32 words of one bitmask row for ``vocab_size`` tokens."""
    return -(-vocab_size // MASK_BITS)


class TokenConstraint:
    """One job's grammar state: which tokens may come next, advanced by each token the job
    takes. Used on one thread (the engine's)."""

    __slots__ = ("_matcher", "words")

    def __init__(self, matcher: llguidance.LLMatcher, words: int) -> None:
        self._matcher = matcher
        self.words = words  # the bitmask row's width in int32 words

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32, CPU, one bit a
        token; the end-of-text token only where the output so far is complete)."""
        _check_rows(bitmask, self.words, [row])
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), self.words * 4)

    def accept(self, token_id: int) -> bool:
        """Advance past the job's new token; False if the grammar does not allow it (then
        ``error`` says why, and the constraint allows nothing more)."""
        return bool(self._matcher.consume_token(token_id))

    def rollback(self, tokens: int) -> bool:
        """Take back the last ``tokens`` accepted tokens (an engine that rewinds a job's
        output, for a banned string); False if the grammar state cannot go back so far."""
        return bool(self._matcher.rollback(tokens))

    @property
    def finished(self) -> bool:
        """Nothing more may follow: the grammar is complete (or broken, see ``error``)."""
        return bool(self._matcher.is_stopped())

    @property
    def allows_end(self) -> bool:
        """The output so far is complete: the end-of-text token may come next."""
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str:
        """Why the constraint broke (a token it did not allow); empty while it holds."""
        return str(self._matcher.get_error())


class GrammarCompiler:
    """Compiles requests' constraints for one tokenizer and one width of logits. Built once
    per engine (the tokenizer's conversion takes a fraction of a second); used on the
    engine's thread."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int) -> None:
        import llguidance

        self._llguidance = llguidance
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the mask's width in tokens
        self.words = mask_words(vocab_size)
        # Messages name the request's field and say what is wrong, without the grammar
        # llguidance built around it.
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._compiled: OrderedDict[OutputConstraint, llguidance.LLMatcher] = OrderedDict()

    @classmethod
    def from_tokenizer_json(
        cls, path: Path, vocab_size: int, eos_ids: Sequence[int]
    ) -> GrammarCompiler:
        """From a Hugging Face tokenizer.json file."""
        return cls._from_json(path.read_text(encoding="utf-8"), vocab_size, eos_ids)

    @classmethod
    def from_hf_tokenizer(
        cls, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]
    ) -> GrammarCompiler:
        """From a transformers tokenizer backed by the tokenizers library (a fast one; one
        loaded from a GGUF file is). As llguidance.hf.from_tokenizer reads it (its JSON,
        added tokens included), with the decoder made readable as for a file."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                "llguidance reads only tokenizers of the tokenizers library (fast tokenizers)"
            )
        backend = copy.copy(backend)  # padding and truncation off in the copy only
        backend.no_padding()
        backend.no_truncation()
        return cls._from_json(backend.to_str(), vocab_size, eos_ids)

    @classmethod
    def _from_json(cls, text: str, vocab_size: int, eos_ids: Sequence[int]) -> GrammarCompiler:
        import llguidance

        tokenizer = llguidance.LLTokenizer(
            readable_tokenizer_json(text), n_vocab=vocab_size, eos_token=list(eos_ids)
        )
        return cls(tokenizer, vocab_size)

    def decode_bytes(self, token_ids: Sequence[int]) -> bytes:
        """The bytes these tokens stand for, as llguidance reads the tokenizer (an engine
        may check that this agrees with its own tokenizer before it trusts the masks)."""
        return bytes(self._tokenizer.decode_bytes(list(token_ids)))

    def compile(self, request: EngineRequest) -> TokenConstraint | None:
        """The request's constraint, ready for its first token; None when it has none.
        Raises InvalidRequest naming the field when the schema or regex cannot be compiled."""
        constraint = request.constraint
        if constraint is None:
            return None
        compiled = self._compiled.get(constraint)
        if compiled is None:
            compiled = self._compile(constraint)
            self._compiled[constraint] = compiled
            if len(self._compiled) > COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(constraint)
        return TokenConstraint(compiled.deep_copy(), self.words)

    def _compile(self, constraint: OutputConstraint) -> llguidance.LLMatcher:
        try:
            grammar = self._grammar(constraint)
        except ValueError as exc:  # a schema that is no JSON object (not from the wire)
            raise InvalidRequest(f"{constraint.field}: {exc}") from None
        matcher = self._llguidance.LLMatcher(
            self._tokenizer, grammar, log_level=0, limits=self._limits
        )
        if matcher.is_error():
            raise InvalidRequest(f"{constraint.field}: {_plain_error(matcher.get_error())}")
        return matcher

    def _grammar(self, constraint: OutputConstraint) -> str:
        matcher = self._llguidance.LLMatcher
        if constraint.kind == "regex":
            return str(matcher.grammar_from_regex(constraint.source))
        source = ANY_OBJECT if constraint.kind == "json_object" else constraint.source
        if not isinstance(json.loads(source), dict):
            raise ValueError("a JSON Schema here is an object")
        return str(matcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS))


def model_grammar_compiler(
    model: Path, tokenizer: Any, vocab_size: int, eos_ids: list[int]
) -> GrammarCompiler | None:
    """The compiler of the requests' grammars for this model's tokenizer.json; None (and
    structured output refused) without llguidance or that file."""
    tokenizer_json = model / "tokenizer.json"
    if importlib.util.find_spec("llguidance") is None or not tokenizer_json.exists():
        log.info("structured output off: needs llguidance and the model's tokenizer.json")
        return None
    compiler = GrammarCompiler.from_tokenizer_json(tokenizer_json, vocab_size, eos_ids)
    return compiler if reads_alike(compiler, tokenizer) else None


# Text whose tokens a grammar library must read back byte for byte: quotes, braces, spaces,
# a newline and a tab, digits and a character outside ASCII.
PROBE_TEXT = '{"name": "Zoë", "list": [1, 2]}\n\t x'


def reads_alike(compiler: GrammarCompiler, tokenizer: Any) -> bool:
    """Whether llguidance reads the model's tokens as the model's tokenizer writes them. A
    tokenizer.json it misreads (a byte-level vocabulary taken for literal text, say) would
    let a mask allow what the grammar forbids; structured output is then refused."""
    ids = tokenizer.encode(PROBE_TEXT, add_bos=False, encode_special_tokens=False)[0].tolist()
    read = compiler.decode_bytes(ids)
    if read != PROBE_TEXT.encode():
        log.warning(
            "structured output off: llguidance reads this model's tokenizer.json otherwise "
            "than its tokenizer (%r for %r)",
            read[:60],
            PROBE_TEXT,
        )
        return False
    return True


def readable_tokenizer_json(text: str) -> str:
    """A tokenizer.json as llguidance reads it. transformers 5 saves a byte-level vocabulary
    converted from a GGUF file with its ByteLevel decoder inside a Sequence of decoders
    (ByteFallback, Fuse, Replace, ByteLevel); llguidance then takes the tokens for literal
    text ("\u010a" for a newline), and its masks would allow what a grammar forbids. The
    ByteLevel decoder alone says the same of such a vocabulary."""
    config = json.loads(text)
    decoder = config.get("decoder") or {}
    if decoder.get("type") != "Sequence":
        return text
    byte_level = [d for d in decoder.get("decoders", []) if d.get("type") == "ByteLevel"]
    if not byte_level:
        return text
    config["decoder"] = byte_level[0]
    return json.dumps(config)


def _plain_error(message: str) -> str:
    """llguidance's message without the grammar it wrapped a regex in: a regex error comes
    as 'at 1(8): invalid regex ... (in regex): regex parse error: <the error>' followed by
    the Lark line ('1 | start: /.../'), which the request never held."""
    start = message.find(_REGEX_ERROR)
    if start >= 0:
        message = message[start:]
        end = message.find(_LARK_LINE)
        message = message if end < 0 else message[:end]
    return message.rstrip()


_REGEX_ERROR = "regex parse error"
_LARK_LINE = "\n   1 | "


def allocate_bitmask(rows: int, vocab_size: int, pin: bool = False) -> torch.Tensor:
    """A bitmask of ``rows`` rows for ``vocab_size`` tokens, every token allowed (-1: all
    bits set). ``pin``: in page-locked memory, so that its copy to a GPU need not wait (only
    where torch sees CUDA)."""
    import torch

    pin = pin and torch.cuda.is_available()
    return torch.full((rows, mask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)


def fill_masks(constraints: Sequence[tuple[TokenConstraint, int]], bitmask: torch.Tensor) -> None:
    """Fill many jobs' rows at once: (constraint, row) pairs. llguidance's executor computes
    them on its own threads with the GIL released; one job's goes straight to its matcher."""
    if not constraints:
        return
    if len(constraints) == 1:
        constraint, row = constraints[0]
        constraint.fill_mask(bitmask, row)
        return
    words = constraints[0][0].words
    if any(constraint.words != words for constraint, _ in constraints):
        raise ValueError("constraints of different vocabularies share one bitmask")
    _check_rows(bitmask, words, [row for _, row in constraints])
    _executor().unsafe_compute_mask_ptr(
        [(constraint._matcher, row) for constraint, row in constraints],
        bitmask.data_ptr(),
        words * 4,
        bitmask.shape[0],
    )


@functools.cache
def _executor() -> llguidance.LLExecutor:
    """One per process: llguidance's pool of mask threads (its default size)."""
    import llguidance

    return llguidance.LLExecutor()


def _check_rows(bitmask: torch.Tensor, words: int, rows: Sequence[int]) -> None:
    # llguidance writes through a raw pointer: a wrong shape would write past the tensor.
    import torch

    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device.type != "cpu":
        raise ValueError("a bitmask is a 2-D int32 tensor on the CPU")
    if bitmask.shape[1] != words or not bitmask.is_contiguous():
        raise ValueError(f"a bitmask row here is {words} contiguous int32 words")
    if any(not 0 <= row < bitmask.shape[0] for row in rows):
        raise ValueError(f"a row outside the bitmask's {bitmask.shape[0]} rows")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: each row of ``logits`` (rows, width) gets -inf at the tokens its row of
    ``bitmask`` disallows, and in the columns past the mask's tokens (a model's padded
    vocabulary). Plain torch ops, on the logits' device: no compile step to wait for at the
    first constrained job. A CPU bitmask is copied there (without a wait where it is pinned)."""
    rows, width = logits.shape
    if bitmask.shape[0] < rows:
        raise ValueError(f"a bitmask of {bitmask.shape[0]} rows for {rows} rows of logits")
    mask = bitmask[:rows]
    if mask.device != logits.device:
        mask = mask.to(logits.device, non_blocking=mask.is_pinned())
    # (rows, words, 32): bit b of each word, token 32 * word + b.
    allowed = (mask.unsqueeze(-1) & _bit_values(logits.device)) != 0
    allowed = allowed.view(rows, -1)
    covered = min(width, allowed.shape[1])
    logits[:, :covered].masked_fill_(~allowed[:, :covered], float("-inf"))
    if width > covered:
        logits[:, covered:] = float("-inf")


@functools.cache
def _bit_values(device: torch.device) -> torch.Tensor:
    """1 << b for b in 0..31 as int32 (bit 31 is the sign bit), on ``device``."""
    import torch

    return torch.tensor(
        [1 << bit if bit < 31 else -(1 << 31) for bit in range(MASK_BITS)],
        dtype=torch.int32,
        device=device,
    )
