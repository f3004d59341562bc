"""Where a burst's time goes on the exlq path, beside the engine alone: one timeline a run.

    python -m bench.path_trace --shape 8b --concurrency 64,128 --repeats 2 --out DIR

The two systems run as in `bench.paired` (the engine alone in this process, one
`exlq worker` kept up, the same new prompts for both, back to back). The worker runs as
`python -m bench.path_trace worker ...` with EXLQ_PATH_TRACE_DIR set: this module is
imported first there, and again in the engine process the worker spawns (spawn imports
the parent's main module), and in both it wraps a few methods of the worker, the engine
loop and the engine process so that each appends timestamped records to a file of its
process. The SDK's side (when each job's first event reaches the event connection) and
the engine alone's steps are recorded in this process. Every time is `perf_counter()`,
which on Linux is CLOCK_MONOTONIC, one clock for every process of the machine.

The wrappers add a few µs a record, so a traced run is not a measurement of the path's
cost: `bench.paired` is. This says where in the run the difference between the two sits.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any

from bench.gpu_clocks import IDLE_WINDOW_S, ClockRecorder, run_figures
from bench.gpu_clocks import timeline as timeline_of

if TYPE_CHECKING:
    from bench.placement import Placement

TRACE_ENV = "EXLQ_PATH_TRACE_DIR"

Record = dict[str, Any]


class GcClock:
    """A gc callback that hands each collection's start and generation to ``done`` as it
    ends (collections of a millisecond or more)."""

    def __init__(self, done: Callable[[float, int], None]) -> None:
        self.done = done
        self.begin = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.begin = perf_counter()
        elif perf_counter() - self.begin >= 0.001:
            self.done(self.begin, info["generation"])


class TraceFile:
    """Records of one process, a JSON line each, written as they happen."""

    def __init__(self, directory: Path) -> None:
        self._out = open(directory / f"{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    def note(self, what: str, **fields: Any) -> None:
        self._out.write(json.dumps({"t": perf_counter(), "what": what, **fields}) + "\n")


def _install_in_worker(trace: TraceFile) -> None:
    """Wraps the worker's and the engine process's methods; each process runs only its own."""
    gc.callbacks.append(GcClock(lambda begin, gen: trace.note("gc", begin=begin, gen=gen)))
    _wrap_worker(trace)
    _wrap_engine_loop(trace)
    _wrap_engine_offers(trace)
    import multiprocessing

    # The engine process (spawn names it before it imports this module): exllamav2 is here.
    if multiprocessing.current_process().name == "exlq-engine":
        _wrap_engine_internals()


# The engine process's step, in parts: building the jobs it starts, and exllamav2's iterate().
# A step's parts: the builds before iterate(), iterate(), and the builds inside it (in the
# GPU wait, --admit-in-wait), which iterate's time includes.
_step_parts: dict[str, float] = {"build_s": 0.0, "iterate_s": 0.0, "wait_build_s": 0.0}
_in_iterate: list[bool] = [False]


def _wrap_engine_internals() -> None:
    try:
        from exlq.worker.engines.exllamav2.engine import ExLlamaV2Engine
        from exlq.worker.engines.exllamav2.generator import ExlqDynamicGenerator
    except ImportError:  # no torch here: the echo engine
        return

    def timed(inner: Callable[..., Any], part: str, in_iterate: str) -> Callable[..., Any]:
        """``inner`` timed into ``part``, or into ``in_iterate`` when iterate() runs it."""

        @functools.wraps(inner)
        def wrapper(*args: Any) -> Any:
            begin = perf_counter()
            try:
                return inner(*args)
            finally:
                _step_parts[in_iterate if _in_iterate[0] else part] += perf_counter() - begin

        return wrapper

    iterate = ExlqDynamicGenerator.iterate

    @functools.wraps(iterate)
    def timed_iterate(*args: Any) -> Any:
        _in_iterate[0] = True
        begin = perf_counter()
        try:
            return iterate(*args)
        finally:
            _step_parts["iterate_s"] += perf_counter() - begin
            _in_iterate[0] = False

    ExLlamaV2Engine._build_startable = timed(  # type: ignore[method-assign]
        ExLlamaV2Engine._build_startable, "build_s", "wait_build_s"
    )
    ExlqDynamicGenerator.iterate = timed_iterate  # type: ignore[method-assign,assignment]


def _wrap_worker(trace: TraceFile) -> None:
    from exlq.worker import runner
    from exlq.worker.engine_process import EngineProcess
    from exlq.worker.engines.base import TokenChunk

    Worker = runner.Worker
    accept_piece = Worker._accept_piece

    @functools.wraps(accept_piece)
    async def traced_accept_piece(self: Any, entries: list[Any], *args: Any) -> None:
        trace.note("piece_begin", n=len(entries))
        await accept_piece(self, entries, *args)
        trace.note("piece_end")

    decode = Worker._decode

    @functools.wraps(decode)
    def traced_decode(self: Any, entry: Any) -> Any:
        request = decode(self, entry)
        trace.note("parsed")
        return request

    commit = Worker.commit

    @functools.wraps(commit)
    async def traced_commit(self: Any, batch: Any) -> None:
        trace.note("commit_begin")
        await commit(self, batch)
        trace.note("commit_end")

    take_report = Worker._take_report

    @functools.wraps(take_report)
    def traced_take_report(self: Any, batch: Any, report: Any, ended: list[str]) -> None:
        firsts = sum(
            1
            for o in report.outputs
            if isinstance(o, TokenChunk)
            and o.job_id in self.held
            and self.held[o.job_id].last_token_at is None
        )
        trace.note("report_in", outputs=len(report.outputs), firsts=firsts)
        take_report(self, batch, report, ended)

    hand = EngineProcess.add_many

    @functools.wraps(hand)
    def traced_hand(self: Any, jobs: Sequence[Any]) -> None:
        trace.note("hand_begin", n=len(jobs))
        hand(self, jobs)
        trace.note("hand_end")

    # --offer-before-start: the parts offered as they are parsed, then the piece's admit,
    # which is its hand-over.
    offer = EngineProcess.offer

    @functools.wraps(offer)
    def traced_offer(self: Any, round_id: int, jobs: Sequence[Any]) -> None:
        offer(self, round_id, jobs)
        trace.note("offer_sent", n=len(jobs))

    admit = EngineProcess.admit

    @functools.wraps(admit)
    def traced_admit(self: Any, round_id: int, jobs: Sequence[Any]) -> None:
        trace.note("hand_begin", n=len(jobs))
        admit(self, round_id, jobs)
        trace.note("hand_end")

    _wrap_broker(trace)
    Worker._accept_piece = traced_accept_piece  # type: ignore[method-assign,assignment]
    Worker._decode = traced_decode  # type: ignore[method-assign]
    Worker.commit = traced_commit  # type: ignore[method-assign]
    Worker._take_report = traced_take_report  # type: ignore[method-assign]
    EngineProcess.add_many = traced_hand  # type: ignore[method-assign]
    EngineProcess.offer = traced_offer  # type: ignore[method-assign]
    EngineProcess.admit = traced_admit  # type: ignore[method-assign]


def _wrap_broker(trace: TraceFile) -> None:
    """The worker's reads and start scripts."""
    from exlq.worker.broker import Broker

    read = Broker.read

    @functools.wraps(read)
    async def traced_read(self: Any, count: int, block_ms: int | None) -> list[Any]:
        begin = perf_counter()
        entries = await read(self, count, block_ms)
        if entries or block_ms is None:  # a read that does not block: even when empty
            trace.note("read", begin=begin, n=len(entries), blocked=block_ms is not None)
        return entries

    start_jobs = Broker.start_jobs

    @functools.wraps(start_jobs)
    async def traced_start_jobs(self: Any, starts: list[tuple[str, str]]) -> list[Any]:
        begin = perf_counter()
        decisions = await start_jobs(self, starts)
        trace.note("start_script", begin=begin, n=len(starts))
        return decisions

    Broker.read = traced_read  # type: ignore[method-assign]
    Broker.start_jobs = traced_start_jobs  # type: ignore[method-assign]


