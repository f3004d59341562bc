"""A job's accepted token written into its cache page, as exllamav2 0.3.2 books a step's
input token (ExLlamaV2DynamicJob.get_input_ids_list(add_to_cache=True)), for the one case
an overlapped decode step books every step (overlap.py): one token waiting, written at
its page's next position. Plain attribute and tensor work; no exllamav2 import."""

from __future__ import annotations

from typing import Any


def book_token(job: Any, token: int, page_size: int) -> None:
    """Write `token`, the one token `job` has accepted and not booked, into its page, which
    moves on by one. With anything else waiting, exllamav2's own booking runs."""
    seq = job.sequences[0]
    if len(seq.sequence_ids) - seq.kv_position != 1:
        job.get_input_ids_list(add_to_cache=True)
        return
    page = seq.allocated_pages[seq.kv_position // page_size]
    if page.ref_count != 1 or page.kv_position >= page_size:
        job.get_input_ids_list(add_to_cache=True)  # exllamav2's own checks and errors
        return
    page.sequence[0, page.kv_position] = token
    page.kv_position += 1
    page.can_revert = False
