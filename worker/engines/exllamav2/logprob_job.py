"""RawLogprobJob: an exllamav2 job whose reported top tokens are the model's raw
distribution's on exllamav2's own sampling step (logprobs.py says why)."""

from __future__ import annotations

from typing import Any

import torch
from exllamav2.generator import ExLlamaV2DynamicJob

from exlq.worker.engines.exllamav2.logprobs import top_logprobs


class RawLogprobJob(ExLlamaV2DynamicJob):  # type: ignore[misc]
    """An exllamav2 job whose reported top tokens are the model's raw distribution's, where
    exllamav2's own step samples it (the drafting step). ``return_top_tokens`` is the
    request's count plus one (the chosen token's column)."""

    def receive_logits(self, logits: torch.Tensor) -> Any:
        token, _, _, prob, filter_eos = super().receive_logits(logits)
        ids, values = top_logprobs(
            logits[:1, 0, :],
            token.view(1).to(logits.device),
            self.return_top_tokens - 1,
            self.generator.tokenizer.get_vocab_size(),
        )
        return token, ids.view(1, 1, -1), values.view(1, 1, -1), prob, filter_eos