def _wrap_engine_loop(trace: TraceFile) -> None:
    from exlq.worker import engine_loop
    from exlq.worker.engines.base import TokenChunk

    Loop = engine_loop.EngineLoop
    loop_add = Loop.add_many

    @functools.wraps(loop_add)
    def traced_loop_add(self: Any, jobs: Sequence[Any]) -> None:
        trace.note("engine_recv", n=len(jobs))  # the thread runner's: from the event loop
        loop_add(self, jobs)

    apply = Loop._apply

    @functools.wraps(apply)
    def traced_apply(self: Any, commands: list[Any], outputs: list[Any]) -> bool:
        # Jobs started (adds, admits), and jobs only offered: prepared, not started.
        adds = sum(len(c.jobs) for c in commands if isinstance(c, engine_loop.Admit))
        offers = sum(len(c.jobs) for c in commands if isinstance(c, engine_loop.Offer))
        if not adds and not offers:
            return apply(self, commands, outputs)
        begin = perf_counter()
        kept = apply(self, commands, outputs)
        if offers:  # the offers taken with an admit were prepared in the same pass
            trace.note("offer_apply", begin=begin, n=offers)
        if adds:
            trace.note("apply", begin=begin, n=adds)
        return kept

    step = Loop._step

    @functools.wraps(step)
    def traced_step(self: Any, outputs: list[Any]) -> float:
        seen: set[str] = self.__dict__.setdefault("_trace_seen", set())
        before, active, begin = len(outputs), self.engine.active_jobs, perf_counter()
        seconds = step(self, outputs)
        new = [o.job_id for o in outputs[before:] if isinstance(o, TokenChunk)]
        firsts = sum(1 for j in new if j not in seen)
        seen.update(new)
        parts = {k: round(v * 1000, 2) for k, v in _step_parts.items()}
        _step_parts.update(build_s=0.0, iterate_s=0.0, wait_build_s=0.0)
        trace.note("step", begin=begin, active=active, outputs=len(new), firsts=firsts, **parts)
        return seconds

    start = Loop.start

    @functools.wraps(start)
    def traced_start(self: Any, report: Callable[[Any], None], *args: Any) -> None:
        def sink(r: Any) -> None:
            report(r)
            # held: ms from the step's end to this send (held for the next step's GPU wait)
            held = round((time.time() - r.finished_at) * 1000, 3)
            trace.note("report_sent", outputs=len(r.outputs), held=held)

        start(self, sink, *args)

    Loop.add_many = traced_loop_add  # type: ignore[method-assign]
    Loop._apply = traced_apply  # type: ignore[method-assign]
    Loop._step = traced_step  # type: ignore[method-assign]
    Loop.start = traced_start  # type: ignore[method-assign, assignment]


