"""A request's sampling as exllamav3's sampler: one ComboSampler (penalties, temperature,
min_p, top_k, top_p, then a draw or argmax) for every job that samples alike."""

from __future__ import annotations

import functools
from typing import Any

from exlq.protocol.models import InvalidRequest
from exlq.worker.engines.engine_request import SamplingFields, sampling_settings

# Jobs of equal sampling share one sampler: exllamav3's steps keep no state between draws
# except adaptive-P's, which exlq never turns on. Its draws come from each job's own seeded
# random.Random, so sharing changes no job's tokens.
SAMPLERS_KEPT = 256


def sampler_for(sampling: SamplingFields) -> Any:
    """exllamav3's sampler for a request's sampling (its seed aside). InvalidRequest for
    what exllamav3 cannot sample (typical sampling)."""
    if sampling.typical < 1.0:
        raise InvalidRequest(
            "sampling.typical: the exllamav3 engine has no typical sampling; leave it at 1.0 "
            "or send the job to an exllamav2 or transformers worker"
        )
    return _sampler(*sampling_settings(sampling))


@functools.lru_cache(maxsize=SAMPLERS_KEPT)
def _sampler(
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    typical: float,
    repetition_penalty: float,
    frequency_penalty: float,
    presence_penalty: float,
) -> Any:
    from exllamav3 import ComboSampler

    del typical  # refused above unless 1.0 (off)
    return ComboSampler(
        rep_p=repetition_penalty,
        freq_p=frequency_penalty,
        pres_p=presence_penalty,
        temperature=temperature,
        min_p=min_p,
        top_k=top_k,
        top_p=top_p,
    )
