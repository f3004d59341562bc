"""The engine loop's wait work inside exllamav3's step: run once the step's forward pass is
queued on the GPU, before exllamav3 waits for its logits.

Without a draft model, exllamav3's generator calls ``model.forward`` once an iteration, for
the decode pass of the jobs that are generating (prompts go through ``model.prefill``); its
sampling then waits for the logits, job by job. The forward pass is asynchronous on the
GPU, so work done between its return and that wait overlaps the pass. The engine wraps
the model's ``forward`` (its instance attribute, leaving exllamav3's code as it is) to run
the loop's work there: the last step's report goes out and the jobs that arrived are
queued while the GPU runs, not between steps with the GPU idle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from exlq.worker.engines.base import UsesDeviceWait


def run_wait_work_after_forward(model: Any, engine: UsesDeviceWait) -> None:
    """Make ``model.forward`` run ``engine.wait_work`` (when set) after queuing its pass."""
    forward: Callable[..., Any] = model.forward

    def forward_then_wait(*args: Any, **kwargs: Any) -> Any:
        logits = forward(*args, **kwargs)
        work = engine.wait_work
        if work is not None:
            work()
        return logits

    model.forward = forward_then_wait