def _wrap_engine_offers(trace: TraceFile) -> None:
    """--offer-before-start in the engine process: each part offered, the admit, and the
    engine's builds ahead of the admit."""
    from exlq.worker.engine_loop import EngineLoop as Loop

    loop_offer, loop_admit = Loop.offer, Loop.admit

    @functools.wraps(loop_offer)
    def traced_loop_offer(self: Any, round_id: int, jobs: Sequence[Any]) -> None:
        trace.note("offer_recv", n=len(jobs))
        loop_offer(self, round_id, jobs)

    @functools.wraps(loop_admit)
    def traced_loop_admit(self: Any, round_id: int, jobs: Sequence[Any]) -> None:
        trace.note("engine_recv", n=len(jobs))
        loop_admit(self, round_id, jobs)

    build_ahead = Loop._build_ahead

    @functools.wraps(build_ahead)
    def traced_build_ahead(self: Any) -> None:
        begin = perf_counter()
        build_ahead(self)
        trace.note("build_ahead", begin=begin)

    Loop.offer = traced_loop_offer  # type: ignore[method-assign]
    Loop.admit = traced_loop_admit  # type: ignore[method-assign]
    Loop._build_ahead = traced_build_ahead  # type: ignore[method-assign]

    # In the engine process the stepping thread reads the worker's messages itself.
    from exlq.worker import engine_loop, engine_process

    command_from = engine_process.command_from

    @functools.wraps(command_from)
    def traced_command_from(message: tuple[Any, ...]) -> Any:
        command = command_from(message)
        if isinstance(command, engine_loop.Offer):
            trace.note("offer_recv", n=len(command.jobs))
        elif isinstance(command, engine_loop.Admit):
            trace.note("engine_recv", n=len(command.jobs))
        return command

    engine_process.command_from = traced_command_from


if os.environ.get(TRACE_ENV):  # the worker, and its engine process
    _install_in_worker(TraceFile(Path(os.environ[TRACE_ENV])))


