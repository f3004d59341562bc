"""ExLlamaV3Engine: the only module the worker calls that drives exllamav3's generator.

exllamav3's Generator batches continuously: jobs join between iterations, each prompt is
prefilled in chunks, pages of the KV cache are shared between jobs whose prompts begin
alike (prefix reuse, counted in each job's cached tokens), and the decode step replays
CUDA graphs. exlq drives its synchronous API from the engine thread, not its
AsyncGenerator (which iterates on the event loop); its result dicts become typed outputs
in results.py, so nothing else sees them:

- a request becomes one exllamav3 Job: its prompt encoded (chat messages through the
  model's template), its stops (the end-of-text tokens unless ignore_eos), banned strings,
  seed (one drawn here where the request has none), sampler (sampling.py), its grammar as a
  filter (constraint_filter.py) and, with logprobs, the model's own probabilities;
- a step is one iterate(): each job's new text and token ids, and its end; the engine
  loop's wait work runs inside it, once the decode pass is queued (device_wait.py).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exlq.protocol.models import InvalidRequest
from exlq.worker.engines.base import (
    CacheUsage,
    Engine,
    EngineOutput,
    EngineUnavailable,
    JobEnded,
    JobErrored,
    UsesDeviceWait,
    describe_error,
    reset_gpu_engine,
)
from exlq.worker.engines.chat_template import ChatFormatter, generation_eos_ids
from exlq.worker.engines.engine_request import EngineRequest
from exlq.worker.engines.exllama_prompt import prompt_tensor
from exlq.worker.engines.exllamav3.device_wait import run_wait_work_after_forward
from exlq.worker.engines.exllamav3.results import outputs_of
from exlq.worker.engines.exllamav3.sampling import sampler_for
from exlq.worker.engines.exllamav3.settings import ExLlamaV3Settings
from exlq.worker.engines.registry import LoadRequest
from exlq.worker.engines.structured_output import model_grammar_compiler

log = logging.getLogger(__name__)


def load_exllamav3_engine(request: LoadRequest) -> ExLlamaV3Engine:
    model = request.model
    options = request.options
    assert model is not None and isinstance(options, ExLlamaV3Settings)
    if importlib.util.find_spec("exllamav3") is None or importlib.util.find_spec("torch") is None:
        raise EngineUnavailable(
            "the exllamav3 engine needs exllamav3 and torch: pip install 'exlq[exllamav3]' "
            "(exllamav3 compiles its CUDA extension at first import), or run --engine echo "
            "to test without a GPU"
        )
    import torch

    if not torch.cuda.is_available():
        raise EngineUnavailable(
            "the exllamav3 engine needs an NVIDIA GPU with CUDA, and torch sees none "
            "(torch.cuda.is_available() is False); run --engine echo to test without a GPU"
        )
    if not (model / "config.json").exists():
        raise EngineUnavailable(f"{model} has no config.json: is it a model directory?")
    try:
        return ExLlamaV3Engine(model, request.max_batch_size, options)
    except ImportError as exc:
        raise EngineUnavailable(f"the exllamav3 engine cannot be imported here: {exc}") from exc
    except (OSError, ValueError, AssertionError, KeyError) as exc:
        raise EngineUnavailable(f"cannot load the model from {model}: {exc}") from exc


def trim_mlp_outputs(model: Any) -> int:
    """Mark the gated MLPs' down projections to trim their padding; returns how many needed it.

    exllamav3 pads a linear layer's output to a multiple of 128 columns and trims it back only
    where the layer is told to: its attention's output projection is, its gated MLP's down
    projection (1.6.5) is not. A model whose hidden size is no multiple of 128 (SmolLM2-135M:
    576) then fails at load, adding 640 columns to the residual stream's 576. The trim is
    what the attention's projection does, so a model that loads without it runs the same."""
    from exllamav3.modules import GatedMLP

    trimmed = 0
    for top in model.modules:
        for module in top:
            if not isinstance(module, GatedMLP):
                continue
            for down in module.downs:
                if down.out_features != down.out_features_unpadded and not down.trim_padded_out:
                    down.trim_padded_out = True
                    trimmed += 1
    return trimmed


@dataclass(slots=True)
class _Job:
    job: Any  # exllamav3.Job
    prompt_tokens: int


