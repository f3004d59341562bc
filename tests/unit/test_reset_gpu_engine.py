"""A GPU engine's reset after a failed step (engines/base.reset_gpu_engine): the jobs are
dropped before the wait for the GPU, and a GPU that fails that wait ends the engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from exlq.worker.engines.base import EngineDead, reset_gpu_engine


def _torch(calls: list[str], fails: bool) -> SimpleNamespace:
    def synchronize() -> None:
        calls.append("synchronize")
        if fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    return SimpleNamespace(cuda=SimpleNamespace(synchronize=synchronize))


def test_the_jobs_are_dropped_then_the_gpu_is_waited_for() -> None:
    calls: list[str] = []
    reset_gpu_engine(lambda: calls.append("drop"), _torch(calls, fails=False))
    assert calls == ["drop", "synchronize"]


def test_a_sticky_cuda_error_ends_the_engine_with_its_message() -> None:
    calls: list[str] = []
    with pytest.raises(EngineDead, match="illegal memory access"):
        reset_gpu_engine(lambda: calls.append("drop"), _torch(calls, fails=True))
    assert calls == ["drop", "synchronize"]