class BenchTrace:
    """This process's side: each run's clock start and token times (both systems), the
    engine alone's steps, and when each exlq job's first event reached the SDK. A context
    manager: the wrapped functions are put back on exit."""

    def __init__(self) -> None:
        from bench import baselines, exlq_path
        from exlq.producer.submit_batch import SubmitBatcher
        from exlq.producer.subscriber import EventRouter

        self.summaries: list[tuple[float, list[list[float]]]] = []
        self.engine_steps: list[tuple[float, float]] = []
        self.sdk_first: dict[bytes, float] = {}  # by channel
        self.sdk_sends: list[tuple[float, float, int]] = []
        self.last_sends: list[tuple[float, float, int]] = []  # the last exlq run's
        self.gcs: list[tuple[float, float, int]] = []  # this process's, 1 ms or more
        self._gc_clock = GcClock(lambda b, g: self.gcs.append((b, perf_counter(), g)))
        gc.callbacks.append(self._gc_clock)
        summarize, record = baselines._summarize, baselines._StepLog.record
        push, send = EventRouter._push, SubmitBatcher._send

        def traced_summarize(**kw: Any) -> dict[str, Any]:
            self.summaries.append((kw["t0"], [list(t) for t in kw["token_times"]]))
            return summarize(**kw)

        def traced_record(log: Any, results: Any, ts: float, te: float) -> None:
            self.engine_steps.append((ts, te))
            record(log, results, ts, te)

        def traced_push(router: Any, message: list[bytes]) -> None:
            if message[0] == b"message" and message[1] not in self.sdk_first:
                self.sdk_first[message[1]] = perf_counter()  # a job's first event
            push(router, message)

        async def traced_send(batcher: Any, batch: list[Any], more: bool = False) -> None:
            begin = perf_counter()
            await send(batcher, batch, more)
            self.sdk_sends.append((begin, perf_counter(), len(batch)))

        self._wrapped: list[tuple[Any, str, Any, Any]] = [
            (baselines, "_summarize", summarize, traced_summarize),
            (exlq_path, "_summarize", summarize, traced_summarize),
            (baselines._StepLog, "record", record, traced_record),
            (EventRouter, "_push", push, traced_push),
            (SubmitBatcher, "_send", send, traced_send),
        ]
        for owner, name, _, traced in self._wrapped:
            setattr(owner, name, traced)

    def __enter__(self) -> BenchTrace:
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original, _ in self._wrapped:
            setattr(owner, name, original)
        gc.callbacks.remove(self._gc_clock)

    def gc_ms(self, t0: float) -> list[list[float]]:
        """This process's collections since t0: [start ms, ms, generation]."""
        return [[_ms(b, t0), round((e - b) * 1000, 2), g] for b, e, g in self.gcs if b >= t0]

    def take(self) -> tuple[float, list[list[float]], list[tuple[float, float]], list[float]]:
        """The last run's clock start, token times, engine steps and SDK first arrivals."""
        t0, times = self.summaries[-1]
        steps, self.engine_steps = self.engine_steps, []
        firsts = sorted(t for t in self.sdk_first.values() if t >= t0)
        self.sdk_first.clear()
        self.last_sends = [(a, b, n) for a, b, n in self.sdk_sends if a >= t0]
        self.sdk_sends.clear()
        return t0, times, steps, firsts


