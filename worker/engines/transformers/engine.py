"""TransformersEngine: the only module the worker calls that runs a transformers model.

A step prefills the jobs added since the last one (together, in one pass) and decodes every
running job by one token (together, in one pass over the left-padded batch, batch.py); then
the rows of constrained jobs (response_format, regex) are masked to what their grammars
allow (constrained.py), each job picks its token with its own sampler and its own random
generator (sampling.py), and its text goes out as far as it is whole and cannot begin a
stop string (text_stream.py). Jobs join and leave the batch between steps.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any

from exlq.protocol.models import FinishReason, InvalidRequest, TokenChoices, TokenLogprob
from exlq.worker.engines.base import (
    CacheUsage,
    Engine,
    EngineOutput,
    EngineUnavailable,
    JobEnded,
    JobErrored,
    TokenChunk,
    reset_gpu_engine,
)
from exlq.worker.engines.engine_request import EngineRequest
from exlq.worker.engines.registry import LoadRequest
from exlq.worker.engines.structured_output import TokenConstraint
from exlq.worker.engines.transformers.batch import ModelCall, PaddedBatch
from exlq.worker.engines.transformers.constrained import Constraints
from exlq.worker.engines.transformers.load import LoadedModel, load_model
from exlq.worker.engines.transformers.prompt import prompt_ids
from exlq.worker.engines.transformers.sampling import JobSampler, top_logprobs
from exlq.worker.engines.transformers.settings import TransformersSettings
from exlq.worker.engines.transformers.text_stream import TextStream

log = logging.getLogger(__name__)

# cache_usage() counts in pages of this many tokens, as the paged engines do.
PAGE_TOKENS = 256
# A job's length limit where neither the settings nor the model's config give one.
FALLBACK_CONTEXT = 4096
MIN_LOGPROB = math.log(1e-30)


def load_transformers_engine(request: LoadRequest) -> TransformersEngine:
    options = request.options
    assert isinstance(options, TransformersSettings)
    if request.model is None:
        raise EngineUnavailable("the transformers engine needs --model PATH")
    return TransformersEngine(load_model(request.model, options), request.max_batch_size, options)


@dataclass(eq=False)
class _Job:
    job_id: str
    request: EngineRequest
    prompt: list[int]
    sampler: JobSampler
    text: TextStream
    stop_ids: frozenset[int]
    constraint: TokenConstraint | None  # the grammar its output follows, if any
    completion_tokens: int = 0
    next_input: int = -1  # the token chosen last, which the next step feeds the model
    # Tokens whose text has not gone out yet (held back, or half a character), and their
    # logprobs if the job asked: they go out with the next text.
    unsent_ids: list[int] = field(default_factory=list)
    unsent_choices: list[TokenChoices] = field(default_factory=list)


class TransformersEngine(Engine):
    name = "transformers"

    def __init__(self, loaded: LoadedModel, capacity: int, settings: TransformersSettings) -> None:
        import torch

        self._torch = torch
        self.loaded = loaded
        self.capacity = capacity
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        model = loaded.model
        # The ids a prompt may hold, and the width of a row of logits (a model may pad one).
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.logits_width = int(model.get_output_embeddings().weight.shape[0])
        limits = [n for n in (settings.max_seq_len, loaded.context_tokens) if n]
        self.max_seq_len = min(limits) if limits else FALLBACK_CONTEXT
        self.prefill_batch_tokens = settings.prefill_batch_tokens
        self._eos_ids = _eos_ids(model, self.tokenizer)
        self._constraints = Constraints(self.tokenizer, self.logits_width, self._eos_ids)
        self._batch = PaddedBatch(ModelCall(model), self.device)
        self._waiting: list[_Job] = []  # added, not yet prefilled, in order
        self._jobs: dict[str, _Job] = {}  # every job, waiting or running
        self._pieces: dict[int, str] = {}  # token texts, for logprobs
        # Seeds for the jobs that bring none: independent streams, not secrets.
        self._seeds = random.Random()
        log.info(
            "transformers ready: %s, capacity %d, %d tokens a job, %s",
            loaded.files.directory / (loaded.files.gguf_file or ""),
            capacity,
            self.max_seq_len,
            ", ".join(f"{name} {value}" for name, value in self.info().items()),
        )

    def info(self) -> dict[str, str]:
        model = self.loaded.model
        details = {
            "device": str(self.device),
            "dtype": str(model.dtype).removeprefix("torch."),
            "format": self.loaded.files.format,
            "attention": str(getattr(model.config, "_attn_implementation", "unknown")),
        }
        if self.device.type == "cpu":
            details["threads"] = str(self._torch.get_num_threads())
        return details

    # -- jobs ---------------------------------------------------------------------------

    def add(self, job_id: str, request: EngineRequest) -> None:
        if request.banned_strings:
            raise InvalidRequest("banned_strings: the transformers engine does not support them")
        ids = prompt_ids(request, self.tokenizer, self.vocab_size)
        if len(ids) + request.max_new_tokens > self.max_seq_len:
            raise InvalidRequest(
                f"prompt ({len(ids)} tokens) plus max_new_tokens ({request.max_new_tokens}) "
                f"exceeds the {self.max_seq_len} tokens this worker can hold for one job: "
                "shorten the prompt or lower max_new_tokens"
            )
        constraint = self._constraints.compile(request)
        seed = request.sampling.seed
        job = _Job(
            job_id,
            request,
            ids,
            JobSampler(
                request.sampling,
                self._seeds.getrandbits(63) if seed is None else seed,
                ids,
                self.logits_width,
                self.device,
            ),
            TextStream(self._decode, request.stop, ids),
            self._stop_ids(request),
            constraint,
        )
        self._waiting.append(job)
        self._jobs[job_id] = job

    def _stop_ids(self, request: EngineRequest) -> frozenset[int]:
        # A constrained output ends where its grammar says, ignore_eos or not: its grammar
        # allows the end-of-text token only there.
        keep_going = request.ignore_eos and request.constraint is None
        eos = frozenset() if keep_going else self._eos_ids
        return frozenset(request.stop_token_ids) | eos

    def cancel(self, job_id: str) -> JobEnded | None:
        job = self._jobs.pop(job_id, None)
        if job is None:
            return None
        if job in self._waiting:
            self._waiting.remove(job)
        else:
            with self._torch.inference_mode():
                self._batch.drop({job_id})
        return JobEnded(job_id, "cancelled", len(job.prompt), job.completion_tokens)

    def abort_all(self) -> list[str]:
        ids = list(self._jobs)
        self._jobs.clear()
        self._waiting.clear()
        if self.device.type == "cuda":
            reset_gpu_engine(self._batch.clear, self._torch)
        else:
            self._batch.clear()
        return ids

    @property
    def active_jobs(self) -> int:
        return len(self._jobs)

    def cache_usage(self) -> CacheUsage:
        total = -(-self.capacity * self.max_seq_len // PAGE_TOKENS)
        used = -(-self._batch.tokens_held // PAGE_TOKENS)
        return CacheUsage(min(used, total), total)

    def close(self) -> None:
        self._jobs.clear()
        self._waiting.clear()
        self._batch.clear()
        if self.device.type == "cuda":
            self._torch.cuda.empty_cache()

    # -- a step -------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        with self._torch.inference_mode():
            rows, logits = self._forward()
            if logits is None:
                return []
            # Filled once the forward pass is queued: on a GPU the masks are computed while
            # it runs (they depend only on the tokens already taken).
            masked = self._constraints.masked_rows(
                [(row, job.constraint) for row, job in enumerate(rows) if job.constraint],
                logits,
            )
            tokens = self._choose(rows, logits, masked)
            outputs: list[EngineOutput] = []
            ended: set[str] = set()
            for row, (job, token) in enumerate(zip(rows, tokens, strict=True)):
                # The model's own distribution, before the mask (as before penalties).
                choices = self._choices(logits[row], token, job.request.logprobs)
                if self._advance(job, token, choices, outputs):
                    ended.add(job.job_id)
            self._batch.drop(ended)
        for job_id in ended:
            del self._jobs[job_id]
        return outputs

    def _forward(self) -> tuple[list[_Job], Any]:
        """Decode the running jobs and prefill the jobs that start: the jobs in batch row
        order, and their logits (None if there were none)."""
        rows = [self._jobs[job_id] for job_id in self._batch.rows]
        parts = []
        if rows:
            parts.append(self._batch.decode([job.next_input for job in rows]))
        starting = self._startable()
        if starting:
            ids = [job.job_id for job in starting]
            parts.append(self._batch.prefill(ids, [job.prompt for job in starting]))
            rows += starting
        if not parts:
            return rows, None
        return rows, self._torch.cat(parts)

    def _startable(self) -> list[_Job]:
        """The waiting jobs this step prefills, in order: as many as fit the prefill budget
        (rows times the longest prompt), and always the first."""
        taken: list[_Job] = []
        width = 0
        for job in self._waiting:
            wider = max(width, len(job.prompt))
            if taken and (len(taken) + 1) * wider > self.prefill_batch_tokens:
                break
            taken.append(job)
            width = wider
        del self._waiting[: len(taken)]
        return taken

    def _choose(self, rows: list[_Job], logits: Any, masked: dict[int, Any]) -> list[int]:
        """Every row's next token. Plain greedy rows are read from one argmax of the whole
        batch (one transfer from the device), the others each from their own sampler; a
        constrained row from its masked logits."""
        greedy = logits.argmax(dim=-1).tolist()
        tokens = []
        for row, job in enumerate(rows):
            sampler = job.sampler
            scores = masked.get(row)
            if scores is not None:
                token = int(scores.argmax()) if sampler.plain_greedy else sampler.choose(scores)
            else:
                token = greedy[row] if sampler.plain_greedy else sampler.choose(logits[row])
            sampler.chose(token)
            tokens.append(token)
        return tokens

    def _advance(
        self, job: _Job, token: int, choices: TokenChoices | None, outputs: list[EngineOutput]
    ) -> bool:
        """Take a job's new token; True if the job has ended."""
        job.completion_tokens += 1
        if token in job.stop_ids:  # its text is not part of the completion
            return self._end(job, "stop", job.text.finish(), outputs)
        if job.constraint is not None and not job.constraint.accept(token):
            return self._broke(job, outputs)
        job.unsent_ids.append(token)
        if choices is not None:
            job.unsent_choices.append(choices)
        text = job.text.push(token)
        if job.text.stopped:
            return self._end(job, "stop", text, outputs)
        if job.constraint is not None and job.constraint.finished:
            # Its grammar is complete and allows nothing more (a JSON value closed).
            return self._end(job, "stop", text + job.text.finish(), outputs)
        if job.completion_tokens >= job.request.max_new_tokens:
            text += job.text.finish()  # the held-back tail may still complete a stop string
            return self._end(job, "stop" if job.text.stopped else "length", text, outputs)
        if text:
            outputs.append(self._chunk(job, text))
        job.next_input = token
        return False

    def _end(self, job: _Job, reason: FinishReason, text: str, outputs: list[EngineOutput]) -> bool:
        if text or job.unsent_ids:
            outputs.append(self._chunk(job, text))
        outputs.append(JobEnded(job.job_id, reason, len(job.prompt), job.completion_tokens))
        return True

    def _broke(self, job: _Job, outputs: list[EngineOutput]) -> bool:
        """A token its mask did not allow (a sampler's fault): the job fails."""
        error = job.constraint.error if job.constraint is not None else ""
        outputs.append(
            JobErrored(job.job_id, "engine_error", f"the output broke its constraint: {error}")
        )
        return True

    def _chunk(self, job: _Job, text: str) -> TokenChunk:
        chunk = TokenChunk(job.job_id, text, job.unsent_ids, job.unsent_choices or None)
        job.unsent_ids = []
        job.unsent_choices = []
        return chunk

    def _choices(self, logits: Any, token: int, count: int) -> TokenChoices | None:
        if not count:
            return None
        return TokenChoices(
            top=[
                # JSON has no -inf: a token the model rules out gets log(1e-30), as exllamav2's.
                TokenLogprob(
                    token=self._piece(token_id),
                    token_id=token_id,
                    logprob=max(logprob, MIN_LOGPROB),
                )
                for token_id, logprob in top_logprobs(logits, token, count)
            ]
        )

    def _piece(self, token_id: int) -> str:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._decode([token_id])
        return piece

    def _decode(self, ids: Any) -> str:
        text: str = self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        return text


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """The end-of-text tokens: the tokenizer's and the generation config's (a chat model's
    end-of-turn token may be only there)."""
    found: set[int] = set()
    config = getattr(model, "generation_config", None)
    for ids in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(ids, int):
            found.add(ids)
        elif isinstance(ids, list):
            found.update(i for i in ids if isinstance(i, int))
    return frozenset(found)
