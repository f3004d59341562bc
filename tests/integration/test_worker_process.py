"""`exlq worker` as a real process: clean stop on SIGTERM, clear errors at start."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from typing import Any

import pytest

from exlq.producer import AsyncProducer, DoneEvent, TokenEvent
from exlq.worker.embedded_redis import free_port
from tests.conftest import ROOT, worker_process

pytestmark = pytest.mark.integration


async def test_sigterm_lets_running_jobs_finish_then_exits_0(
    redis_url: str, queue_name: str
) -> None:
    process = worker_process(
        redis_url,
        queue_name,
        "--engine",
        "echo",
        "-o",
        "tokens_per_second=20",
        "--max-batch-size",
        "4",
    )
    try:
        # The worker process may still be starting when the jobs have waited 3 s.
        async with AsyncProducer(redis_url, queue=queue_name, wait_for_worker=True) as producer:
            handles = [await producer.submit(f"job {i}", max_new_tokens=30) for i in range(4)]
            # Wait until every job has produced a token, then ask the worker to stop.
            streams = [h.stream() for h in handles]
            firsts = await asyncio.wait_for(asyncio.gather(*(anext(s) for s in streams)), 20)
            assert all(isinstance(e, TokenEvent) for e in firsts)
            process.send_signal(signal.SIGTERM)
            ends = []
            for stream in streams:
                events = [e async for e in stream]
                ends.append(events[-1])
        output, _ = await asyncio.to_thread(process.communicate, None, 30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, output
    assert all(isinstance(e, DoneEvent) and e.finish_reason == "length" for e in ends)
    assert "finishing running jobs" in output


def test_unreachable_redis_fails_fast_with_a_clear_message(queue_name: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    process = worker_process(url, queue_name, "--engine", "echo")
    output, _ = process.communicate(timeout=30)
    assert process.returncode == 2
    assert f"cannot reach Redis at {url}" in output
    assert "Traceback" not in output


def test_exllamav2_engine_without_cuda_says_so(
    redis_url: str, queue_name: str, tmp_path: Any
) -> None:
    (tmp_path / "config.json").write_text("{}")  # Hugging Face weights: exllamav2 serves them
    process = worker_process(redis_url, queue_name, "--model", str(tmp_path))
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 2, output
    assert "GPU" in output or "CUDA" in output or "torch" in output
    assert "Traceback" not in output


def test_bad_setting_is_refused_with_its_name() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "exlq",
            "worker",
            "--engine",
            "echo",
            "--max-batch-size",
            "0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "max_batch_size" in done.stderr


def test_cli_submit_prints_the_result(redis_url: str, queue_name: str) -> None:
    process = worker_process(redis_url, queue_name, "--engine", "echo")
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "exlq",
                "submit",
                "cli words",
                "--queue",
                queue_name,
                "--redis-url",
                redis_url,
                "--max-new-tokens",
                "3",
                "--timeout",
                "20",
                # The worker process may still be starting when the job has waited 3 s.
                "--wait-for-worker",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        streamed = subprocess.run(
            [
                sys.executable,
                "-m",
                "exlq",
                "submit",
                "cli words",
                "--queue",
                queue_name,
                "--redis-url",
                redis_url,
                "--max-new-tokens",
                "3",
                "--stream",
                "--timeout",
                "20",
                # The worker process may still be starting when the job has waited 3 s.
                "--wait-for-worker",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        process.terminate()
        process.communicate(timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout == " cli words cli\n"
    assert streamed.stdout == " cli words cli\n"
    assert "[length: 3 tokens" in streamed.stderr


def test_up_starts_its_own_redis_and_a_worker(tmp_path: Any) -> None:
    port = free_port()
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "exlq",
            "up",
            "--engine",
            "echo",
            "--queue",
            "demo",
            "--redis-port",
            str(port),
            "--data-dir",
            str(tmp_path),
            "--metrics-port",
            "0",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert up.stdout is not None
        banner = "".join(up.stdout.readline() for _ in range(4))
        assert f"exlq submit 'Hello' --queue demo --redis-url redis://127.0.0.1:{port}/0" in banner
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "exlq",
                "submit",
                "up works",
                "--queue",
                "demo",
                "--redis-url",
                f"redis://127.0.0.1:{port}/0",
                "--max-new-tokens",
                "2",
                "--timeout",
                "20",
                # The worker process may still be starting when the job has waited 3 s.
                "--wait-for-worker",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.stdout == " up works\n", done.stderr
        up.send_signal(signal.SIGINT)
        up.communicate(timeout=30)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate()
    assert up.returncode == 0
    assert (tmp_path / "redis" / "appendonly.aof").exists() or any((tmp_path / "redis").iterdir())