class EngineClassAlone:
    """The worker's engine class (ExLlamaV2Engine: request checks, job builds in step(),
    typed outputs) in this process, stepped directly: the engine process without the
    process, the pipes or the queue."""

    def __init__(self, model: Path, max_batch_size: int, options: dict[str, Any]) -> None:
        from exlq.worker.engines.exllamav2.engine import load_exllamav2_engine
        from exlq.worker.settings import WorkerSettings

        settings = WorkerSettings(
            model=model, max_batch_size=max_batch_size, attention="exlq", **options
        )
        self.engine = load_exllamav2_engine(settings)
        _wrap_engine_internals()  # times this process's builds and iterate() calls
        # As the engine loop does (--admit-in-wait): each step's wait for the GPU readies the
        # next one, and what that ends belongs to the step.
        self._readied: list[Any] = []
        self.engine.set_wait_work(lambda: self._readied.extend(self.engine.prepare_next_step()))

    def _requests(self, prompts: list[list[int]], max_new_tokens: int) -> list[Any]:
        from exlq.protocol.models import GenerationRequest, Sampling

        return [
            GenerationRequest(
                input_ids=ids,
                max_new_tokens=max_new_tokens,
                ignore_eos=True,
                sampling=Sampling(temperature=0.0),
            )
            for ids in prompts
        ]

    def _drain(self, requests: list[Any]) -> tuple[list[list[float]], dict[str, float]]:
        from exlq.worker.engines.base import JobEnded, TokenChunk

        for request in requests:
            self.engine.add(request.id, request)
        first: dict[str, float] = {}
        steps: list[list[float]] = []
        ended = 0
        while ended < len(requests):
            _step_parts.update(build_s=0.0, iterate_s=0.0, wait_build_s=0.0)
            begin = perf_counter()
            outputs = self.engine.step() + self._readied
            end = perf_counter()
            self._readied.clear()
            steps.append([begin, end, *_step_parts.values()])
            for o in outputs:
                if isinstance(o, TokenChunk):
                    first.setdefault(o.job_id, end)
                elif isinstance(o, JobEnded):
                    ended += 1
                else:
                    raise RuntimeError(f"engine error: {o}")
        return steps, first

    def run(
        self, prompts: list[list[int]], warm_up: list[list[int]], max_new_tokens: int, group: int
    ) -> dict[str, Any]:
        import time

        from bench.baselines import IDLE_BEFORE_RUN_S, percentiles

        self._drain(self._requests(warm_up, 8))
        requests = self._requests(prompts, max_new_tokens)
        time.sleep(IDLE_BEFORE_RUN_S)
        t0 = perf_counter()
        steps, first = self._drain(requests)
        last = steps[-1][1]  # a job whose text stayed held to the end (random weights)
        made = [first.get(r.id, last) for r in requests]
        return {
            "system": "engine-class",
            "ttft_ms_p50": percentiles([(t - t0) * 1000 for t in made], [50])[0],
            "steps": [[_ms(a, t0), _ms(b, t0)] for a, b, *_ in steps],
            "step_build_iterate_ms": [
                [round(x * 1000, 2) for x in parts] for _, _, *parts in steps
            ],
            "first_token_by_group": group_medians(made, t0, group),
        }

    def close(self) -> None:
        self.engine.close()


def _ms(t: float, t0: float) -> float:
    return round((t - t0) * 1000, 2)


