"""Batched token sampling on the GPU, with the distribution exllamav2's CPU sampler draws from.

exllamav2 samples each job on the CPU: the step's logits (jobs x vocabulary, float32) are
copied to the host and every job runs its own softmax and filters over the whole vocabulary,
one after another while the GPU waits, so the step grows with every job. For the settings
below this module does the same for every row in a few batched operations on the GPU and
copies back only the chosen token and its probability.

Per row, exactly as exllamav2 0.3.2's `sample_basic` (ext_sampling.cpp, sampling.cpp):
  1. probabilities = softmax(logits / temperature) over the tokenizer's vocabulary
     (temperature < 0.01 means greedy: temperature 1, top_k 1);
  2. top_k > 0 (and below the vocabulary): keep the k most probable tokens (which of
     several tokens tied at the k-th probability stay is unspecified, in both);
  3. 0 < min_p < 1: keep tokens whose probability is at least min_p times the largest;
  4. renormalise, and draw with the row's uniform number u in [0, 1) by inverse CDF.
top_k 1 is argmax (first index of the largest logit) with probability 1, as exllamav2 gives.
The draw walks tokens in vocabulary order where exllamav2 walks its candidate list; both
draw each token with its probability, so the same u may pick another token than exllamav2
would. Settings this module does not implement (top_p, typical, penalties, ...) stay with
exllamav2's sampler: see worker/engines/exllamav2/generator.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

GREEDY_BELOW_TEMPERATURE = 0.01  # exllamav2: temperature < 0.01 samples greedily


class RowSettings(NamedTuple):
    """Each row's settings, in row order, and the uniform number in [0, 1) it draws with."""

    temperature: list[float]
    top_k: list[int]
    min_p: list[float]
    uniform: list[float]


def sampling_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor,
    vocab_size: int,
    max_top_k: int,
) -> torch.Tensor:
    """The renormalised distribution each row draws from: (rows, vocab) float32.

    logits (rows, padded vocab); temperature, min_p float32 (rows,); top_k int64 (rows,);
    max_top_k the largest top_k of any row that limits (0 if none does), known on the host
    so that nothing here waits for the GPU. Columns from vocab_size on (padding of the
    output layer) get probability 0. Greedy rows are left to draw().
    """
    import torch

    width = logits.shape[1]
    greedy = temperature < GREEDY_BELOW_TEMPERATURE
    temperature = torch.where(greedy, torch.ones_like(temperature), temperature)
    scores = logits.float()
    if vocab_size < width:
        scores = scores.clone()
        scores[:, vocab_size:] = float("-inf")
    probs = torch.softmax(scores / temperature.unsqueeze(1), dim=-1)
    if max_top_k > 0:
        # Exactly k tokens, as exllamav2 keeps: among tokens tied at the k-th probability,
        # which ones stay is unspecified (exllamav2 keeps the first it met).
        limited = (top_k > 0) & (top_k < vocab_size)
        ranked = probs.topk(max_top_k, dim=-1).indices
        within = torch.arange(max_top_k, device=probs.device) < top_k.unsqueeze(1)
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, ranked, within)
        probs = torch.where(limited.unsqueeze(1) & ~keep, 0.0, probs)
    top = probs.amax(dim=-1, keepdim=True)
    floor = torch.where((min_p > 0) & (min_p < 1), min_p, 0.0).unsqueeze(1) * top
    probs = torch.where(probs < floor, 0.0, probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def draw(
    logits: torch.Tensor,
    probs: torch.Tensor,
    greedy: torch.Tensor,
    uniform: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids int64, their probabilities float32), one per row.

    Greedy rows take the first index of the largest logit, probability 1; the others the
    first token whose cumulative probability reaches uniform (scaled by the row's total, so
    rounding never runs past the last token that can be drawn).
    """
    import torch

    cumulative = probs.cumsum(dim=-1)
    total = cumulative[:, -1:]
    # u = 0 would select a leading zero-probability token: draw from (0, total] instead.
    target = torch.clamp(uniform.unsqueeze(1), min=1e-12) * total
    drawn = torch.searchsorted(cumulative, target).squeeze(1).clamp_(max=probs.shape[1] - 1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)
    chosen = probs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, torch.where(greedy, torch.ones_like(chosen), chosen)


def sample_on_device(
    logits: torch.Tensor, rows: RowSettings, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample one token per row of device logits (rows, padded vocab), leaving the result on
    the device: token ids (rows,) int64 and their probabilities (rows,) float32, or None for
    the probabilities when every row is greedy (each is then 1). Nothing here waits for the
    GPU: one small asynchronous copy takes the settings to the device, and a batch of greedy
    rows only (known here on the host) needs no distribution at all, just the argmax."""
    import torch

    temperature, top_k, min_p, uniform = rows
    logits = logits[:, :vocab_size]  # the output layer's padding is never drawn
    if all(t < GREEDY_BELOW_TEMPERATURE or k == 1 for t, k in zip(temperature, top_k, strict=True)):
        return logits.argmax(dim=-1), None
    dev = logits.device
    pinned = dev.type == "cuda"
    settings = torch.tensor([temperature, min_p, uniform], dtype=torch.float32, pin_memory=pinned)
    ks = torch.tensor(top_k, dtype=torch.int64, pin_memory=pinned)
    settings, ks = settings.to(dev, non_blocking=True), ks.to(dev, non_blocking=True)
    temps, mins, us = settings[0], settings[1], settings[2]
    max_top_k = max((k for k in top_k if 1 < k < vocab_size), default=0)
    probs = sampling_probs(logits, temps, ks, mins, vocab_size, max_top_k)
    greedy = (temps < GREEDY_BELOW_TEMPERATURE) | (ks == 1)
    return draw(logits, probs, greedy, us)


def sample_rows(
    logits: torch.Tensor,
    rows: RowSettings,
    vocab_size: int,
    before_wait: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of device logits (rows, padded vocab), as sample_on_device,
    and wait for the result.

    Returns host tensors of shape (rows, 1): token ids (int64) and their probabilities
    (float32), so that row j is `tokens[j : j + 1]`, the shape exllamav2 hands a job. The copy
    back is the only wait for the GPU; ``before_wait`` runs once the sampling is queued on
    the GPU, before that wait.
    """
    import torch

    tokens, chosen = sample_on_device(logits, rows, vocab_size)
    if chosen is None:
        host_tokens = _to_host(tokens.unsqueeze(1), before_wait)
        return host_tokens, torch.ones(host_tokens.shape, dtype=torch.float32)
    out = _to_host(torch.stack([tokens.double(), chosen.double()], dim=1), before_wait)
    return out[:, :1].long(), out[:, 1:].float()


def _to_host(on_device: torch.Tensor, before_wait: Callable[[], None] | None) -> torch.Tensor:
    """The step's one wait for the GPU: ``before_wait`` runs first, while the GPU works."""
    if before_wait is not None:
        before_wait()
    return on_device.cpu()
