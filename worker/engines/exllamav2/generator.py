"""exllamav2's dynamic generator with two of its hot spots replaced: the sampling of the
decode step, and the one-job-at-a-time prefill.

ExLlamaV2DynamicGenerator.iterate_gen copies the whole step's logits to the host and samples
every job on the CPU, one after another, while the GPU idles: at many jobs, a large share of
the step (docs/PERFORMANCE.md, "On the GPU (exllamav2 engine options)"). With gpu_sampling,
ExlqDynamicGenerator overrides iterate_gen for the plain (no draft model) decode step: jobs
whose sampling worker/kernels/sampling.py implements are sampled there in one batch, the
rest exactly as exllamav2 does, and every job then goes through exllamav2's own
receive_sample (stop conditions, held text, page hashing). Otherwise the method does what
exllamav2 0.3.2's iterate_gen does, step for step, except that jobs on the CPU path are
sampled on the calling thread (exllamav2's sampling-thread pool gained nothing over it), and
that jobs entering decode are not stamped through a GPU sync each.
tests/gpu/test_gpu_sampling.py checks the hook points and that greedy output does not
change. The same decode step (without gpu_sampling too, every job then on the CPU) masks
constrained jobs' logits with their grammars (grammar_masks.py) and reports logprobs from
the step's raw logits (logprobs.py); a drafting step is exllamav2's own.

With prefill_batch_tokens > 0 it overrides iterate() to run its jobs' prefill passes through
prefill.PrefillBatcher: batched, instead of one eager pass per job. In that loop a
prefill's search for a partially matching page walks only the pages that could match
(page_search.py), where exllamav2 walks every page of the cache for every job.

A decode step runs its wait_work (Engine.set_wait_work), if set, once its forward pass and
sampling are queued on the GPU and before it waits for the sampled tokens: the engine loop
sends the previous step's report there, while the GPU works.

Once warm_up has captured the decode graphs (use_overlap), a decode step whose jobs all
sample on the GPU and accept their tokens as sampled is launched from the tokens of the step
before, still on the GPU, and the host reads that step's tokens while the GPU runs this one
(overlap.py); a step with any other job first reads the step in flight, then runs to its end.

With admit_prompt_tokens > 0 a step starts only as many waiting jobs as hold that many
prompt tokens together (prefill_plan.jobs_to_start), where exllamav2 starts every one that
fits: a burst starts in slices, and its first jobs decode while the rest prefill.

Making exlq's generator also gives every job queued afterwards its held-output buffers on
first use (job_buffers.py), and every job made afterwards a random generator seeded at
its first draw (job_rng.py): a job's build, on the way to a burst's
first token, no longer allocates five buffers it mostly never writes, nor seeds a
generator before the GPU runs.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from exllamav2.ext import none_tensor
from exllamav2.generator import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob

from exlq.worker.engines.exllamav2.attention import on_pinned_exllamav2, padding_supported
from exlq.worker.engines.exllamav2.grammar_masks import GrammarMasks, grammar_ended
from exlq.worker.engines.exllamav2.job_buffers import install_on_demand_buffers
from exlq.worker.engines.exllamav2.job_rng import install_job_rng
from exlq.worker.engines.exllamav2.logprobs import top_logprobs
from exlq.worker.engines.exllamav2.overlap import OverlappedDecode
from exlq.worker.engines.exllamav2.page_search import narrowed_page_search
from exlq.worker.engines.exllamav2.prefill import PrefillBatcher
from exlq.worker.engines.exllamav2.prefill_plan import jobs_to_start
from exlq.worker.engines.exllamav2.sampleable import gpu_sampleable, row_settings
from exlq.worker.kernels.paged_attention import TILE_CLASS_ROWS
from exlq.worker.kernels.sampling import sample_rows

# ExLlamaV2DynamicGenerator asserts max_batch_size * max_q_size (8) rows fit the scratch.
_DECODE_ROWS_PER_JOB = 8


def size_model_config(config: Any, max_batch: int, prefill_batch_tokens: int) -> None:
    """Make the model's scratch (config.max_input_len x config.max_batch_size rows, allocated
    at load) hold what the generator will run: max_batch jobs' decode rows, and batched
    prefill passes of prefill_batch_tokens."""
    rows = max(max_batch * _DECODE_ROWS_PER_JOB, prefill_batch_tokens)
    config.max_batch_size = max(config.max_batch_size, math.ceil(rows / config.max_input_len))


def make_dynamic_generator(
    *, gpu_sampling: bool, prefill_batch_tokens: int, admit_prompt_tokens: int = 0, **kwargs: Any
) -> Any:
    """ExlqDynamicGenerator where one of its levers is asked for and the installed exllamav2
    is the version it is written for; exllamav2's own generator otherwise. kwargs go to the
    generator (model, cache, tokenizer, max_batch_size, ...)."""
    if not gpu_sampling and prefill_batch_tokens <= 0 and admit_prompt_tokens <= 0:
        return ExLlamaV2DynamicGenerator(**kwargs)
    if not on_pinned_exllamav2("GPU sampling, batched prefill and the admission budget off"):
        return ExLlamaV2DynamicGenerator(**kwargs)
    install_on_demand_buffers()
    install_job_rng()
    return ExlqDynamicGenerator(
        gpu_sampling=gpu_sampling,
        prefill_batch_tokens=prefill_batch_tokens,
        admit_prompt_tokens=admit_prompt_tokens,
        **kwargs,
    )


def prompt_tokens(job: Any) -> int:
    """The prompt tokens of an exllamav2 job, as the admission budget counts them."""
    return sum(len(seq.input_ids) for seq in job.sequences)


def ready_job(generator: Any, job: Any) -> None:
    """What exllamav2 0.3.2's enqueue() does to a job before it queues it (the prompt's page
    hashes, the check that it fits the cache, the buffers for held-back text), done ahead of
    its start: enqueue_ready() then only queues it. The serial number given here is a
    placeholder; enqueue_ready() gives the real one. Raises as enqueue() would."""
    job.prepare_for_queue(generator, generator.job_serial)


def enqueue_ready(generator: Any, job: Any) -> None:
    """The rest of exllamav2 0.3.2's enqueue() for a job ready_job() prepared: its serial
    number, its place in the queue and its enqueue time."""
    job.serial_number = generator.job_serial
    generator.job_serial += 1
    generator.pending_jobs.append(job)
    job.time_enqueue = time.time()


class ExlqDynamicGenerator(ExLlamaV2DynamicGenerator):  # type: ignore[misc]
    """ExLlamaV2DynamicGenerator whose decode step samples eligible jobs on the GPU
    (gpu_sampling), whose prefill passes run batched (prefill_batch_tokens > 0: the most
    tokens, padding included, one batched pass takes), and whose steps each start jobs of at
    most admit_prompt_tokens prompt tokens together (0: every job that fits)."""

    logits_pinned: Any
    pending_jobs: list[Any]

    def __init__(
        self,
        *args: Any,
        gpu_sampling: bool = True,
        prefill_batch_tokens: int = 0,
        admit_prompt_tokens: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.admit_prompt_tokens = admit_prompt_tokens
        self.gpu_sampling = gpu_sampling
        self.gpu_sampled = 0
        self.cpu_sampled = 0
        # Run while a decode step waits for the GPU (Engine.set_wait_work), if set.
        self.wait_work: Callable[[], None] | None = None
        if gpu_sampling:
            # exllamav2 allocates this buffer in pageable memory despite its name, so the
            # copy of a step's logits into it is staged and holds the step up at many jobs;
            # pinned, the GPU writes it directly.
            shape, dtype = self.logits_pinned.shape, self.logits_pinned.dtype
            self.logits_pinned = torch.empty(shape, dtype=dtype, pin_memory=True)
        self._grammar_masks = GrammarMasks(self.max_batch_size)
        # Decode steps launched from the step before's sampled tokens (use_overlap).
        self.overlap: OverlappedDecode | None = None
        # The prefill loop's search for a partially matching page looks only at pages that
        # could match (page_search.py); False searches every page, as exllamav2 does.
        self.narrow_page_search = True
        self.prefill_batcher: PrefillBatcher | None = None
        if prefill_batch_tokens > 0 and self.paged:
            config = self.model.config
            scratch_rows = config.max_input_len * config.max_batch_size
            # Tensor parallelism runs its attention in exllamav2's C++, past the hook that
            # keeps a padded row's padding out of the cache: it batches equal lengths only.
            padding = padding_supported() and getattr(self.model, "tp_context", None) is None
            self.prefill_batcher = PrefillBatcher(
                self, min(prefill_batch_tokens, scratch_rows), padding
            )

    def iterate_start_jobs(self, results: list[Any]) -> None:
        """exllamav2's, offered only the waiting jobs that fit this step's prompt budget; the
        rest wait, in their order, for the next step."""
        waiting = self.pending_jobs
        if self.admit_prompt_tokens <= 0 or not waiting:
            super().iterate_start_jobs(results)
            return
        offered = jobs_to_start((prompt_tokens(job) for job in waiting), self.admit_prompt_tokens)
        self.pending_jobs = waiting[:offered]
        try:
            super().iterate_start_jobs(results)
        finally:
            # exllamav2 removed from the offered list the jobs it started.
            self.pending_jobs = self.pending_jobs + waiting[offered:]

    def warm_up_prefill(self) -> float:
        """Compile the attention kernel's prefill variants now rather than in the middle of
        serving, where a variant's first use stalls its step for the whole compile. For each
        tile class: one job alone, two jobs of one length in one unpadded pass, then, where
        rows may be padded, two jobs of unequal length in one padded pass. Returns the
        seconds it took."""
        batcher = self.prefill_batcher
        if batcher is None:
            return 0.0
        config = self.model.config
        group = config.num_attention_heads // config.num_key_value_heads
        tokens = torch.Generator().manual_seed(0)
        started = time.perf_counter()
        # The jobs of one pass must start in one step, whatever the admission budget.
        budget, self.admit_prompt_tokens = self.admit_prompt_tokens, 0
        try:
            self._warm_up_tile_classes(batcher, group, tokens)
        finally:
            self.admit_prompt_tokens = budget
        return time.perf_counter() - started

    def _warm_up_tile_classes(self, batcher: PrefillBatcher, group: int, tokens: Any) -> None:
        for rows in TILE_CLASS_ROWS:
            longest = min(max(2, -(-rows // group)), self.max_chunk_size)
            self._run_prompts([longest + 1], tokens)
            if 2 * longest > batcher.budget_tokens:
                continue
            self._run_prompts([longest + 1, longest + 1], tokens)
            if batcher.padding:
                self._run_prompts([longest + 1, (longest + 1) // 2 + 1], tokens)

    def _run_prompts(self, lengths: list[int], tokens: Any) -> None:
        """Random prompts of these lengths, one new token each, admitted together."""
        from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

        vocab = self.model.config.vocab_size
        self.enqueue(
            [
                ExLlamaV2DynamicJob(
                    input_ids=torch.randint(1, vocab, (1, n), generator=tokens),
                    max_new_tokens=1,
                    stop_conditions=[],
                    gen_settings=ExLlamaV2Sampler.Settings.greedy(),
                )
                for n in lengths
            ]
        )
        while self.num_remaining_jobs():
            self.iterate()

    def iterate(self) -> list[Any]:
        batcher = self.prefill_batcher
        if batcher is None or self.draft_model or self.use_ngram_draft:
            return super().iterate()  # type: ignore[no-any-return]
        # exllamav2 0.3.2's iterate() without a draft model, its prefill loop batched.
        results: list[Any] = []
        with torch.inference_mode():
            self.iterate_start_jobs(results)
            with batcher.deferring(), self._page_search():
                for job in self.active_jobs:
                    job.prefill(results)
            self.iterate_gen(results)
        return results

    def _page_search(self) -> contextlib.AbstractContextManager[None]:
        if self.narrow_page_search:
            return narrowed_page_search(self)
        return contextlib.nullcontext()

    def use_overlap(self, graphs: Any) -> bool:
        """Overlap decode steps (overlap.py) from now on, replaying them from `graphs`
        (DecodeGraphs), where this generator can: GPU sampling on, no drafting, graphs that
        start from token ids. Returns whether it does."""
        if not self.gpu_sampling or self.draft_model or self.use_ngram_draft:
            return False
        if not graphs.takes_ids:
            return False
        self.overlap = OverlappedDecode(self, graphs)
        return True

    def clear_queue(self) -> None:
        if self.overlap is not None:
            self.overlap.in_flight = None
        super().clear_queue()

    def iterate_gen(self, results: list[Any], draft_tokens: Any = None) -> None:
        if draft_tokens is not None:
            super().iterate_gen(results, draft_tokens)
            return
        jobs = [job for job in self.active_jobs if job.is_prefill_done()]
        num_jobs = self.num_remaining_jobs()
        overlap = self.overlap
        if overlap is not None and overlap.can_run(jobs):
            completed = self._overlapped_step(overlap, jobs, results)
        else:
            if overlap is not None and overlap.in_flight is not None:
                # A job needs the host's view of its last token first: read the step in
                # flight, then run this one to its end.
                self._retire(overlap.finish(overlap.in_flight, results, fed=None))
                overlap.in_flight = None
                jobs = [job for job in self.active_jobs if job.is_prefill_done()]
            completed = self._step(jobs, results) if jobs else []
        self._retire(completed)
        if num_jobs and not self.num_remaining_jobs():
            self.defrag_cache()

    def _overlapped_step(
        self, overlap: OverlappedDecode, jobs: list[Any], results: list[Any]
    ) -> list[Any]:
        """Launch this step from the tokens of the step in flight, then read that one while
        the GPU runs this one; returns the jobs that ended."""
        prior = overlap.in_flight
        step = overlap.launch(jobs)
        overlap.in_flight = step
        if step is not None and self.wait_work is not None:
            self.wait_work()  # once a launched step, as a step run to its end does
        return overlap.finish(prior, results, fed=step) if prior is not None else []

    def _step(self, jobs: list[Any], results: list[Any]) -> list[Any]:
        """One decode step of `jobs` run to its end; returns the jobs that ended."""
        device_logits = self._forward(jobs)
        if self.filter_queue:
            for f, p in self.filter_queue:
                if p:
                    f.background_prepare_logit_mask(self.filter_pool)
                else:
                    f.background_next(self.filter_pool)
            self.filter_queue.clear()
        return self._sample_and_accept(jobs, device_logits, results)

    def _retire(self, ended: list[Any]) -> None:
        for job in ended:
            job.deallocate_pages()
            self.active_jobs.remove(job)

    def _forward(self, jobs: list[Any]) -> Any:
        """One decode forward pass over `jobs` (one row each): device logits (rows, 1, vocab)."""
        batch_size = sum(len(job.sequences) for job in jobs)
        max_seq_len = max(job.get_max_seq_len() for job in jobs)
        max_pages_batch = (max_seq_len + self.page_size - 1) // self.page_size
        block_index = torch.zeros((batch_size, max_pages_batch), dtype=torch.int32)
        cache_seqlens = torch.zeros((batch_size,), dtype=torch.int32)
        row = 0
        for job in jobs:
            for seq in job.sequences:
                seq_block_index = job.get_block_index(seq, len(seq.sequence_ids))
                block_index[row, : seq_block_index.shape[-1]].copy_(seq_block_index)
                cache_seqlens[row] = seq.kv_position
                row += 1
        input_ids_list: list[Any] = []
        active_embeddings: list[Any] = []
        mrope = self.model.config.arch.lm.mrope
        rope_offsets_list: list[Any] | None = [] if mrope else None
        # exllamav2 stamps a job's first decode step after cuda_sync_active(), once per job:
        # a full GPU sync plus torch.cuda.memory_stats() for each new job, all in the step
        # that follows a burst's prefill. One host timestamp for the step instead; the stamp
        # feeds only exllamav2's time_prefill/time_generate statistics, which exlq does not
        # report.
        now = time.time()
        for job in jobs:
            if job.time_first_token is None:
                job.time_first_token = now
            job_ids = job.get_input_ids_list(add_to_cache=True)
            input_ids_list += job_ids
            active_embeddings += job.embeddings
            if rope_offsets_list is not None:
                rope_offsets_list += [job.alt_rope_offset] * len(job_ids)
        batch_ids = torch.cat(input_ids_list, dim=0)
        attn_params = self.get_paged_params(
            batch_size,
            block_index,
            cache_seqlens,
            batch_ids.shape[-1],
            rope_offsets=(
                torch.tensor(rope_offsets_list, dtype=torch.int)
                if rope_offsets_list is not None
                else None
            ),
        )
        return self.model.forward_chunk(
            input_ids=batch_ids,
            attn_params=attn_params,
            cache=self.cache,
            loras=self.current_loras,
            indexed_embeddings=active_embeddings,
        )["logits"]

    def _sample_and_accept(
        self, jobs: list[Any], device_logits: Any, results: list[Any]
    ) -> list[Any]:
        """Sample a token for every job (GPU where it can, else exllamav2's CPU sampler) and
        hand it to the job; returns the jobs that ended."""
        rows, row = [], 0  # each job's first row; a CFG job has two
        for job in jobs:
            rows.append(row)
            row += len(job.sequences)
        # Read before a grammar's mask changes the logits: logprobs are the model's own.
        raw = self._rows_for_logprobs(jobs, rows, device_logits)
        constraints = self._mask_constrained(jobs, rows, device_logits)
        gpu_jobs = [i for i, job in enumerate(jobs) if self.gpu_sampling and gpu_sampleable(job)]
        sampled: dict[int, tuple[Any, Any]] = {}
        if gpu_jobs:
            sampled = self._sample_on_gpu(
                jobs, gpu_jobs, [rows[i] for i in gpu_jobs], device_logits
            )
        host_logits = None
        if len(gpu_jobs) < len(jobs):
            if not gpu_jobs and self.wait_work is not None:
                self.wait_work()
            host_logits = self.logits_pinned[: device_logits.shape[0], : device_logits.shape[1], :]
            host_logits.copy_(device_logits, non_blocking=False)
        picks = [
            (None, sampled[i][0], none_tensor, none_tensor, sampled[i][1], False)
            if i in sampled
            else self._sample_on_cpu(job, host_logits, rows[i])
            for i, job in enumerate(jobs)
        ]
        if raw is not None:
            self._attach_logprobs(jobs, raw, picks)
        completed = []
        for i, job in enumerate(jobs):
            job_logits, token, k_tokens, k_probs, prob, filter_eos = picks[i]
            if i in constraints:
                filter_eos = grammar_ended(constraints[i], int(token.item())) or filter_eos
            eos, _ = job.receive_sample(
                job_logits, token, k_tokens, k_probs, prob, filter_eos, results, True
            )
            if eos:
                completed.append(job)
        self.gpu_sampled += len(gpu_jobs)
        self.cpu_sampled += len(jobs) - len(gpu_jobs)
        return completed

    def _sample_on_cpu(self, job: Any, host_logits: Any, row: int) -> tuple[Any, ...]:
        """exllamav2's own sampling of one job (not RawLogprobJob's: exlq's step reports
        logprobs from the raw logits it keeps on the device)."""
        job_logits = host_logits[row : row + len(job.sequences), :1, :]
        return (job_logits, *ExLlamaV2DynamicJob.receive_logits(job, job_logits))

    def _rows_for_logprobs(
        self, jobs: list[Any], rows: list[int], device_logits: Any
    ) -> tuple[list[int], Any] | None:
        """The jobs that report logprobs and a copy of their rows of logits, or None."""
        wanted = [i for i, job in enumerate(jobs) if job.return_top_tokens]
        if not wanted:
            return None
        index = torch.tensor([rows[i] for i in wanted], dtype=torch.long)
        return wanted, device_logits[:, 0, :].index_select(0, index.to(device_logits.device))

    def _attach_logprobs(
        self, jobs: list[Any], raw: tuple[list[int], Any], picks: list[Any]
    ) -> None:
        """Put each job's top tokens of the model's distribution, and its chosen token's,
        where exllamav2 holds a job's top tokens (logprobs.py)."""
        wanted, logits = raw
        widest = max(jobs[i].return_top_tokens for i in wanted) - 1
        chosen = torch.cat([picks[i][1].view(1) for i in wanted]).to(logits.device)
        ids, values = top_logprobs(logits, chosen, widest, self.tokenizer.get_vocab_size())
        ids, values = ids.cpu(), values.cpu()
        for n, i in enumerate(wanted):
            count = jobs[i].return_top_tokens - 1
            columns = [*range(count), widest]  # its own count, then the chosen token
            job_ids = ids[n, columns].view(1, 1, -1)
            job_values = values[n, columns].view(1, 1, -1)
            logits_row, token, _, _, prob, filter_eos = picks[i]
            picks[i] = (logits_row, token, job_ids, job_values, prob, filter_eos)

    def _mask_constrained(
        self, jobs: list[Any], rows: list[int], device_logits: Any
    ) -> dict[int, Any]:
        """Mask, on the device, the tokens each constrained job's grammar rules out at this
        step; the masks are computed on the host while the GPU runs the forward pass.
        Returns the jobs' constraints by index."""
        constraints = {
            i: job.exlq_constraint
            for i, job in enumerate(jobs)
            if getattr(job, "exlq_constraint", None) is not None
        }
        if constraints:
            self._grammar_masks.apply(
                [(constraints[i], rows[i]) for i in constraints], device_logits[:, 0, :]
            )
        return constraints

    def _sample_on_gpu(
        self, jobs: list[Any], indices: list[int], rows: list[int], device_logits: Any
    ) -> dict[int, tuple[Any, Any]]:
        if len(rows) == device_logits.shape[0]:
            logits = device_logits[:, 0, :]
        else:
            index = torch.tensor(rows, dtype=torch.long).to(device_logits.device)
            logits = device_logits[:, 0, :].index_select(0, index)
        tokens, probs = sample_rows(
            logits,
            row_settings([jobs[i] for i in indices]),
            self.tokenizer.get_vocab_size(),
            before_wait=self.wait_work,
        )
        return {i: (tokens[j : j + 1], probs[j : j + 1]) for j, i in enumerate(indices)}
