"""exllamav3's streaming results as exlq's typed outputs: a job's new text, token ids and
logprobs (TokenChunk) and its end (JobEnded). Plain Python over the result dicts (torch
tensors inside them are only read), so it runs without exllamav3 or a GPU.

exllamav3 holds text back while it might begin a stop string or is half a character, and
releases it with the tokens (and their probabilities) that made it. When a stop or
end-of-text token ends the job, what it still held is in the result's ``held``: that text is
the completion's, the token that ended it is not (as on exlq's other engines).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from exlq.protocol.models import TokenChoices, TokenLogprob
from exlq.worker.engines.base import EngineOutput, TokenChunk
from exlq.worker.engines.exllama_results import ended_job

# JSON has no -inf: a token the model rules out gets log(1e-30), as on exlq's other engines.
MIN_LOGPROB = math.log(1e-30)

Pieces = Callable[[], list[str]]  # the text of every token id, made on first use


def outputs_of(
    job_id: str, result: Mapping[str, Any], pieces: Pieces, prompt_tokens: int
) -> list[EngineOutput]:
    """What one streaming result says of ``job_id``: its new text, if any, then its end, if
    the result ends it (``prompt_tokens`` where the result does not say)."""
    text: str = result.get("text", "")
    ids = result.get("token_ids")
    token_ids: list[int] = ids.view(-1).tolist() if ids is not None else []
    choices = token_choices(result, len(token_ids), pieces)
    if result["eos"] and result.get("eos_reason") == "stop_token":
        held = result.get("held") or {}
        text += held.get("text", "")
        held_ids = held.get("token_ids")
        if held_ids is not None:
            kept = held_ids.view(-1).tolist()[:-1]  # the last: the token that ended the job
            token_ids += kept
            choices += token_choices(held, len(kept), pieces)
    outputs: list[EngineOutput] = []
    if text or token_ids:
        outputs.append(TokenChunk(job_id, text, token_ids, choices or None))
    if result["eos"]:
        outputs.append(ended_job(job_id, result, prompt_tokens))
    return outputs


def token_choices(result: Mapping[str, Any], count: int, pieces: Pieces) -> list[TokenChoices]:
    """The logprobs of ``result``'s first ``count`` tokens (none where the job asked for
    none): each one's likeliest tokens, most likely first, then the chosen token where it
    is not among them. exllamav3 gives probabilities (``top_k_probs``, ``token_probs``)."""
    top_ids = result.get("top_k_tokens")  # (1, tokens, k)
    top_probs = result.get("top_k_probs")
    chosen_probs = result.get("token_probs")  # (1, tokens)
    token_ids = result.get("token_ids")
    if top_ids is None or top_probs is None or chosen_probs is None or token_ids is None:
        return []
    names = pieces()
    log_top = top_probs.float().log().clamp_min(MIN_LOGPROB)[0].tolist()
    log_chosen = chosen_probs.float().log().clamp_min(MIN_LOGPROB).view(-1).tolist()
    rows = zip(top_ids[0].tolist(), log_top, token_ids.view(-1).tolist(), log_chosen, strict=True)
    choices = []
    for ids, values, chosen, chosen_value in list(rows)[:count]:
        top = [
            TokenLogprob(token=names[i], token_id=i, logprob=v)
            for i, v in zip(ids, values, strict=True)
        ]
        if chosen not in ids:
            top.append(TokenLogprob(token=names[chosen], token_id=chosen, logprob=chosen_value))
        choices.append(TokenChoices(top=top))
    return choices
