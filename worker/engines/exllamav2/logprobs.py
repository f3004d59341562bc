"""Logprobs of the model's own distribution for exllamav2 jobs, on every sampling path.

exllamav2 reports a job's top tokens from the distribution its sampler drew from, after
temperature and filters: under greedy sampling the chosen token has probability 1 and every
other 0, which describes the sampler, not the model. OpenAI and vLLM report the model's
log-softmax before any of that, so exlq computes them from the raw logits itself:
- on exlq's decode step (generator.py), for every job that asks, in one batch on the GPU,
  before a grammar's mask touches the logits;
- on exllamav2's own step (the one that verifies drafted tokens), in the job's
  receive_logits, which gets the raw logits row (logprob_job.RawLogprobJob).

A job asks for ``count`` alternatives; exllamav2 is told ``count + 1`` so that its held-back
buffers (text held for stop strings goes out with its logprobs) carry one more column: the
chosen token. The values carried are logprobs, not probabilities.
"""

from __future__ import annotations

import torch

from exlq.protocol.models import TokenChoices, TokenLogprob

# JSON has no -inf: a token the model rules out gets log(1e-30), as exlq's other engines.
MIN_LOGPROB = -69.07755278982137


def top_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, count: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of logits (rows, width) -> (ids, logprobs) of shape (rows, count + 1): each row's
    ``count`` likeliest tokens, most likely first, then the chosen token (chosen: (rows,)
    int64, on the logits' device). Columns past vocab_size (the output layer's padding) are
    never reported."""
    logprobs = torch.log_softmax(logits[:, :vocab_size].float(), dim=-1)
    values, ids = logprobs.topk(count, dim=-1)
    chosen = chosen.view(-1, 1)
    ids = torch.cat([ids, chosen], dim=1)
    values = torch.cat([values, logprobs.gather(1, chosen)], dim=1)
    return ids, values.clamp_min(MIN_LOGPROB)


def token_choices(
    top_ids: torch.Tensor, top_logprobs: torch.Tensor, pieces: list[str]
) -> list[TokenChoices]:
    """One TokenChoices per position from held top tokens (1, positions, count + 1): the
    ``count`` likeliest, then the chosen token where it is not among them."""
    choices = []
    for ids, values in zip(top_ids[0].tolist(), top_logprobs[0].tolist(), strict=True):
        chosen = ids[-1]
        top = [
            TokenLogprob(token=pieces[i], token_id=i, logprob=v)
            for i, v in zip(ids[:-1], values[:-1], strict=True)
        ]
        if chosen not in ids[:-1]:
            top.append(TokenLogprob(token=pieces[chosen], token_id=chosen, logprob=values[-1]))
        choices.append(TokenChoices(top=top))
    return choices
