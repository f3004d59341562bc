"""Time the engine process's pipe messages: an 8-job offer of 256-token prompts (packed and
framed by the worker, read back by the engine process as the requests its engine takes)
and a 32-job step report (written by the engine thread, read back by the worker).

    python scripts/pipe_timing.py

Prints the best of several rounds in µs, per job and per report. Both sides' work is on a
burst's way to its first token (offers) or on every step (reports); see
docs/PERFORMANCE.md for the figures measured so far.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from exlq.protocol.models import GenerationRequest, Sampling
from exlq.protocol.packed_ids import PackedIds
from exlq.worker.command_pipe import decode_command, encode_frame
from exlq.worker.engine_loop import Offer, StepReport
from exlq.worker.engine_process import decode_report, encode_report
from exlq.worker.engines.base import CacheUsage, TokenChunk
from exlq.worker.engines.engine_request import packed_request

JOBS_OFFERED = 8
PROMPT_TOKENS = 256
JOBS_REPORTED = 32
HEADER_BYTES = 8


def best_seconds(call: Callable[[], object], calls: int = 2000, rounds: int = 7) -> float:
    """The fastest round's seconds a call."""
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - began) / calls)
    return min(times)


def offered_jobs(rng: random.Random, packed: bool) -> list[tuple[str, GenerationRequest]]:
    jobs = []
    for i in range(JOBS_OFFERED):
        ids = [rng.randrange(32000) for _ in range(PROMPT_TOKENS)]
        prompt = {"input_ids_b64": PackedIds.from_ids(ids)} if packed else {"input_ids": ids}
        request = GenerationRequest(
            max_new_tokens=128, sampling=Sampling(temperature=0.0), **prompt
        )
        jobs.append((f"job-{i:04d}-{rng.getrandbits(64):016x}", request))
    return jobs


def time_offer(rng: random.Random, packed: bool) -> None:
    jobs = offered_jobs(rng, packed)

    def encode() -> bytearray:
        return encode_frame(Offer(3, [(job_id, packed_request(r)) for job_id, r in jobs]))

    payload = memoryview(encode())[HEADER_BYTES:]
    encode_s = best_seconds(encode)
    decode_s = best_seconds(lambda: decode_command(payload))
    form = "input_ids_b64" if packed else "input_ids"
    print(
        f"offer of {JOBS_OFFERED} x {PROMPT_TOKENS} ids ({form}): "
        f"encode {encode_s / JOBS_OFFERED * 1e6:.2f} µs/job, "
        f"decode {decode_s / JOBS_OFFERED * 1e6:.2f} µs/job, "
        f"{len(payload) + HEADER_BYTES} bytes"
    )


def time_report(rng: random.Random) -> None:
    outputs = [
        TokenChunk(f"job-{i:04d}-{rng.getrandbits(64):016x}", " word", [rng.randrange(32000)])
        for i in range(JOBS_REPORTED)
    ]
    report = StepReport(list(outputs), 0.012, JOBS_REPORTED, CacheUsage(100, 4096))
    data = encode_report(report)
    encode_s = best_seconds(lambda: encode_report(report))
    decode_s = best_seconds(lambda: decode_report(data))
    print(
        f"report of {JOBS_REPORTED} token chunks: "
        f"encode {encode_s * 1e6:.2f} µs ({encode_s / JOBS_REPORTED * 1e6:.3f}/job), "
        f"decode {decode_s * 1e6:.2f} µs ({decode_s / JOBS_REPORTED * 1e6:.3f}/job), "
        f"{len(data)} bytes"
    )


def main() -> None:
    rng = random.Random(0)
    for packed in (True, False):
        time_offer(rng, packed)
    time_report(rng)


if __name__ == "__main__":
    main()