def slice_jobs(admit_prompt_tokens: int, prompt_tokens: int, jobs: int) -> int:
    """Jobs in one admission slice: the budget's worth of prompts (0: no budget, one slice)."""
    return max(1, admit_prompt_tokens // prompt_tokens) if admit_prompt_tokens else jobs


def group_medians(first_token: Sequence[float], t0: float, group: int) -> list[float]:
    """Median first-token time (ms after t0) of each group of ``group`` jobs (one admission
    slice), in submit order."""
    return [
        _ms(statistics.median(first_token[g : g + group]), t0)
        for g in range(0, len(first_token), group)
    ]


def read_worker_trace(directory: Path, t0: float, t_end: float) -> list[Record]:
    records: list[Record] = []
    for path in directory.glob("*.jsonl"):
        pid = int(path.stem)
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if t0 <= r["t"] <= t_end:
                records.append(r | {"pid": pid})
    records.sort(key=lambda r: r["t"])
    return records


def exlq_timeline(records: list[Record], t0: float, steps_shown: int) -> dict[str, Any]:
    def at(what: str) -> list[Record]:
        return [r for r in records if r["what"] == what]

    steps = at("step")[:steps_shown]
    engine_pids = {r.get("pid") for r in at("step")}
    return {
        "reads": [[_ms(r["begin"], t0), _ms(r["t"], t0), r["n"]] for r in at("read")][:4],
        "pieces_begin": [_ms(r["t"], t0) for r in at("piece_begin")],
        # each entry parsed (the first 8)
        "parses": [_ms(r["t"], t0) for r in at("parsed")][:8],
        "pieces_handed": [_ms(r["t"], t0) for r in at("hand_end")],
        # the start script of each piece, [sent, answered] ms (--admit-before-start: the
        # hand-over above comes before it)
        "start_scripts": [[_ms(r["begin"], t0), _ms(r["t"], t0)] for r in at("start_script")][:8],
        "engine_recv": [_ms(r["t"], t0) for r in at("engine_recv")],
        "engine_apply": [[_ms(r["begin"], t0), _ms(r["t"], t0), r["n"]] for r in at("apply")],
        # --offer-before-start: parts offered (worker), received and prepared (engine), and
        # the engine's builds ahead of the admit, [begin, end] ms
        "offers_sent": [[_ms(r["t"], t0), r["n"]] for r in at("offer_sent")][:16],
        "offers_applied": [
            [_ms(r["begin"], t0), _ms(r["t"], t0), r["n"]] for r in at("offer_apply")
        ][:16],
        "builds_ahead": [[_ms(r["begin"], t0), _ms(r["t"], t0)] for r in at("build_ahead")][:16],
        "steps": [[_ms(r["begin"], t0), _ms(r["t"], t0), r["active"], r["firsts"]] for r in steps],
        # ms of each step building jobs before iterate(), in exllamav2's iterate(), and
        # building jobs inside iterate's wait for the GPU (the engine process)
        "step_build_iterate_ms": [
            [r.get("build_s"), r.get("iterate_s"), r.get("wait_build_s")] for r in steps
        ],
        "reports_sent": [_ms(r["t"], t0) for r in at("report_sent")][:steps_shown],
        # ms each report waited between its step's end and its send (--overlap-reports)
        "reports_held_ms": [r.get("held") for r in at("report_sent")][:steps_shown],
        "reports_in": [[_ms(r["t"], t0), r["firsts"]] for r in at("report_in")][:steps_shown],
        "commits_begin": [_ms(r["t"], t0) for r in at("commit_begin")][: steps_shown + 4],
        "commits_end": [_ms(r["t"], t0) for r in at("commit_end")][: steps_shown + 4],
        # collections of 1 ms or more in the worker's processes: [start ms, ms, generation,
        # the process: "engine" (the one that steps) or "worker"]
        "worker_gc": [
            [
                _ms(r["begin"], t0),
                _ms(r["t"], r["begin"]),
                r["gen"],
                "engine" if r["pid"] in engine_pids else "worker",
            ]
            for r in at("gc")
        ],
    }


# The first piece's way through exlq, and its first token's way back: (label, the ms of a
# run's timeline it reads).
STAGES: list[tuple[str, Callable[[Record], float]]] = [
    ("the SDK starts writing the first piece", lambda r: min(a for a, _, _ in r["sdk_sends"])),
    ("the worker's read returns it", lambda r: r["reads"][0][1]),
    ("the worker starts on the piece", lambda r: r["pieces_begin"][0]),
    ("the worker has parsed its first job", lambda r: r["parses"][0]),
    ("parsed, started in Redis, handed to the pipe", lambda r: r["pieces_handed"][0]),
    ("the engine process has it", lambda r: r["engine_recv"][0]),
    ("the engine has added it", lambda r: r["engine_apply"][0][1]),
    ("the first step begins", lambda r: r["steps"][0][0]),
    ("the first step ends", lambda r: r["steps"][0][1]),
    ("the engine process sends its report", lambda r: r["reports_sent"][0]),
    ("its report reaches the worker's event loop", lambda r: r["reports_in"][0][0]),
    ("the worker has its events, the commit script is called", lambda r: _commit_begin(r)),
    ("its events are in Redis (commit script returns)", lambda r: r["commits_end"][0]),
    ("the SDK reads the median job's first event", lambda r: r["sdk_first_event_by_group"][0]),
    ("the median job's stream() yields it", lambda r: r["first_token_by_group"][0]),
    # --offer-before-start: the first piece before its admit (the hand-over above)
    ("offered: the worker sends the first part", lambda r: r["offers_sent"][0][0]),
    ("offered: the engine has prepared the last part", lambda r: _before_admit(r, "offers")),
    # none when the last part and the admit reached the engine together
    ("offered: the engine has built ahead", lambda r: _before_admit(r, "builds")),
]


def _commit_begin(r: Record) -> float:
    """When the commit of the first step's report began: the last commit begun before the
    first commit end after that report reached the worker."""
    report_in = r["reports_in"][0][0]
    end = min(t for t in r["commits_end"] if t >= report_in)
    return float(max(t for t in r["commits_begin"] if report_in <= t <= end))


def _before_admit(r: Record, what: str) -> float:
    """The end of the engine's last offer prepared ("offers") or last build ahead ("builds")
    before the first piece's admit was applied; ValueError if there was none."""
    admitted = r["engine_apply"][0][1]
    spans = r["offers_applied"] if what == "offers" else r["builds_ahead"]
    return float(max(span[1] for span in spans if span[1] <= admitted))


def stage_table(runs: list[Record]) -> str:
    """Markdown: the median ms after the burst's start of each stage, per burst size, and
    the engine alone's first step beside it."""
    sizes = sorted({r["n"] for r in runs})
    exlq = {n: [r for r in runs if r["n"] == n and r["system"] == "exlq"] for n in sizes}
    alone = {n: [r for r in runs if r["n"] == n and r["system"] == "exlq-engine"] for n in sizes}

    def cell(rows: list[Record], read: Callable[[Record], float]) -> str:
        values = []
        for r in rows:
            try:
                values.append(read(r))
            except (IndexError, KeyError, ValueError):
                continue
        return f"{statistics.median(values):.2f}" if values else "-"

    lines = [
        "| stage (ms after the burst's first submit, median of the runs) | "
        + " | ".join(f"{n} jobs ({len(exlq[n])} runs)" for n in sizes)
        + " |",
        "|---" * (len(sizes) + 1) + "|",
    ]
    for label, read in STAGES:
        lines.append(f"| exlq: {label} | " + " | ".join(cell(exlq[n], read) for n in sizes) + " |")
    for label, read in [
        ("engine alone: its jobs built, the first step begins", lambda r: r["steps"][0][0]),
        ("engine alone: the first step ends", lambda r: r["steps"][0][1]),
        ("engine alone: the median job's first token", lambda r: r["first_token_by_group"][0]),
    ]:
        lines.append(f"| {label} | " + " | ".join(cell(alone[n], read) for n in sizes) + " |")
    return "\n".join(lines)


def main() -> None:
    from bench.exlq_path import add_client_options, add_engine_options, add_worker_options

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--concurrency", default="8,128")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=256)
    ap.add_argument("-m", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps-shown", type=int, default=8)
    add_engine_options(ap)
    add_worker_options(ap)
    add_client_options(ap)
    ap.add_argument("--worker-cpus", default="auto")
    ap.add_argument("--models", default="/tmp/exlq-models")
    ap.add_argument("--out", type=Path, help="folder for the timelines (and the trace files)")
    ap.add_argument(
        "--table", type=Path, metavar="JSON", help="measure nothing: the stage table of a result"
    )
    ap.add_argument(
        "--engine-class",
        action="store_true",
        help="also run the worker's engine class in this process (EngineClassAlone)",
    )
    args = ap.parse_args()
    if args.table:
        print(stage_table(json.loads(args.table.read_text())))
    elif args.out is None:
        raise SystemExit("--out is required to measure")
    else:
        from bench.make_checkpoint import model_for

        model, shape = model_for(args.shape, Path(args.models))
        runs = measure(args, model, shape)
        (args.out / f"path-trace-{shape}.json").write_text(json.dumps(runs, indent=1))


def _load_in_process(
    args: argparse.Namespace, model: Path, max_batch_size: int, cpus: frozenset[int] | None
) -> tuple[Any, EngineClassAlone | None]:
    """The engine alone (and the engine class, if asked), loaded in this process; then,
    with --freeze-gc, what they loaded is moved out of the collector's reach."""
    from bench.exlq_path import engine_options, freeze_loaded_objects
    from bench.paired import EngineAlone
    from bench.placement import on_cpus

    with on_cpus(cpus):
        engine = EngineAlone(model, max_batch_size, **engine_options(args))
        engine_class = (
            EngineClassAlone(model, max_batch_size, dict(engine_options(args)))
            if args.engine_class
            else None
        )
    if args.freeze_gc:
        freeze_loaded_objects()
    return engine, engine_class


class TracedSystems:
    """Runs one burst on each system and turns what was recorded into its timeline."""

    def __init__(
        self,
        args: argparse.Namespace,
        place: Placement,
        trace_dir: Path,
        bench_trace: BenchTrace,
        engine: Any,
        path: Any,
        engine_class: EngineClassAlone | None,
        clocks: ClockRecorder,
    ) -> None:
        self.args, self.place, self.bench_trace = args, place, bench_trace
        self.clocks = clocks
        self.engine, self.path, self.engine_class = engine, path, engine_class
        self.trace_dir = trace_dir

    def all(self) -> list[Callable[[list[list[int]], list[list[int]]], Record]]:
        systems: list[Callable[[list[list[int]], list[list[int]]], Record]] = [
            self.run_engine,
            self.run_exlq,
        ]
        return systems + ([self.run_class] if self.engine_class else [])

    def _group(self, jobs: int) -> int:
        return slice_jobs(self.args.admit_prompt_tokens, self.args.prompt_tokens, jobs)

    def run_engine(self, prompts: list[list[int]], warm_up: list[list[int]]) -> Record:
        from bench.placement import on_cpus

        with on_cpus(self.place.server):
            row = self.engine.run(prompts, warm_up, self.args.max_new_tokens)
        t0, times, steps, _ = self.bench_trace.take()
        shown = [[_ms(a, t0), _ms(b, t0)] for a, b in steps[: self.args.steps_shown]]
        return self._clocks(t0, shown) | {
            "system": "exlq-engine",
            "ttft_ms_p50": row["ttft_ms_p50"],
            "build_ms": row["build_ms"],
            "bench_gc": self.bench_trace.gc_ms(t0),
            "steps": shown,
            "first_token_by_group": group_medians(
                [tt[0] for tt in times], t0, self._group(len(prompts))
            ),
        }

    def run_exlq(self, prompts: list[list[int]], warm_up: list[list[int]]) -> Record:
        from bench.placement import on_cpus

        with on_cpus(self.place.load):
            row = self.path.run(prompts, warm_up, self.args.max_new_tokens)
        t0, times, _, sdk_first = self.bench_trace.take()
        records = read_worker_trace(self.trace_dir, t0, t0 + row["wall_s"])
        group = self._group(len(prompts))
        timeline = exlq_timeline(records, t0, self.args.steps_shown)
        return self._clocks(t0, timeline["steps"]) | {
            "system": "exlq",
            "ttft_ms_p50": row["ttft_ms_p50"],
            "first_token_by_group": group_medians([tt[0] for tt in times], t0, group),
            "sdk_first_event_by_group": group_medians(sdk_first, t0, group),
            "bench_gc": self.bench_trace.gc_ms(t0),
            "sdk_sends": [[_ms(a, t0), _ms(b, t0), k] for a, b, k in self.bench_trace.last_sends],
            **timeline,
        }

    def _clocks(self, t0: float, steps: list[list[float]]) -> Record:
        """The GPU's clocks (bench.gpu_clocks) from the idle before the burst to the end of
        its shown steps: [ms after t0, SM MHz, memory MHz, W, NVML reasons] each sample."""
        end = t0 + (steps[-1][1] if steps else 0.0) / 1000
        samples = self.clocks.around(t0)
        if not samples:
            return {}
        first_ms = steps[0][1] if steps else 0.0
        return run_figures(samples, t0, first_ms, end) | {
            "gpu_clocks": timeline_of(samples, t0, t0 - IDLE_WINDOW_S, end)
        }

    def run_class(self, prompts: list[list[int]], warm_up: list[list[int]]) -> Record:
        from bench.placement import on_cpus

        assert self.engine_class is not None
        with on_cpus(self.place.server):
            row = self.engine_class.run(
                prompts, warm_up, self.args.max_new_tokens, self._group(len(prompts))
            )
        for key in ("steps", "step_build_iterate_ms"):
            row[key] = row[key][: self.args.steps_shown]
        return row


def measure(args: argparse.Namespace, model: Path, shape: str) -> list[Record]:
    from bench import baselines
    from bench.exlq_path import ExlqPath, engine_options, worker_options
    from bench.placement import placement

    concurrencies = [int(n) for n in args.concurrency.split(",")]
    place = placement(args.worker_cpus)
    trace_dir = args.out / f"trace-{shape}"
    trace_dir.mkdir(parents=True, exist_ok=True)
    bench_trace = BenchTrace()  # for the life of this process
    runs: list[Record] = []
    engine, engine_class = _load_in_process(args, model, max(concurrencies), place.server)
    try:
        with (
            ClockRecorder(cpus=place.load) as clocks,
            ExlqPath(
                model,
                max_batch_size=max(concurrencies),
                attention="exlq",
                worker_cpus=place.server,
                redis_cpus=place.load,
                worker_module="bench.path_trace",
                worker_env={TRACE_ENV: str(trace_dir)},
                worker_switches=worker_options(args),
                pack_ids=args.pack_ids,
                **engine_options(args),
            ) as path,
        ):
            systems = TracedSystems(
                args, place, trace_dir, bench_trace, engine, path, engine_class, clocks
            ).all()
            for n in concurrencies:
                for repeat in range(args.repeats):
                    prompts, warm_up = baselines.pair_prompts(model, n, args.prompt_tokens, repeat)
                    # In turn, as bench.paired: the second of a pair runs on a warmer GPU.
                    turn = repeat % len(systems)
                    for run_system in systems[turn:] + systems[:turn]:
                        runs.append(run_system(prompts, warm_up) | {"n": n, "repeat": repeat})
                    for r in runs[-len(systems) :]:
                        print(json.dumps(r), flush=True)
    finally:
        engine.close()
        if engine_class is not None:
            engine_class.close()
    return runs


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:  # the worker, as `exlq worker` with the wrappers above
        from exlq.cli import main as cli_main

        cli_main()
    else:
        main()