class ExLlamaV3Engine(Engine, UsesDeviceWait):
    name = "exllamav3"

    def __init__(self, model_dir: Path, capacity: int, settings: ExLlamaV3Settings) -> None:
        import torch
        from exllamav3 import Cache, Config, Generator, Model, Tokenizer

        self._torch = torch
        self.capacity = capacity
        self.version = importlib.metadata.version("exllamav3")
        config = Config.from_directory(str(model_dir))
        self.model = Model.from_config(config)
        if trimmed := trim_mlp_outputs(self.model):
            log.info("exllamav3: %d MLP output projections trimmed of their padding", trimmed)
        # The cache is made before the weights load: exllamav3 places both at load.
        self.cache = Cache(self.model, max_num_tokens=settings.cache_tokens)
        self.model.load()
        self.tokenizer = Tokenizer.from_config(config)
        # Every prompt waiting is read on every iteration, in full chunks, as when exllamav3's
        # jobs all arrive together. Its default rations prompts while any job generates (one
        # job's half chunk every fifth iteration), which protects running streams but leaves
        # a burst's later jobs waiting for their first token: a queue's jobs arrive over a
        # few iterations, so most of a burst would start under that ration.
        self.generator = Generator(
            self.model,
            self.cache,
            self.tokenizer,
            max_batch_size=capacity,
            max_chunk_size=settings.max_chunk_size,
            shared_chunk_size=settings.max_chunk_size,
            prefill_cooldown=0,
        )
        run_wait_work_after_forward(self.model, self)
        self.vocab_size = int(config.vocab_size)
        self.cache_tokens = settings.cache_tokens
        # exllamav3 keeps one cache position past a job's last token (it caps a job that
        # would fill the cache whole one token short).
        self.max_seq_len = min(int(config.max_position_embeddings), settings.cache_tokens - 1)
        self.chat = ChatFormatter(
            model_dir, self.tokenizer.bos_token or "", self.tokenizer.eos_token or ""
        )
        # The end-of-text tokens: the tokenizer's and the generation config's (a chat
        # model's end-of-turn token may be only there).
        eos = {self.tokenizer.eos_token_id} - {None}
        eos |= set(getattr(config, "eos_token_id_list", None) or ())
        self._eos_ids: list[int] = sorted(eos | generation_eos_ids(model_dir))
        self.grammars = model_grammar_compiler(
            model_dir, self.tokenizer, self.vocab_size, self._eos_ids
        )
        self._pieces: list[str] | None = None
        self._jobs: dict[str, _Job] = {}
        # Seeds for jobs that bring none: independent streams, not secrets.
        self._seeds = random.Random()
        log.info(
            "exllamav3 %s ready: %s, cache %d tokens, capacity %d, %d tokens a job, "
            "structured output %s",
            self.version,
            model_dir.name,
            settings.cache_tokens,
            capacity,
            self.max_seq_len,
            "on" if self.grammars is not None else "off",
        )

    def info(self) -> dict[str, str]:
        return {
            "exllamav3": self.version,
            "cache_tokens": str(self.cache_tokens),
            "structured_output": "on" if self.grammars is not None else "off",
        }

    # -- jobs ---------------------------------------------------------------------------

    def add(self, job_id: str, request: EngineRequest) -> None:
        from exllamav3 import Job

        input_ids = prompt_tensor(request, self.tokenizer, self.chat, self.vocab_size)
        prompt_tokens = int(input_ids.shape[-1])
        if prompt_tokens + request.max_new_tokens > self.max_seq_len:
            raise InvalidRequest(
                f"prompt ({prompt_tokens} tokens) plus max_new_tokens "
                f"({request.max_new_tokens}) exceeds the {self.max_seq_len} tokens this worker "
                "can hold for one job: shorten the prompt or lower max_new_tokens"
            )
        sampler = sampler_for(request.sampling)
        filters = self._filters(request)
        stops: list[int | str] = [*request.stop, *request.stop_token_ids]
        if not request.ignore_eos or filters:
            stops += self._eos_ids  # a grammar allows the end only where its output is whole
        seed = request.sampling.seed
        job = Job(
            input_ids=input_ids,
            max_new_tokens=request.max_new_tokens,
            sampler=sampler,
            seed=self._seeds.getrandbits(63) if seed is None else seed,
            stop_conditions=stops,
            banned_strings=list(request.banned_strings) or None,
            # The model's own probabilities of the likeliest tokens and of the chosen one,
            # before the sampler's temperature, truncation and mask.
            return_top_tokens=request.logprobs,
            return_probs=bool(request.logprobs),
            filters=filters,
            identifier=job_id,
        )
        self.generator.enqueue(job)
        self._jobs[job_id] = _Job(job, prompt_tokens)

    def _filters(self, request: EngineRequest) -> list[Any] | None:
        """The request's grammar as exllamav3 filters (InvalidRequest if it cannot be
        compiled, or this worker cannot constrain output), or None."""
        if request.constraint is None:
            return None
        if self.grammars is None:
            raise InvalidRequest(
                f"{request.constraint.field}: this worker cannot constrain output "
                "(llguidance is not installed, or the model has no tokenizer.json it reads "
                "as the model does)"
            )
        constraint = self.grammars.compile(request)
        assert constraint is not None
        from exlq.worker.engines.exllamav3.constraint_filter import ConstraintFilter

        return [ConstraintFilter(self.tokenizer, constraint, self.vocab_size)]

    def cancel(self, job_id: str) -> JobEnded | None:
        entry = self._jobs.pop(job_id, None)
        if entry is None:
            return None
        self.generator.cancel(entry.job)
        completed = max(int(entry.job.new_tokens), 0)
        return JobEnded(job_id, "cancelled", entry.prompt_tokens, completed)

    # -- a step -------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        for result in self.generator.iterate():
            stage = result["stage"]
            if stage == "streaming":
                job_id = str(result["identifier"])
                entry = self._jobs.pop(job_id, None) if result["eos"] else None
                prompt_tokens = entry.prompt_tokens if entry is not None else 0
                outputs += outputs_of(job_id, result, self._pieces_list, prompt_tokens)
            elif stage == "error":  # exllamav3 failed this job alone and dropped it
                job_id = str(result["job"].identifier)
                self._jobs.pop(job_id, None)
                outputs.append(JobErrored(job_id, "engine_error", describe_error(result["error"])))
        return outputs

    def _pieces_list(self) -> list[str]:
        if self._pieces is None:
            self._pieces = self.tokenizer.get_id_to_piece_list(True)
        return self._pieces

    def abort_all(self) -> list[str]:
        ids = list(self._jobs)
        self._jobs.clear()
        reset_gpu_engine(self.generator.clear_queue, self._torch)
        return ids

    @property
    def active_jobs(self) -> int:
        return len(self._jobs)

    def cache_usage(self) -> CacheUsage:
        pages = self.generator.pagetable
        return CacheUsage(len(pages.referenced_pages), int(pages.max_pages))

    def close(self) -> None:
        self._jobs.clear()
        self.generator.clear_queue()
        self.generator.close()
        self.model.unload()
