"""ExLlamaV2Engine: the only module the worker calls that drives exllamav2's generator.

It runs the dynamic generator directly, not ExLlamaV2DynamicGeneratorAsync: the async
wrapper calls iterate() on the event loop (no Redis I/O while the GPU works) and its loop
ends for good on the first exception. The worker calls step() on a thread of its own and
turns exllamav2's result dicts into typed outputs here, so nothing else sees them. The
generator is exlq's subclass (GPU sampling, generator.py) with its decode step replayed
from CUDA graphs (graphs.py), unless settings turn them off.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exlq.protocol.models import (
    InvalidRequest,
    TokenChoices,
)
from exlq.worker.engines.base import (
    CacheUsage,
    Engine,
    EngineOutput,
    EngineUnavailable,
    JobEnded,
    JobErrored,
    PreparesJobs,
    TokenChunk,
    UsesDeviceWait,
    describe_error,
    reset_gpu_engine,
)
from exlq.worker.engines.chat_template import ChatFormatter, generation_eos_ids
from exlq.worker.engines.engine_request import EngineRequest, sampling_settings
from exlq.worker.engines.exllama_prompt import prompt_tensor
from exlq.worker.engines.exllama_results import ended_job
from exlq.worker.engines.exllamav2.build_queue import Accepted, BuildQueue, room_for_one_more
from exlq.worker.engines.exllamav2.placement import Drafting, Placement, where_loaded
from exlq.worker.engines.exllamav2.settings import ExLlamaV2Settings
from exlq.worker.engines.registry import LoadRequest
from exlq.worker.engines.structured_output import model_grammar_compiler

if TYPE_CHECKING:
    from exlq.worker.engines.exllamav2.graphs import DecodeGraphs

log = logging.getLogger(__name__)


def require_cuda() -> None:
    """Refuse early, with a message, where exllamav2 could only fail inside a compiler."""
    try:
        import torch
    except ImportError:
        raise EngineUnavailable(
            "the exllamav2 engine needs torch: install the worker extra "
            "(pip install 'exlq[worker]'), or run --engine echo to test without a GPU"
        ) from None
    if not torch.cuda.is_available():
        raise EngineUnavailable(
            "the exllamav2 engine needs an NVIDIA GPU with CUDA, and torch sees none "
            "(torch.cuda.is_available() is False); run --engine echo to test without a GPU"
        )


def load_exllamav2_engine(request: LoadRequest) -> ExLlamaV2Engine:
    require_cuda()
    model = request.model
    options = request.options
    assert model is not None and isinstance(options, ExLlamaV2Settings)
    if not (model / "config.json").exists():
        raise EngineUnavailable(f"{model} has no config.json: is it a model directory?")
    from exlq.worker.engines.exllamav2.attention import install_attention

    attention = install_attention(options.attention)
    try:
        return ExLlamaV2Engine(model, request.max_batch_size, options, attention)
    except (OSError, ValueError, AssertionError) as exc:
        raise EngineUnavailable(f"cannot load the model from {model}: {exc}") from exc


@dataclass
class _Job:
    job: Any  # ExLlamaV2DynamicJob
    prompt_tokens: int


@dataclass(slots=True)
class _Checked:
    """A checked request, its prompt encoded, until the engine queues its job; the job, if
    built ahead of its start (build_ahead)."""

    job_id: str
    request: EngineRequest
    input_ids: Any  # torch.Tensor, shape (1, prompt tokens)
    prompt_tokens: int
    constraint: Any  # structured_output.TokenConstraint, or None
    job: Any = None  # ExLlamaV2DynamicJob, ready to queue (generator.ready_job)


# Jobs of equal sampling share one ExLlamaV2Sampler.Settings: making one is a sizeable part
# of a job's build, on the way to a burst's first token. Sharing is safe
# because exllamav2 0.3.2 writes to a job's settings only for DRY and mirostat, which these
# never turn on (tests/gpu/test_exllamav2_worker.py pins both).
SAMPLER_SETTINGS_KEPT = 256


@functools.lru_cache(maxsize=SAMPLER_SETTINGS_KEPT)
def sampler_settings(
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    typical: float,
    repetition_penalty: float,
    frequency_penalty: float,
    presence_penalty: float,
) -> Any:
    """exllamav2's sampler settings for a request's sampling (its seed aside), one object
    for all the jobs that ask for the same; never changed once made."""
    from exllamav2.generator import ExLlamaV2Sampler

    if temperature == 0.0:
        return ExLlamaV2Sampler.Settings.greedy(
            token_repetition_penalty=repetition_penalty,
            token_frequency_penalty=frequency_penalty,
            token_presence_penalty=presence_penalty,
        )
    return ExLlamaV2Sampler.Settings(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        typical=0.0 if typical >= 1.0 else typical,
        token_repetition_penalty=repetition_penalty,
        token_frequency_penalty=frequency_penalty,
        token_presence_penalty=presence_penalty,
    )


class ExLlamaV2Engine(Engine, PreparesJobs, UsesDeviceWait):
    name = "exllamav2"

    def __init__(
        self, model: Path, max_batch_size: int, settings: ExLlamaV2Settings, attention: str
    ) -> None:
        import torch

        from exlq.worker.engines.exllamav2.load import load_generator, warm_up

        self._torch = torch
        self.attention = attention
        self.capacity = max_batch_size
        self.drafting = (
            Drafting(settings.draft_tokens, settings.draft_model) if settings.drafting else None
        )
        self.placement = Placement(settings.gpu_split_gb, settings.tensor_parallel)
        if self.drafting is not None:
            # Every step verifies drafts in exllamav2's own step, which samples each drafted
            # position on the CPU; its forward passes replay graphs of their own shape.
            log.info("speculative decoding: %s; sampling on the CPU", self.drafting.describe())
        self.loaded = load_generator(
            model,
            max_batch_size=self.capacity,
            cache_tokens=settings.cache_tokens,
            gpu_sampling=settings.gpu_sampling,
            prefill_batch_tokens=settings.prefill_batch_tokens,
            admit_prompt_tokens=settings.admit_prompt_tokens,
            max_chunk_size=settings.max_chunk_size,
            gpu_embedding=settings.gpu_embedding,
            decode_graphs=settings.cuda_graphs,
            placement=self.placement,
            drafting=self.drafting,
        )
        self.gpu_embedding = self.loaded.gpu_embedding
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.generator = self.loaded.generator
        cache_tokens = self.loaded.cache_tokens
        warmed = warm_up(self.loaded)
        if warmed.prefill_seconds is not None:
            log.info("prefill kernels compiled in %.1f s", warmed.prefill_seconds)
        self.graphs: DecodeGraphs | None = warmed.graphs
        batcher = getattr(self.generator, "prefill_batcher", None)
        self.decode_graphs = self.graphs is not None
        self.gpu_sampling = bool(getattr(self.generator, "gpu_sampling", False))
        self.overlapped_steps = getattr(self.generator, "overlap", None) is not None
        self.prefill_batch_tokens = batcher.budget_tokens if batcher else 0
        self.admit_prompt_tokens = int(getattr(self.generator, "admit_prompt_tokens", 0))
        self.max_seq_len = min(self.generator.max_seq_len, cache_tokens)
        self.chat = ChatFormatter(
            model, self.tokenizer.bos_token or "", self.tokenizer.eos_token or ""
        )
        # The end-of-text tokens: the tokenizer's and the generation config's (a chat
        # model's end-of-turn token may be only there).
        eos = {self.tokenizer.eos_token_id} - {None}
        self._eos_ids: list[int] = sorted(eos | generation_eos_ids(model))
        self.grammars = model_grammar_compiler(
            model, self.tokenizer, self.model.config.vocab_size, self._eos_ids
        )
        self._pieces: list[str] | None = None
        self._jobs: dict[str, _Job] = {}
        # Accepted jobs are built only when the next step could start them (build_queue.py).
        self._unbuilt: BuildQueue[_Checked] = BuildQueue()
        # Seeds for jobs that bring none. exllamav2 seeds such a job's random.Random() from
        # os.urandom, a system call a job; an integer seed drawn here costs less. Sampling
        # needs independent streams, not secrets: a 64-bit seed per job gives them.
        self._seeds = random.Random()
        log.info(
            "exllamav2 ready: %s (%s), cache %d tokens, capacity %d, attention %s, CUDA graphs "
            "%s%s, sampling on the %s, embedding table on the %s, prefill %s, %s",
            model.name,
            where_loaded(self.model),
            cache_tokens,
            self.capacity,
            attention,
            "on" if self.decode_graphs else "off",
            " (decode steps overlapped)" if self.overlapped_steps else "",
            "GPU where it can" if self.gpu_sampling else "CPU",
            "GPU" if self.gpu_embedding else "CPU",
            (
                f"batched up to {batcher.budget_tokens} tokens a pass"
                f"{', rows padded' if batcher.padding else ', equal lengths only'}"
                if batcher
                else "one job a pass"
            ),
            (
                f"a step starts jobs of up to {self.admit_prompt_tokens} prompt tokens"
                if self.admit_prompt_tokens
                else "a step starts every job that fits"
            ),
        )

    def info(self) -> dict[str, str]:
        """How loading turned out (a setting may have fallen back)."""
        return {
            "attention": self.attention,
            "decode_graphs": "on" if self.decode_graphs else "off",
            "gpu_sampling": "on" if self.gpu_sampling else "off",
            "overlapped_steps": "on" if self.overlapped_steps else "off",
            "prefill_batch_tokens": str(self.prefill_batch_tokens),
            "admit_prompt_tokens": str(self.admit_prompt_tokens),
            "gpu_embedding": "on" if self.gpu_embedding else "off",
            "placement": where_loaded(self.model),
            "drafting": "off" if self.drafting is None else self.drafting.describe(),
            "structured_output": "on" if self.grammars is not None else "off",
        }

    # -- jobs ---------------------------------------------------------------------------

    def add(self, job_id: str, request: EngineRequest) -> None:
        """Check and encode the request now (a bad one raises here); build its job when a
        step could start it."""
        self.admit(job_id, self.prepare(job_id, request))

    def prepare(self, job_id: str, request: EngineRequest) -> _Checked:
        """Check and encode the request (a bad one raises here), without starting it."""
        input_ids = prompt_tensor(request, self.tokenizer, self.chat, self.model.config.vocab_size)
        prompt_tokens = int(input_ids.shape[-1])
        constraint = self._constraint(request)
        if prompt_tokens + request.max_new_tokens + self._drafted > self.max_seq_len:
            raise InvalidRequest(
                f"prompt ({prompt_tokens} tokens) plus max_new_tokens "
                f"({request.max_new_tokens}) exceeds the {self.max_seq_len} tokens this worker "
                "can hold for one job: shorten the prompt or lower max_new_tokens"
            )
        return _Checked(job_id, request, input_ids, prompt_tokens, constraint)

    def _constraint(self, request: EngineRequest) -> Any:
        """The request's grammar, compiled (InvalidRequest if it cannot be), or None."""
        if request.constraint is None:
            return None
        if self.grammars is None:
            raise InvalidRequest(
                "response_format / regex: this worker cannot constrain output (llguidance is "
                "not installed, or the model has no tokenizer.json)"
            )
        if self.drafting is not None:
            raise InvalidRequest(
                "response_format / regex: this worker drafts tokens (speculative decoding), "
                "whose verify step cannot constrain output; send it to a worker without "
                "draft_model or ngram_draft"
            )
        if not hasattr(self.generator, "gpu_sampled"):
            raise InvalidRequest(
                "response_format / regex: this worker runs exllamav2's own generator (an "
                "exllamav2 other than 0.3.2, or every exlq option off), which cannot "
                "constrain output"
            )
        return self.grammars.compile(request)

    @property
    def _drafted(self) -> int:
        """Tokens past max_new_tokens a job must have room for: exllamav2 ends a drafting
        job num_draft_tokens early, so exlq asks it for that many more."""
        return 0 if self.drafting is None else self.drafting.tokens

    def admit(self, job_id: str, prepared: object) -> None:
        """Accept a prepared job: it is queued (and built, if it was not built ahead) when a
        step could start it."""
        if not isinstance(prepared, _Checked):
            raise TypeError(f"admit() takes what prepare() returned, not {type(prepared)}")
        self._unbuilt.put(job_id, prepared.prompt_tokens, prepared)

    def build_ahead(self, prepared: list[object]) -> None:
        """Build, in order, the prepared jobs that the next step would start if they were
        admitted now (the same budget test as _build_startable, the engine being idle). A
        job that fails to build is left unbuilt: its step builds it again and fails it."""
        waiting = 0
        for checked in prepared:
            if not room_for_one_more(waiting, self.admit_prompt_tokens):
                return
            assert isinstance(checked, _Checked)
            waiting += checked.prompt_tokens
            if checked.job is None:
                try:
                    checked.job = self._new_job(checked)
                except Exception as exc:
                    log.debug("building job %s ahead failed: %s", checked.job_id, exc)

    def _build_startable(self) -> list[EngineOutput]:
        """Build, in order, the accepted jobs this step could start; a job exllamav2 will
        not build fails alone."""
        if not self._unbuilt:
            return []
        from exlq.worker.engines.exllamav2.generator import prompt_tokens

        failed: list[EngineOutput] = []
        budget = self.admit_prompt_tokens
        waiting = sum(prompt_tokens(job) for job in self.generator.pending_jobs) if budget else 0
        for accepted in self._unbuilt.take(waiting, budget):
            try:
                self._build(accepted)
            except Exception as exc:
                log.exception("engine refused job %s", accepted.job_id)
                failed.append(JobErrored(accepted.job_id, "engine_error", describe_error(exc)))
        return failed

    def _build(self, accepted: Accepted[_Checked]) -> None:
        from exlq.worker.engines.exllamav2.generator import enqueue_ready

        checked = accepted.item
        job = checked.job if checked.job is not None else self._new_job(checked)
        enqueue_ready(self.generator, job)
        self._jobs[accepted.job_id] = _Job(job, accepted.prompt_tokens)

    def _new_job(self, checked: _Checked) -> Any:
        """The job exllamav2 will run, ready to queue."""
        from exllamav2.generator import ExLlamaV2DynamicJob

        from exlq.worker.engines.exllamav2.generator import ready_job
        from exlq.worker.engines.exllamav2.logprob_job import RawLogprobJob

        request = checked.request
        stops: list[int | str] = [*request.stop, *request.stop_token_ids]
        if not request.ignore_eos or checked.constraint is not None:
            stops += self._eos_ids  # a grammar allows the end only where its output is whole
        # With logprobs, one column more: the chosen token's (logprobs.py).
        job_class = RawLogprobJob if request.logprobs else ExLlamaV2DynamicJob
        job = job_class(
            input_ids=checked.input_ids,
            max_new_tokens=request.max_new_tokens + self._drafted,
            gen_settings=self._sampler(request),
            seed=(
                self._seeds.getrandbits(64)
                if request.sampling.seed is None
                else request.sampling.seed
            ),
            stop_conditions=stops,
            banned_strings=request.banned_strings or None,
            return_top_tokens=request.logprobs + 1 if request.logprobs else 0,
            identifier=checked.job_id,
        )
        job.exlq_constraint = checked.constraint
        ready_job(self.generator, job)
        return job

    def _sampler(self, request: EngineRequest) -> Any:
        return sampler_settings(*sampling_settings(request.sampling))

    def cancel(self, job_id: str) -> JobEnded | None:
        unbuilt = self._unbuilt.remove(job_id)
        if unbuilt is not None:
            return JobEnded(job_id, "cancelled", unbuilt.prompt_tokens, 0)
        entry = self._jobs.pop(job_id, None)
        if entry is None:
            return None
        self.generator.cancel(entry.job)
        return JobEnded(job_id, "cancelled", entry.prompt_tokens, int(entry.job.new_tokens))

    def set_wait_work(self, work: Callable[[], None] | None) -> None:
        """exlq's generator runs it in the decode step, once the GPU has the forward pass
        and the sampling queued, before it waits for the sampled tokens."""
        super().set_wait_work(work)
        if hasattr(self.generator, "wait_work"):
            self.generator.wait_work = work

    def prepare_next_step(self) -> list[EngineOutput]:
        """Build the jobs the next step could start. From the wait for the GPU, a burst's
        later slices are built during the prefill of the slice before, not at the start of
        their own step with the GPU idle."""
        return self._build_startable()

    def step(self) -> list[EngineOutput]:
        outputs = self._build_startable()
        for result in self.generator.iterate():
            if result["stage"] == "streaming":
                self._add_outputs(result, outputs)
        return outputs

    def _add_outputs(self, result: dict[str, Any], outputs: list[EngineOutput]) -> None:
        """Append what one of exllamav2's results says to ``outputs`` (every job, every step)."""
        job_id: str = result["identifier"]
        text: str = result.get("text", "")
        ids_tensor = result.get("token_ids")
        token_ids: list[int] = []
        if ids_tensor is not None:  # shape (1, n): one host call, not flatten() and tolist()
            rows = ids_tensor.tolist()
            token_ids = rows[0] if ids_tensor.ndim == 2 else rows
        if text or token_ids:
            outputs.append(TokenChunk(job_id, text, token_ids, self._logprobs(result)))
        if result["eos"]:
            entry = self._jobs.pop(job_id, None)
            prompt_tokens = entry.prompt_tokens if entry else 0
            outputs.append(ended_job(job_id, result, prompt_tokens, **self._draft_counts(result)))

    def _draft_counts(self, result: dict[str, Any]) -> dict[str, int]:
        """A drafting generator's counts for the job that ``result`` ends."""
        if self.drafting is None:
            return {}
        accepted = int(result.get("accepted_draft_tokens", 0))
        drafted = accepted + int(result.get("rejected_draft_tokens", 0))
        return {"draft_tokens": drafted, "accepted_draft_tokens": accepted}

    def _logprobs(self, result: dict[str, Any]) -> list[TokenChoices] | None:
        top_ids = result.get("top_k_tokens")
        top_logprobs = result.get("top_k_probs")  # logprobs: exlq puts them there
        if top_ids is None or top_logprobs is None:
            return None
        if self._pieces is None:
            self._pieces = self.tokenizer.get_id_to_piece_list(True)
        from exlq.worker.engines.exllamav2.logprobs import token_choices

        return token_choices(top_ids, top_logprobs, self._pieces)

    def abort_all(self) -> list[str]:
        ids = [*self._jobs, *self._unbuilt.clear()]
        self._jobs.clear()
        reset_gpu_engine(self.generator.clear_queue, self._torch)
        return ids

    @property
    def active_jobs(self) -> int:
        return len(self._jobs) + len(self._unbuilt)

    def cache_usage(self) -> CacheUsage:
        return CacheUsage(len(self.generator.referenced_pages), self.generator.max_pages)

    def close(self) -> None:
        self._unbuilt.clear()
        self.generator.clear_queue()
        if self.graphs is not None:
            self.graphs.uninstall()
        self.loaded.unload()
