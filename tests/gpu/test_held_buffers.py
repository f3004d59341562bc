"""A job's held-back buffers allocated on first use (worker/engines/exllamav2_held_buffers.py):
exllamav2 still makes them the way LazySeqTensor stands in for, LazySeqTensor holds what
SeqTensor holds, and jobs run the same while allocating only what they fill."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

pytestmark = pytest.mark.gpu


def test_exllamav2_still_makes_a_jobs_held_buffers_the_way_the_lazy_ones_replace(
    cuda: None,
) -> None:
    from exllamav2 import util
    from exllamav2.generator import ExLlamaV2DynamicJob, dynamic

    from worker.engines.exllamav2_held_buffers import LazySeqTensor

    assert list(inspect.signature(util.SeqTensor.__init__).parameters) == [
        "self",
        "shape",
        "dtype",
        "seq_dim",
        "device",
        "init_cap",
    ]
    assert util.SeqTensor.PAGE_SIZE == 256
    init = inspect.getsource(util.SeqTensor.__init__)
    assert "self.tensor = torch.empty(shape, dtype = dtype, device = device)" in init
    assert dynamic.SeqTensor in (util.SeqTensor, LazySeqTensor)
    # The job module makes a SeqTensor in these five places only (from_tensor, which builds
    # a job's prompt, is util's and allocates at once).
    assert inspect.getsource(ExLlamaV2DynamicJob.prepare_for_queue).count("SeqTensor((1, 0") == 5
    assert inspect.getsource(dynamic).count("SeqTensor(") == 5


@pytest.mark.parametrize(
    ("shape", "seq_dim", "kind"),
    [((1, 0), -1, "long"), ((1, 0, 3), 1, "float"), ((1, 0, 50), 1, "float")],
)
def test_a_lazy_buffer_holds_what_exllamav2s_holds(
    cuda: None, shape: tuple[int, ...], seq_dim: int, kind: str
) -> None:
    import torch
    from exllamav2.util import SeqTensor

    from worker.engines.exllamav2_held_buffers import LazySeqTensor

    dtype = getattr(torch, kind)
    plain, lazy = SeqTensor(shape, dtype, seq_dim), LazySeqTensor(shape, dtype, seq_dim)
    lazy.clear()
    assert (len(lazy), bool(lazy), lazy.seq_cap, lazy.allocated) == (0, False, plain.seq_cap, False)
    assert torch.equal(lazy.clone(1).torch(), plain.clone(1).torch())  # empty either way

    rng = torch.Generator().manual_seed(0)
    for rows in (1, 5, 300, 1):  # 307 rows: past the first 256, so the buffer grows
        size = list(shape)
        size[seq_dim] = rows
        data = torch.randint(0, 1000, size, generator=rng).to(dtype)
        plain.append(data)
        lazy.append(data)
        assert torch.equal(lazy.torch(), plain.torch())
        assert (len(lazy), lazy.seq_cap) == (len(plain), plain.seq_cap)
    assert lazy.allocated
    assert torch.equal(lazy.clone(1).torch(), plain.clone(1).torch())
    assert torch.equal(lazy.torch_slice(2, 9), plain.torch_slice(2, 9))
    lazy.truncate(4)
    plain.truncate(4)
    assert torch.equal(lazy.torch(), plain.torch())
    lazy.set(data)
    plain.set(data)
    assert torch.equal(lazy.torch(), plain.torch())


def _run(generator: Any, banned: str | None) -> tuple[list[Any], dict[str, dict[str, Any]]]:
    """A greedy job, one with logprobs, and (given ``banned``) a greedy one banning that
    string, run together; returns the jobs and what each streamed."""
    import torch
    from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    prompt = torch.randint(3, 32000, (1, 40), generator=torch.Generator().manual_seed(7))
    kinds: dict[str, dict[str, Any]] = {
        "greedy": {},
        "logprobs": {"return_probs": True, "return_top_tokens": 3},
    }
    if banned is not None:
        kinds["banned"] = {"banned_strings": [banned]}
    jobs = [
        ExLlamaV2DynamicJob(
            input_ids=prompt,
            max_new_tokens=24,
            stop_conditions=[],
            gen_settings=ExLlamaV2Sampler.Settings.greedy(),
            identifier=name,
            **options,
        )
        for name, options in kinds.items()
    ]
    generator.enqueue(jobs)
    out: dict[str, dict[str, Any]] = {name: {"text": ""} for name in kinds}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result.get("stage") != "streaming":
                continue
            got = out[result["identifier"]]
            got["text"] += result.get("text", "")
            for key in ("token_ids", "token_probs", "top_k_tokens", "top_k_probs"):
                if key in result:
                    got.setdefault(key, []).extend(result[key].flatten().tolist())
    return jobs, out


def test_jobs_fill_only_the_buffers_they_return_and_stream_as_before(
    make_generator: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from exllamav2 import util
    from exllamav2.generator import dynamic

    from worker.engines.exllamav2_held_buffers import LazySeqTensor

    generator = make_generator(exlq=True)
    assert dynamic.SeqTensor is LazySeqTensor
    _, first = _run(generator, None)
    text = first["greedy"]["text"]
    banned = text[len(text) // 2 : len(text) // 2 + 2]
    assert banned.strip(), f"no banned string to take from {text!r}"

    lazy_jobs, lazy = _run(generator, banned)
    with monkeypatch.context() as patch:
        patch.setattr(dynamic, "SeqTensor", util.SeqTensor)
        plain_jobs, plain = _run(generator, banned)
    assert lazy == plain
    assert isinstance(plain_jobs[0].held_logits, util.SeqTensor)
    assert not isinstance(plain_jobs[0].held_logits, LazySeqTensor)
    assert len(lazy["greedy"]["token_ids"]) == 24
    assert len(lazy["logprobs"]["token_probs"]) == 24
    assert len(lazy["logprobs"]["top_k_probs"]) == 24 * 3
    assert banned.lower() not in lazy["banned"]["text"].lower()

    greedy, logprobs, _ = lazy_jobs
    assert greedy.held_tokens.allocated  # filled by every job
    for name in ("held_probs", "held_k_tokens", "held_k_probs", "held_logits"):
        assert not getattr(greedy, name).allocated, name
    assert logprobs.held_probs.allocated and logprobs.held_k_tokens.allocated
    assert not logprobs.held_logits.allocated
