"""JobSampler: picks one job's next token from its row of logits, with the job's own random
generator, so that a seeded job draws the same tokens whatever else runs beside it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from exlq.worker.engines.engine_request import SamplingFields


class JobSampler:
    """Greedy when temperature is 0; else penalties, temperature, then top-k, top-p,
    typical and min-p filters over the tempered distribution, and one draw."""

    def __init__(
        self,
        sampling: SamplingFields,
        seed: int,
        prompt_ids: Sequence[int],
        vocab_size: int,
        device: Any,
    ) -> None:
        self.s = sampling
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.penalized = (
            sampling.repetition_penalty != 1.0
            or sampling.frequency_penalty != 0.0
            or sampling.presence_penalty != 0.0
        )
        # Argmax of the raw logits: the batch computes these for every row in one call.
        self.plain_greedy = sampling.temperature == 0.0 and not self.penalized
        self._seen: torch.Tensor | None = None  # prompt and completion tokens (repetition)
        self._counts: torch.Tensor | None = None  # completion tokens (frequency, presence)
        if self.penalized:
            self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self._seen[torch.tensor(list(prompt_ids), dtype=torch.long, device=device)] = True
            self._counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from one row of logits (vocabulary-sized)."""
        scores = logits.float()
        if self.penalized:
            scores = self._penalize(scores)
        if self.s.temperature == 0.0:
            return int(scores.argmax())
        probs = torch.softmax(scores / self.s.temperature, dim=-1)
        probs = filtered(probs, self.s)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def chose(self, token_id: int) -> None:
        """Record the job's new token, for the penalties of the tokens after it."""
        if self._seen is not None and self._counts is not None:
            self._seen[token_id] = True
            self._counts[token_id] += 1

    def _penalize(self, scores: torch.Tensor) -> torch.Tensor:
        assert self._seen is not None and self._counts is not None
        s = self.s
        if s.repetition_penalty != 1.0:
            # As transformers and vLLM do: a seen token's logit moves towards "less likely"
            # whatever its sign.
            scaled = torch.where(
                scores > 0, scores / s.repetition_penalty, scores * s.repetition_penalty
            )
            scores = torch.where(self._seen, scaled, scores)
        if s.frequency_penalty != 0.0 or s.presence_penalty != 0.0:
            present = (self._counts > 0).float()
            scores = scores - s.frequency_penalty * self._counts - s.presence_penalty * present
        return scores


def filtered(probs: torch.Tensor, s: SamplingFields) -> torch.Tensor:
    """``probs`` with the tokens that top-k, top-p, typical and min-p rule out set to 0,
    each filter reading what the one before it left (renormalized)."""
    if 0 < s.top_k < probs.shape[-1]:
        kth = torch.topk(probs, s.top_k).values[-1]
        probs = _renormalized(torch.where(probs >= kth, probs, 0.0))
    if s.top_p < 1.0:
        probs = _renormalized(_nucleus(probs, probs, s.top_p))
    if s.typical < 1.0:
        # Typical sampling (Meister et al.): keep the tokens whose surprise is nearest the
        # distribution's entropy, the fewest that hold ``typical`` of the mass.
        logp = torch.log(probs.clamp_min(1e-30))
        entropy = -(probs * logp).sum()
        probs = _renormalized(_nucleus(probs, -(logp + entropy).abs(), s.typical))
    if s.min_p > 0.0:
        probs = torch.where(probs >= s.min_p * probs.max(), probs, 0.0)
    return probs


def _nucleus(probs: torch.Tensor, rank: torch.Tensor, mass: float) -> torch.Tensor:
    """Keep the tokens of highest ``rank``, the fewest whose probabilities add up to at least
    ``mass`` (always the first)."""
    order = torch.argsort(rank, descending=True)
    sorted_probs = probs[order]
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass ranked above each
    drop = before >= mass
    drop[0] = False
    kept = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, kept)


def _renormalized(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum()


def top_logprobs(logits: torch.Tensor, chosen: int, count: int) -> list[tuple[int, float]]:
    """The model's own log-probabilities (before penalties and temperature) of the ``count``
    likeliest tokens, most likely first, and of the chosen token last if it is not among
    them."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, count)
    pairs = list(zip(ids.tolist(), values.tolist(), strict=True))
    if all(token_id != chosen for token_id, _ in pairs):
        pairs.append((chosen, float(logprobs[chosen])))
    return pairs
