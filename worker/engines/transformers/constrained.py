"""The transformers engine's constrained jobs: the grammar compiler built at load, and a
step's constrained rows of logits masked before their samplers (structured_output.py)."""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Any

import torch

from exlq.protocol.models import InvalidRequest
from exlq.worker.engines.engine_request import EngineRequest
from exlq.worker.engines.structured_output import (
    GrammarCompiler,
    TokenConstraint,
    allocate_bitmask,
    apply_bitmask,
    fill_masks,
)

log = logging.getLogger(__name__)


class Constraints:
    """Compiles jobs' constraints and masks their rows. Without llguidance, or with a
    tokenizer it cannot read, the engine runs and refuses constrained requests."""

    def __init__(self, tokenizer: Any, logits_width: int, eos_ids: Collection[int]) -> None:
        self._width = logits_width
        self._compiler: GrammarCompiler | None = None
        self.unavailable = ""  # why constrained requests are refused, if they are
        try:
            self._compiler = GrammarCompiler.from_hf_tokenizer(
                tokenizer, logits_width, sorted(eos_ids)
            )
        except ImportError as exc:
            self.unavailable = f"llguidance is not installed ({exc})"
        except (ValueError, RuntimeError) as exc:  # a slow tokenizer, or one it cannot read
            self.unavailable = f"llguidance cannot read this model's tokenizer ({exc})"
        if self.unavailable:
            log.warning("constrained output is off: %s", self.unavailable)
        # Reused from step to step, grown to the most constrained rows one step has had:
        # each row that is used is written whole.
        # A GPU's copy of it is read before the next step writes it again: the step's
        # sampling waits for the masked logits.
        self._bitmask: torch.Tensor | None = None

    def compile(self, request: EngineRequest) -> TokenConstraint | None:
        if request.constraint is None:
            return None
        if self._compiler is None:
            raise InvalidRequest(
                f"{request.constraint.field}: this worker cannot constrain output: "
                f"{self.unavailable}"
            )
        return self._compiler.compile(request)

    def masked_rows(
        self, constrained: Sequence[tuple[int, TokenConstraint]], logits: torch.Tensor
    ) -> dict[int, torch.Tensor]:
        """The constrained rows of ``logits`` (by row), masked to what each job's grammar
        allows next. A copy: ``logits`` keeps the model's own values, which logprobs
        report."""
        if not constrained:
            return {}
        bitmask = self._bitmask_of(len(constrained), logits.device)
        fill_masks([(constraint, n) for n, (_, constraint) in enumerate(constrained)], bitmask)
        rows = [row for row, _ in constrained]
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        scores = logits.index_select(0, index)
        apply_bitmask(scores, bitmask)
        return dict(zip(rows, scores, strict=True))

    def _bitmask_of(self, rows: int, device: torch.device) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            # Page-locked for a GPU, so that its copy there need not wait.
            self._bitmask = allocate_bitmask(max(rows, 8), self._width, pin=device.type == "cuda")
        return self._bitmask
