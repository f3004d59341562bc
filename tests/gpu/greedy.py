"""Helpers the GPU tests share: a batch of greedy jobs run to the end (with its jobs, for
what they record, or as its tokens and logits), two such runs compared, the same jobs run
eagerly and from decode graphs, and seeded jobs of given sampling settings run to the
end."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def greedy_tokens_and_logits(
    generator: Any, prompts: list[Any], new_tokens: list[int]
) -> dict[int, tuple[list[int], Any]]:
    """Each job's greedy tokens and their logits (float, on the CPU), all jobs batched
    together; job i runs prompts[i] for new_tokens[i] tokens, no stop conditions."""
    import torch

    _, tokens, logits = run_greedy(generator, prompts, new_tokens)
    return {i: (tokens[i], torch.cat(logits[i])) for i in tokens}


def run_greedy(
    generator: Any, prompts: list[Any], new_tokens: list[int]
) -> tuple[list[Any], dict[int, list[int]], dict[int, list[Any]]]:
    """Greedy jobs batched together, job i on prompts[i] for new_tokens[i] tokens, no stop
    conditions, run to the end: the jobs, each one's tokens, and the logits of each of its
    steps (float, on the CPU)."""
    from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    jobs = [
        ExLlamaV2DynamicJob(
            input_ids=ids,
            max_new_tokens=new,
            stop_conditions=[],
            gen_settings=ExLlamaV2Sampler.Settings.greedy(),
            return_logits=True,
            identifier=i,
        )
        for i, (ids, new) in enumerate(zip(prompts, new_tokens, strict=True))
    ]
    for job in jobs:
        generator.enqueue(job)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    logits: dict[int, list[Any]] = {i: [] for i in range(len(prompts))}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result.get("stage") == "streaming" and "token_ids" in result:
                tokens[result["identifier"]] += result["token_ids"].flatten().tolist()
                logits[result["identifier"]].append(result["logits"][0].float().cpu())
    return jobs, tokens, logits


def assert_same_greedy(
    want: dict[int, tuple[list[int], Any]],
    got: dict[int, tuple[list[int], Any]],
    new_tokens: list[int],
    tolerance: float = 2e-2,
) -> float:
    """Two runs of the same greedy jobs computed the same thing: up to each job's first
    differing token both runs saw the same inputs, so their logits agree within
    `tolerance`, and a token may differ only where the top two logits are a near tie.
    Returns the largest logit difference seen."""
    worst = 0.0
    for i, (want_tokens, want_logits) in want.items():
        got_tokens, got_logits = got[i]
        assert len(got_tokens) == new_tokens[i]
        same = next(
            (t for t, (a, b) in enumerate(zip(want_tokens, got_tokens, strict=True)) if a != b),
            len(want_tokens),
        )
        upto = min(same + 1, len(want_tokens))
        diff = (want_logits[:upto] - got_logits[:upto]).abs().max().item()
        worst = max(worst, diff)
        assert diff <= tolerance, f"job {i}: logits differ by {diff}"
        if same < len(want_tokens):
            top2 = want_logits[same].topk(2).values
            assert (top2[0] - top2[1]).item() <= 2 * diff, f"job {i}: token {same} differs"
    return worst


def compare_replay_with_eager(
    generator: Any,
    generate: Callable[[Any], dict[int, tuple[list[int], Any]]],
    max_batch: int,
    new_tokens: list[int],
    after_capture: Callable[[Any], None] | None = None,
) -> tuple[Any, float]:
    """Run `generate` eagerly, then again with decode graphs captured for 1..max_batch jobs
    (`after_capture` may set them up further); assert that the decode steps replayed and
    computed the same (assert_same_greedy). Returns the graphs and the largest logit
    difference."""
    from exlq.worker.engines.exllamav2.graphs import decode_graphs_for

    eager = generate(generator)
    graphs = decode_graphs_for(generator, max_batch)
    graphs.capture()
    if after_capture is not None:
        after_capture(graphs)
    graphs.install()
    generator.reset_page_table()
    replayed = generate(generator)
    assert graphs.replays >= max(new_tokens) - 1, "decode steps did not go through the graphs"
    return graphs, assert_same_greedy(eager, replayed, new_tokens)


def seeded_tokens(generator: Any, settings: list[Any]) -> tuple[list[list[int]], list[Any]]:
    """Job i samples with settings[i] and seed 100 + i, from its own random prompt of
    50 + 97 * i tokens, for 24 + 3 * i new tokens, all batched together, no stop
    conditions; each job's tokens, and the jobs."""
    import torch
    from exllamav2.generator import ExLlamaV2DynamicJob

    rng = torch.Generator().manual_seed(3)
    jobs = []
    for i, s in enumerate(settings):
        job = ExLlamaV2DynamicJob(
            input_ids=torch.randint(3, 32000, (1, 50 + 97 * i), generator=rng),
            max_new_tokens=24 + 3 * i,
            stop_conditions=[],
            gen_settings=s,
            seed=100 + i,
            identifier=i,
        )
        generator.enqueue(job)
        jobs.append(job)
    tokens: list[list[int]] = [[] for _ in settings]
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result.get("stage") == "streaming" and "token_ids" in result:
                tokens[result["identifier"]] += result["token_ids"].flatten().tolist()
    return tokens, jobs
