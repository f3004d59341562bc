"""One helper the GPU tests share: a batch of greedy jobs run to the end."""

from __future__ import annotations

from typing import Any


def greedy_tokens_and_logits(
    generator: Any, prompts: list[Any], new_tokens: list[int]
) -> dict[int, tuple[list[int], Any]]:
    """Each job's greedy tokens and their logits (float, on the CPU), all jobs batched
    together; job i runs prompts[i] for new_tokens[i] tokens, no stop conditions."""
    import torch
    from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    for i, (ids, new) in enumerate(zip(prompts, new_tokens, strict=True)):
        generator.enqueue(
            ExLlamaV2DynamicJob(
                input_ids=ids,
                max_new_tokens=new,
                stop_conditions=[],
                gen_settings=ExLlamaV2Sampler.Settings.greedy(),
                return_logits=True,
                identifier=i,
            )
        )
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    logits: dict[int, list[Any]] = {i: [] for i in range(len(prompts))}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result.get("stage") == "streaming" and "token_ids" in result:
                tokens[result["identifier"]] += result["token_ids"].flatten().tolist()
                logits[result["identifier"]].append(result["logits"][0].float().cpu())
    return {i: (tokens[i], torch.cat(logits[i])) for i in tokens}
