"""Held-output buffers on demand (worker/engines/exllamav2/job_buffers.py): exllamav2 makes
them where the hook expects, a job that never writes one never allocates it, a job's two
buffers of prompt ids are made as exllamav2 makes them, and what jobs hold back and return
is the same as with exllamav2's own buffers."""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest

HELD = ["held_tokens", "held_k_tokens", "held_k_probs", "held_probs", "held_logits"]


def test_exllamav2_makes_the_held_buffers_only_where_the_hook_replaces_them(cuda: None) -> None:
    """Fails loudly if exllamav2 0.3.2 constructs SeqTensor elsewhere in its generator, or
    its held buffers somewhere else."""
    import exllamav2.generator.dynamic as dynamic
    from exllamav2.generator import ExLlamaV2DynamicJob

    module = inspect.getsource(dynamic)
    made = re.findall(r"self\.(\w+) = SeqTensor\(", module)
    assert sorted(made) == sorted(HELD)
    assert len(re.findall(r"(?<![\w.])SeqTensor\(", module)) == len(HELD)
    queue = inspect.getsource(ExLlamaV2DynamicJob.prepare_for_queue)
    assert all(f"self.{name} = SeqTensor(" in queue for name in HELD)


@pytest.mark.parametrize(
    ("shape", "seq_dim", "init_cap"),
    [((1, 0), -1, -1), ((1, 0, 5), 1, -1), ((1, 300), -1, 300), ((2, 256, 3), 1, 256)],
)
def test_an_on_demand_buffer_has_seq_tensors_shape_and_grows_as_it_does(
    cuda: None, shape: tuple[int, ...], seq_dim: int, init_cap: int
) -> None:
    import torch
    from exllamav2.util import SeqTensor

    from exlq.worker.engines.exllamav2.job_buffers import OnDemandSeqTensor

    stock = SeqTensor(shape, torch.float, seq_dim, init_cap=init_cap)
    lazy = OnDemandSeqTensor(shape, torch.float, seq_dim, init_cap=init_cap)
    assert not lazy.allocated and not lazy and len(lazy) == 0
    lazy.clear()
    assert not lazy.allocated
    assert (lazy.seq_dim, lazy.seq_cap) == (stock.seq_dim, stock.seq_cap)
    assert lazy.tensor.shape == stock.tensor.shape and lazy.allocated
    rows = list(shape)
    rows[seq_dim] = 600  # past the capacity: both grow
    data = torch.randn(rows)
    for buffer in (stock, lazy):
        buffer.append(data)
        buffer.append(data[:1] if seq_dim == 0 else data.narrow(seq_dim, 0, 7))
    assert lazy.seq_cap == stock.seq_cap and torch.equal(lazy.torch(), stock.torch())


def test_exllamav2_builds_a_jobs_two_id_buffers_through_the_name_the_hook_replaces(
    cuda: None,
) -> None:
    """Fails loudly if exllamav2 0.3.2's job constructor stops making its input ids and
    sequence ids with SeqTensor.from_tensor, which OnDemandSeqTensor makes in one step."""
    import exllamav2.generator.dynamic as dynamic
    from exllamav2.generator import ExLlamaV2DynamicJob

    module = inspect.getsource(dynamic)
    made = re.findall(r"(\w+) = SeqTensor\.from_tensor\(", module)
    assert sorted(made) == ["input_ids", "sequence_ids"]
    constructor = inspect.getsource(ExLlamaV2DynamicJob.__init__)
    assert constructor.count("SeqTensor.from_tensor(") == 2


