"""A job's accepted token written into its cache page, as exllamav2 0.3.2 books a step's
input token (ExLlamaV2DynamicJob.get_input_ids_list(add_to_cache=True)), for the one case
an overlapped decode step books every step (overlap.py): one token waiting, written at
its page's next position. Plain attribute and tensor work; no exllamav2 import."""

from __future__ import annotations

from typing import Any


def book_token(job: Any, token: int, page_size: int) -> None:
    """Write `token`, the one token `job` has accepted and not booked, into its page, which
    moves on by one. With anything else waiting, exllamav2's own booking runs. A page
    shared with other jobs or already full raises RuntimeError."""
    seq = job.sequences[0]
    if len(seq.sequence_ids) - seq.kv_position != 1:
        job.get_input_ids_list(add_to_cache=True)
        return
    page = seq.allocated_pages[seq.kv_position // page_size]
    # exllamav2 asserts the first and would loop for ever on the second; both are a broken
    # page table, which fails the step (and its jobs) with this error.
    if page.ref_count != 1:
        raise RuntimeError(f"a token would be written into a page {page.ref_count} jobs share")
    if page.kv_position >= page_size:
        raise RuntimeError("a token would be written past the end of a full page")
    page.sequence[0, page.kv_position] = token
    page.kv_position += 1
    page.can_revert = False
