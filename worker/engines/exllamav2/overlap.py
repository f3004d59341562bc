"""Overlapped decode steps: each decode step is launched from the tokens the GPU sampled in
the step before, and only then does the host read those tokens and hand them to their jobs.

Without it a step is: launch the forward pass and the sampling, wait for the tokens, hand
each job its token (exllamav2's receive_sample: stop conditions, held text, page hashes,
about 50 µs a job), then launch the next step. At 64 jobs that hand-over is about 3.5 ms
a step with the GPU idle (docs/PERFORMANCE.md, "Where a step's time goes"). With it, step
k's ids are step k-1's sampled tokens, copied on the device (DecodeGraphs.replay's
`carried`), and step k-1's hand-over runs while the GPU computes step k: the GPU waits only
where the host's work for a step is longer than the step.

Step k assumes each job accepts its step k-1 token as sampled, which holds for the jobs
this runs (sampleable.overlappable: sampled on the GPU, no grammar, no banned strings, no
logprobs). A job that ends on its step k-1 token (a stop token or stop string) computed
one row of step k for nothing: its row is dropped, and its pages, freed after, are written
by later work only, which the stream queues behind step k. A job whose step k-1 token is
its last (max_new_tokens) is left out of step k.

The host's view of a job in flight lags by one token: its sequence ends a token short, so
its row of step k reads one more cached token than its kv_position says, and its block
table reaches one token further. finish() then accepts the token (receive_sample) and, as
the step that took it on the device has run, books it into the job's page at once
(book_token: what get_input_ids_list(add_to_cache=True) does for one token); exllamav2
books a token when the step that feeds it is launched, one iteration later. A page is thus
full one iteration sooner, which only a job's prefill() reads, and only for a job exllamav2
never marked prefilled (its whole prompt found in a partially matching page): launch()
marks every job it runs prefilled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from exllamav2.ext import none_tensor

from exlq.worker.engines.exllamav2.page_booking import book_token
from exlq.worker.engines.exllamav2.sampleable import overlappable, row_settings
from exlq.worker.kernels.sampling import sample_on_device


@dataclass(slots=True)
class StepInFlight:
    """A decode step launched and not yet read: its jobs in row order, its sampled tokens on
    the device (the next step's ids), and a host copy of (token, probability) per row,
    written once `ready` has passed."""

    jobs: list[Any]
    tokens: Any  # device (rows,) int64
    host: Any  # pinned (rows, 2) float64
    ready: Any  # torch.cuda.Event


class OverlappedDecode:
    """The decode steps of an ExlqDynamicGenerator whose step is replayed from CUDA graphs
    that start from token ids (`graphs`, DecodeGraphs) and whose jobs sample on the GPU."""

    def __init__(self, generator: Any, graphs: Any) -> None:
        self._generator = generator
        self._graphs = graphs
        rows = generator.max_batch_size
        # Two host buffers: step k's tokens land in one while step k-1's are read from the
        # other.
        self._host = [torch.empty((rows, 2), dtype=torch.float64, pin_memory=True) for _ in "ab"]
        self._turn = 0
        self.in_flight: StepInFlight | None = None
        self.launched = 0  # steps launched before the step ahead of them was read
        # False: every step runs to its end (a step in flight is read first), for side-by-side
        # measurements and tests.
        self.enabled = True

    def can_run(self, jobs: list[Any]) -> bool:
        """Whether this step of `jobs` may overlap: every job overlappable, and the batch
        replays a graph (a block table as wide as the graphs' is always in reach)."""
        return (
            self.enabled
            and bool(jobs)
            and self._graphs.fits(len(jobs), self._graphs.max_pages)
            and all(overlappable(job) for job in jobs)
        )

    def launch(self, jobs: list[Any]) -> StepInFlight | None:
        """Queue a decode step of `jobs` (can_run) and its sampling on the GPU; the jobs with a
        token in flight take it on the device, except those for which it is the last. None
        when no job is left to run."""
        gen = self._generator
        prior = self.in_flight
        in_flight = {id(job): row for row, job in enumerate(prior.jobs)} if prior else {}
        jobs = [job for job in jobs if not _ends_in_flight(job, id(job) in in_flight)]
        if not jobs:
            return None
        batch = len(jobs)
        ids = torch.zeros((batch, 1), dtype=torch.long)
        block_index = torch.zeros((batch, self._graphs.max_pages), dtype=torch.int32)
        seqlens = torch.zeros((batch,), dtype=torch.int32)
        carried_from: list[int] = []
        carried_to: list[int] = []
        now = time.time()  # as ExlqDynamicGenerator._forward stamps a job's first step
        for row, job in enumerate(jobs):
            seq = job.sequences[0]
            if job.time_first_token is None:
                job.time_first_token = now
            prior_row = in_flight.get(id(job))
            if prior_row is None:
                # A job's first step here (a job carried was marked in that one). exllamav2
                # leaves this unset for a job whose whole prompt came from a partially
                # matching page, and then runs its prefill() every step, which moves
                # kv_position past a full page at it: with finish()'s booking, one token too
                # early. A job in decode has no prefill left.
                seq.prefill_complete = True
                ids[row] = job.get_input_ids_list(add_to_cache=True)[0][0]
                length, cached = len(seq.sequence_ids), seq.kv_position
            else:
                carried_from.append(prior_row)
                carried_to.append(row)
                length, cached = len(seq.sequence_ids) + 1, seq.kv_position + 1
            pages = job.get_block_index(seq, length)
            block_index[row, : pages.shape[-1]] = pages
            seqlens[row] = cached
        carried: tuple[Any, Any] | None = None
        if prior is not None and carried_from:
            if carried_from == carried_to and carried_to[-1] == len(carried_to) - 1:
                carried = (prior.tokens, len(carried_to))  # the jobs kept their rows
            else:  # a job before them ended, or the rows moved
                index = torch.tensor([carried_from, carried_to], dtype=torch.long, pin_memory=True)
                carried = (prior.tokens, index.to(prior.tokens.device, non_blocking=True))
        logits = self._graphs.replay(ids, block_index, seqlens, carried)
        tokens, probs = sample_on_device(
            logits[:, 0, :], row_settings(jobs), gen.tokenizer.get_vocab_size()
        )
        if probs is None:
            probs = torch.ones_like(tokens, dtype=torch.float64)
        host = self._host[self._turn][:batch]
        self._turn ^= 1
        host.copy_(torch.stack([tokens.double(), probs.double()], dim=1), non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        gen.gpu_sampled += batch
        if prior is not None:
            self.launched += 1
        return StepInFlight(jobs, tokens, host, ready)

    def finish(self, step: StepInFlight, results: list[Any], fed: StepInFlight | None) -> list[Any]:
        """Hand each job of `step` still running its token (exllamav2's receive_sample, its
        results into `results`); a job that goes on and whose token `fed` took on the device
        has it booked into its page. Returns the jobs that ended."""
        step.ready.synchronize()
        tokens = step.host[:, :1].long()
        token_ids = tokens[:, 0].tolist()
        # Each row's (1, 1) token and probability, as receive_sample takes them: split at
        # once rather than sliced job by job.
        token_rows = tokens.split(1)
        prob_rows = step.host[:, 1:].float().split(1)
        running = {id(job) for job in self._generator.active_jobs}  # not cancelled since
        fed_jobs = {id(job) for job in fed.jobs} if fed is not None else set()
        page_size = self._generator.page_size
        ended = []
        for row, job in enumerate(step.jobs):
            if id(job) not in running:
                continue
            eos, _ = job.receive_sample(
                None,
                token_rows[row],
                none_tensor,
                none_tensor,
                prob_rows[row],
                False,
                results,
                True,
            )
            if eos:
                ended.append(job)
            elif id(job) in fed_jobs:
                book_token(job, token_ids[row], page_size)
        return ended


def _ends_in_flight(job: Any, has_token_in_flight: bool) -> bool:
    """Whether the token `job` has in flight is its last (max_new_tokens)."""
    return has_token_in_flight and job.new_tokens + 1 >= job.max_new_tokens