@pytest.mark.parametrize(
    ("shape", "seq_dim", "dtype"),
    [
        ((1, 1), -1, "long"),
        ((1, 255), -1, "long"),
        ((1, 256), -1, "long"),
        ((1, 300), -1, "long"),
        ((2, 10, 3), 1, "float"),
    ],
)
def test_a_seq_tensor_from_ids_is_as_exllamav2_makes_it_and_grows_as_it_does(
    cuda: None, shape: tuple[int, ...], seq_dim: int, dtype: str
) -> None:
    import torch
    from exllamav2.util import SeqTensor

    from exlq.worker.engines.exllamav2.job_buffers import OnDemandSeqTensor

    data = (torch.randint(0, 32_000, shape) if dtype == "long" else torch.randn(shape)).to(
        getattr(torch, dtype)
    )
    stock = SeqTensor.from_tensor(data, seq_dim=seq_dim)
    made = OnDemandSeqTensor.from_tensor(data, seq_dim=seq_dim)
    assert type(made) is SeqTensor  # a plain SeqTensor, its buffer made now
    assert (made.seq_dim, made.seq_len, made.seq_cap) == (
        stock.seq_dim,
        stock.seq_len,
        stock.seq_cap,
    )
    assert made.tensor.shape == stock.tensor.shape and made.tensor.dtype == stock.tensor.dtype
    assert made.tensor.is_contiguous() and made.tensor.data_ptr() != data.data_ptr()
    assert torch.equal(made.torch(), data) and torch.equal(made.torch(), stock.torch())
    rows = list(shape)
    rows[seq_dim] = 600  # past the capacity: both grow
    more = torch.ones(rows, dtype=data.dtype)
    for buffer in (stock, made):
        buffer.append(more)
        buffer.truncate(buffer.seq_len - 5)
        buffer.append(more.narrow(seq_dim, 0, 7))
    assert made.seq_cap == stock.seq_cap and torch.equal(made.torch(), stock.torch())


def _held_output(generator: Any) -> tuple[list[Any], list[Any]]:
    """Greedy jobs that return every kind of held output, one with banned strings (which
    checkpoints and rewinds its held output), and a plain one; their results and jobs."""
    import torch
    from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    rng = torch.Generator().manual_seed(11)
    greedy = ExLlamaV2Sampler.Settings.greedy()
    options: list[dict[str, Any]] = [
        {"return_top_tokens": 3, "return_probs": True, "return_logits": True},
        {"banned_strings": ["e", " t", "a"], "return_probs": True},
        {},
    ]
    jobs = []
    for i, extra in enumerate(options):
        job = ExLlamaV2DynamicJob(
            input_ids=torch.randint(3, 32000, (1, 40 + 90 * i), generator=rng),
            max_new_tokens=20,
            stop_conditions=[],
            gen_settings=greedy,
            identifier=i,
            **extra,
        )
        generator.enqueue(job)
        jobs.append(job)
    results = []
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result.get("stage") != "streaming":
                continue
            results.append(
                {
                    key: _plain(value)
                    for key, value in result.items()
                    if key not in ("job", "serial") and not key.startswith("time_")
                }
            )
    return results, jobs


def _plain(value: Any) -> Any:
    """Tensors as lists, in dicts too, so that results compare with ==."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.cpu().tolist()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def test_held_output_is_the_same_with_buffers_on_demand(
    make_generator: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import exllamav2.generator.dynamic as dynamic
    from exllamav2.util import SeqTensor

    from exlq.worker.engines.exllamav2.job_buffers import OnDemandSeqTensor

    generator = make_generator(exlq=True)
    assert dynamic.SeqTensor is OnDemandSeqTensor, "exlq's generator installs the hook"
    on_demand, jobs = _held_output(generator)
    plain = jobs[-1]
    assert plain.held_tokens.allocated
    assert not any(getattr(plain, name).allocated for name in HELD[1:])
    assert jobs[0].held_logits.allocated
    monkeypatch.setattr(dynamic, "SeqTensor", SeqTensor)
    generator.reset_page_table()  # the same prompts again, none of their pages reused
    stock, _ = _held_output(generator)
    assert len(on_demand) == len(stock) > 3 * 20 // 2
    differing = [
        (i, key)
        for i, (a, b) in enumerate(zip(on_demand, stock, strict=True))
        for key in sorted(a.keys() | b.keys())
        if a.get(key) != b.get(key)
    ]
    assert differing == [], f"results differ at (index, key): {differing[:10]}"
    print(f"\n{len(stock)} streamed results identical with buffers on demand and exllamav2's")
