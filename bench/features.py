"""What the generation features cost or buy, on the exllamav2 engine alone (no queue):
structured output against plain jobs, speculative decoding against none, and a model on
one GPU against split over several.

    python -m bench.features constrained --shape 1b --jobs 64
    python -m bench.features drafting --shape 8b --draft-shape 1b
    python -m bench.features placement --shape 8b --jobs 1,64 --gpu-split 8,8 --exl2-bits 4

Each run prints a Markdown table (tokens/s of completion tokens over the burst's wall time,
TTFT p50) and writes it as JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.make_checkpoint import make_checkpoint
from exlq.protocol.models import GenerationRequest
from exlq.worker.engines.base import Engine, JobEnded, JobErrored, TokenChunk

# An object with required string, integer, enum and array fields, the shape of the checks.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 8},
    },
    "required": ["name", "age", "role", "tags"],
}
PROMPT_WORDS = "the queue holds jobs and the workers take them in turn " * 24


def checkpoint(models: Path, shape: str) -> Path:
    """The random-weight checkpoint of ``shape`` under ``models``, written once."""
    directory = models / f"llama-{shape}-random"
    if (directory / "config.json").exists() and (directory / "chat_template.jinja").exists():
        return directory
    return make_checkpoint(directory, shape)


def load(model: Path, batch: int, **options: Any) -> Engine:
    from exlq.worker.engines import build_engine
    from exlq.worker.settings import WorkerSettings

    settings = WorkerSettings.load(
        {"cache_tokens": 65_536, **options}, model=model, max_batch_size=batch
    )
    return build_engine("exllamav2", settings.load_request())


def run_burst(engine: Engine, requests: list[GenerationRequest]) -> dict[str, Any]:
    """Add every request at once and step until all end: completion tokens/s over the
    burst, TTFT p50 in ms, and how the jobs ended."""
    started = time.perf_counter()
    for i, request in enumerate(requests):
        engine.add(f"j{i}", request)
    first: dict[str, float] = {}
    tokens = drafted = accepted = 0
    ended: dict[str, str] = {}
    texts: dict[str, str] = {}
    while len(ended) < len(requests):
        for out in engine.step():
            if isinstance(out, TokenChunk):
                first.setdefault(out.job_id, time.perf_counter() - started)
                texts[out.job_id] = texts.get(out.job_id, "") + out.text
            elif isinstance(out, JobEnded):
                tokens += out.completion_tokens
                drafted += out.draft_tokens or 0
                accepted += out.accepted_draft_tokens or 0
                ended[out.job_id] = out.finish_reason
            elif isinstance(out, JobErrored):
                ended[out.job_id] = f"error: {out.message}"
    wall = time.perf_counter() - started
    return {
        "jobs": len(requests),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_ms": round(statistics.median(first.values()) * 1000, 1) if first else None,
        "finish": {r: list(ended.values()).count(r) for r in set(ended.values())},
        "acceptance": round(accepted / drafted, 3) if drafted else None,
        "texts": [texts.get(f"j{i}", "") for i in range(len(requests))],
    }


def requests(jobs: int, new_tokens: int, seed: int = 0, **fields: Any) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            prompt=f"{i} {PROMPT_WORDS}",
            max_new_tokens=new_tokens,
            sampling={"temperature": 0.7, "seed": seed + i},  # type: ignore[arg-type]
            **fields,
        )
        for i in range(jobs)
    ]


def constrained(args: argparse.Namespace, model: Path) -> list[dict[str, Any]]:
    """64 jobs constrained by a JSON schema against 64 plain ones, sampled alike; the JSON
    jobs end when their object is complete, so tokens/s is what compares."""
    rows = []
    for jobs in args.jobs:
        engine = load(model, max(jobs, 8))
        try:
            run_burst(engine, requests(min(jobs, 8), 16))  # first-use costs out of the way
            schema = {"type": "json_schema", "json_schema": {"schema": PERSON_SCHEMA}}
            for name, fields in (
                ("plain", {"ignore_eos": True}),
                ("json_schema", {"response_format": schema}),
                ("plain", {"ignore_eos": True}),
                ("json_schema", {"response_format": schema}),
            ):
                result = run_burst(engine, requests(jobs, args.new_tokens, **fields))
                parsed = sum(_parses(text) for text in result.pop("texts"))
                rows.append({"case": name, "parsed_json": parsed, **result})
        finally:
            engine.close()
    return rows


def _parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def drafting(args: argparse.Namespace, model: Path) -> list[dict[str, Any]]:
    """One job at a time: no drafting, a draft model equal to the model (every draft
    accepted), a draft of another shape (random weights: few accepted), and n-grams on a
    prompt the output repeats."""
    draft = checkpoint(args.models, args.draft_shape)
    cases: list[tuple[str, dict[str, Any]]] = [
        ("none", {}),
        ("draft = model", {"draft_model": str(model)}),
        (f"draft {args.draft_shape}", {"draft_model": str(draft)}),
        ("ngram", {"ngram_draft": True}),
    ]
    rows = []
    for name, options in cases:
        engine = load(model, 8, **options)
        try:
            greedy: dict[str, Any] = {"sampling": {"temperature": 0.0}, "ignore_eos": True}
            run_burst(engine, [GenerationRequest(prompt="warm up", max_new_tokens=16, **greedy)])
            for repeat in range(args.repeats):
                request = GenerationRequest(
                    prompt=f"{repeat} {PROMPT_WORDS}",
                    max_new_tokens=args.new_tokens,
                    **greedy,
                )
                result = run_burst(engine, [request])
                text = result.pop("texts")[0]
                rows.append({"case": name, "repeat": repeat, **result, "text": text[:60]})
        finally:
            engine.close()
    return rows


def placement(args: argparse.Namespace, model: Path) -> list[dict[str, Any]]:
    """The model on one GPU, split by layers, and split by tensor parallelism (on an EXL2
    conversion, the only weights exllamav2 splits so): tokens/s at each job count, then a
    greedy check of 8 jobs against a reference placement, eager like the split ones, with
    the top-two logprob margin where a job's text parts from it."""
    fp16 = "fp16, one GPU, graphs off"
    cases: list[tuple[str, Path, dict[str, Any], str | None]] = [
        ("fp16, one GPU", model, {}, fp16),
        (fp16, model, {"cuda_graphs": False}, None),
        (f"fp16, layers {args.gpu_split}", model, {"gpu_split": args.gpu_split}, fp16),
        ("fp16, tensor parallel", model, {"tensor_parallel": True}, fp16),
    ]
    rows: list[dict[str, Any]] = []
    if args.exl2_bits:
        from bench.exl2 import exl2_checkpoint

        shape = args.exl2_shape or args.shape
        exl2, seconds = exl2_checkpoint(args.models, shape, args.exl2_bits)
        name = f"EXL2 {args.exl2_bits} bpw {shape}"
        rows.append({"case": f"{name} conversion", "seconds": round(seconds)})
        eager = f"{name}, one GPU, graphs off"
        cases += [
            (f"{name}, one GPU", exl2, {}, eager),
            (eager, exl2, {"cuda_graphs": False}, None),
            (f"{name}, tensor parallel", exl2, {"tensor_parallel": True}, eager),
        ]
    references: dict[str, list[list[tuple[int, float]]]] = {}
    for name, path, options, reference in cases:
        try:
            engine = load(path, max(args.jobs), **options)
        except Exception as exc:  # a placement that cannot load is a result too
            rows.append({"case": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        try:
            info = engine.info()
            greedy: dict[str, Any] = {"sampling": {"temperature": 0.0}, "ignore_eos": True}
            run_burst(engine, [GenerationRequest(prompt="warm up", max_new_tokens=8, **greedy)])
            for jobs in args.jobs:
                burst = [
                    GenerationRequest(
                        prompt=f"{i} {PROMPT_WORDS}", max_new_tokens=args.new_tokens, **greedy
                    )
                    for i in range(jobs)
                ]
                result = run_burst(engine, burst)
                result.pop("texts")
                rows.append({"case": name, **result, "graphs": info["decode_graphs"]})
            choices = greedy_choices(engine, jobs=8, new_tokens=64)
            references[name] = choices
            row = {"case": name, "weights": info["placement"]}
            if reference in references:
                row.update(compare_greedy(references[reference], choices, against=reference))
            rows.append(row)
        except Exception as exc:
            rows.append({"case": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
        finally:
            engine.close()
        _save(args, rows)
    return rows


def greedy_choices(engine: Engine, jobs: int, new_tokens: int) -> list[list[tuple[int, float]]]:
    """Each of ``jobs`` greedy jobs' tokens, with the margin between its step's top two
    logprobs."""
    burst = {
        f"g{i}": GenerationRequest(
            prompt=f"{i} {PROMPT_WORDS}",
            max_new_tokens=new_tokens,
            sampling={"temperature": 0.0},  # type: ignore[arg-type]
            ignore_eos=True,
            logprobs=2,
        )
        for i in range(jobs)
    }
    for job_id, request in burst.items():
        engine.add(job_id, request)
    steps: dict[str, list[tuple[int, float]]] = {job_id: [] for job_id in burst}
    ended: set[str] = set()
    while len(ended) < jobs:
        for out in engine.step():
            if isinstance(out, TokenChunk):
                for token, choice in zip(out.token_ids, out.logprobs or [], strict=True):
                    margin = choice.top[0].logprob - choice.top[1].logprob
                    steps[out.job_id].append((token, margin))
            elif isinstance(out, (JobEnded, JobErrored)):
                ended.add(out.job_id)
    return list(steps.values())


def compare_greedy(
    want: list[list[tuple[int, float]]], got: list[list[tuple[int, float]]], against: str
) -> dict[str, Any]:
    """How many jobs' greedy tokens equal the reference's, and where the others part, the
    reference's top-two margin there (small: a near tie that rounding can turn)."""
    margins = []
    for reference, tokens in zip(want, got, strict=True):
        pairs = enumerate(zip(reference, tokens, strict=True))
        parted = next((n for n, (a, b) in pairs if a[0] != b[0]), None)
        if parted is not None:
            margins.append(round(reference[parted][1], 4))
    return {
        "greedy_same_as": against,
        "same_jobs": f"{len(want) - len(margins)} of {len(want)}",
        "margins_where_parted": margins,
    }


def _save(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.what}-{args.shape}.json").write_text(json.dumps(rows, indent=1))


def table(rows: list[dict[str, Any]]) -> str:
    keys = [k for k in rows[0] if k not in ("texts",)] if rows else []
    for row in rows[1:]:
        keys += [k for k in row if k not in keys]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=["constrained", "drafting", "placement"])
    parser.add_argument("--shape", default="1b")
    parser.add_argument("--draft-shape", default="1b")
    parser.add_argument("--jobs", default="64", type=lambda s: [int(n) for n in s.split(",")])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gpu-split", default="8,8")
    parser.add_argument("--exl2-bits", type=float, default=0.0, help="placement: EXL2 too")
    parser.add_argument("--exl2-shape", default="", help="the EXL2 cases' shape (--shape)")
    parser.add_argument("--models", type=Path, default=Path("/tmp/exlq-models"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/features"))
    args = parser.parse_args(argv)
    model = checkpoint(args.models, args.shape)
    run = {"constrained": constrained, "drafting": drafting, "placement": placement}[args.what]
    rows = run(args, model)
    print(f"\n## {args.what}, {args.shape}\n\n{table(rows)}\n", flush=True)
    _save(args, rows)


if __name__ == "__main__":
    main()
