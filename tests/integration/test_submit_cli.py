"""`exlq submit` as a newcomer meets it: the job's id at once on stderr, a timeout that
says which job timed out, a queue without workers that says so, and `exlq --version`."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from typing import Any

import pytest

from exlq import __version__
from exlq.protocol.keys import QueueKeys
from tests.conftest import ROOT

pytestmark = pytest.mark.integration

_JOB_LINE = re.compile(r"^job ([0-9a-f]{32})$", re.MULTILINE)


def _exlq(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "exlq", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _submit(redis_url: str, queue: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return _exlq(
        "submit", "cli words", "--queue", queue, "--redis-url", redis_url, "--max-new-tokens", "3",
        *extra,
    )  # fmt: skip


def test_version_prints_the_packages_version() -> None:
    done = _exlq("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"exlq {__version__}\n"


@pytest.mark.cluster_too
async def test_submit_prints_the_job_id_on_stderr_and_only_the_text_on_stdout(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker()
    done = await asyncio.to_thread(_submit, redis_url, queue_name, "--timeout", "20")
    assert done.returncode == 0, done.stderr
    assert done.stdout == " cli words cli\n"
    assert _JOB_LINE.search(done.stderr), done.stderr


@pytest.mark.cluster_too
async def test_chat_sends_the_prompt_as_a_user_message(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: Any
) -> None:
    await start_worker()
    done = await asyncio.to_thread(_submit, redis_url, queue_name, "--chat", "--timeout", "20")
    assert done.returncode == 0, done.stderr
    assert done.stdout == " cli words cli\n"  # the echo engine echoes the last message
    entries = await redis_client.xrange(QueueKeys(queue_name).jobs)
    request = json.loads(entries[-1][1][b"job"])
    assert request["messages"] == [{"role": "user", "content": "cli words"}]
    assert "prompt" not in request or request["prompt"] is None


def test_a_timeout_names_the_job_and_how_to_cancel_it(redis_url: str, queue_name: str) -> None:
    # --wait-for-worker: the job waits (no worker here), so the timeout is what ends it.
    done = _submit(redis_url, queue_name, "--timeout", "3.5", "--wait-for-worker")
    assert done.returncode == 1
    found = _JOB_LINE.search(done.stderr)
    assert found, done.stderr
    job_id = found.group(1)
    assert f"error: job {job_id} did not end within 3.5s" in done.stderr
    assert f"exlq cancel {job_id} --queue {queue_name}" in done.stderr
    assert "Redis:" not in done.stderr
    # After 3 s without a word, the warning that no worker serves the queue.
    assert f"warning: job {job_id} waits: no live worker serves queue" in done.stderr
    assert done.stdout == ""


def test_a_queue_without_workers_is_an_error_that_says_so(redis_url: str, queue_name: str) -> None:
    done = _submit(redis_url, queue_name, "--timeout", "30")
    assert done.returncode == 1
    found = _JOB_LINE.search(done.stderr)
    assert found, done.stderr
    assert (
        f"error: job {found.group(1)} was not started and is cancelled: no live worker "
        f"serves queue {queue_name!r}"
    ) in done.stderr
    assert "--wait-for-worker" in done.stderr
    assert done.stdout == ""


async def test_json_schema_and_regex_go_into_the_request(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: Any, tmp_path: Any
) -> None:
    await start_worker()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    path = tmp_path / "count.json"
    path.write_text(json.dumps(schema))
    done = await asyncio.to_thread(
        _submit, redis_url, queue_name, "--json-schema", str(path), "--timeout", "20"
    )
    # The echo engine cannot constrain output and says so; the request carried the schema.
    assert done.returncode == 1
    assert "invalid_request" in done.stderr and "echo engine" in done.stderr, done.stderr
    entries = await redis_client.xrange(QueueKeys(queue_name).jobs)
    request = json.loads(entries[-1][1][b"job"])
    assert request["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "count", "schema": schema},
    }
    done = await asyncio.to_thread(
        _submit, redis_url, queue_name, "--regex", "[0-9]+", "--timeout", "20"
    )
    entries = await redis_client.xrange(QueueKeys(queue_name).jobs)
    assert json.loads(entries[-1][1][b"job"])["regex"] == "[0-9]+"


def test_a_schema_file_that_is_no_json_is_refused_before_anything_is_sent(
    redis_url: str, queue_name: str, tmp_path: Any
) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    done = _submit(redis_url, queue_name, "--json-schema", str(path))
    assert done.returncode == 1
    assert f"--json-schema {path}:" in done.stderr
    assert not _JOB_LINE.search(done.stderr)
