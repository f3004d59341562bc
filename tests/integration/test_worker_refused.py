"""`exlq worker` refused by Redis: a bad password, or an ACL user without the queue, stops it
at start-up with one line that says what to fix (exit 2, before the engine loads); a
command refused while serving is one error line, however often the worker retries."""

from __future__ import annotations

import secrets
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import pytest
import redis

from exlq.protocol.keys import QueueKeys
from tests.conftest import worker_process

pytestmark = pytest.mark.integration


def _every_command_on(queue: str) -> list[str]:
    """ACL rules: every command, on one queue's keys (Redis 6.2 knows no selectors)."""
    return ["+@all", f"~exlq:{{{queue}}}:*", "&*"]


UserFactory = Callable[[list[str]], str]


@pytest.fixture
def acl_user(redis_url: str) -> Iterator[UserFactory]:
    """Make ACL users on the test server; each call returns a URL that logs in as one."""
    admin = redis.Redis.from_url(redis_url)
    made: list[str] = []

    def make(rules: list[str]) -> str:
        name, password = f"worker-{secrets.token_hex(4)}", secrets.token_hex(8)
        setuser = ["ACL", "SETUSER", name, "on", f">{password}", "resetkeys", *rules]
        admin.execute_command(*setuser)  # type: ignore[no-untyped-call]
        made.append(name)
        parts = urlsplit(redis_url)
        return urlunsplit(parts._replace(netloc=f"{quote(name)}:{password}@{parts.netloc}"))

    yield make
    for name in made:
        admin.execute_command("ACL", "DELUSER", name)  # type: ignore[no-untyped-call]
    admin.close()


def _with_password(url: str, password: str) -> str:
    parts = urlsplit(url)
    netloc = f"{parts.username}:{password}@{parts.hostname}:{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def test_a_user_refused_the_queue_stops_the_worker_before_its_engine_loads(
    acl_user: UserFactory, queue_name: str, tmp_path: Path
) -> None:
    url = acl_user(_every_command_on("another"))
    # The default engine with a model folder (Hugging Face weights: exllamav2): a refusal
    # after the load would say it found no GPU (or torch) instead.
    (tmp_path / "config.json").write_text("{}")
    process = worker_process(url, queue_name, "--model", str(tmp_path))
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 2, output
    assert "Traceback" not in output
    [line] = output.splitlines()
    user = urlsplit(url).username
    assert f"Redis user '{user}' may not send XGROUP CREATE for queue '{queue_name}'" in line
    assert "no permissions to access" in line
    assert f"~{QueueKeys(queue_name).base}*" in line and "docs/SECURITY.md" in line


@pytest.mark.parametrize("who", ["wrong password", "unknown user"])
def test_refused_credentials_are_named_as_such(
    acl_user: UserFactory, queue_name: str, who: str
) -> None:
    url = acl_user(_every_command_on(queue_name))
    if who == "wrong password":
        url = _with_password(url, "not-the-password")
    else:
        url = url.replace(f"{urlsplit(url).username}:", "nobody-here:", 1)
    process = worker_process(url, queue_name, "--engine", "echo")
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 2, output
    assert "Traceback" not in output
    assert "refused the credentials" in output
    assert "check the user name and password in --redis-url / EXLQ_REDIS_URL" in output
    assert "start Redis" not in output
    assert "not-the-password" not in output  # the URL is shown redacted


def test_a_command_refused_while_serving_is_one_error_line(
    acl_user: UserFactory, queue_name: str
) -> None:
    url = acl_user([*_every_command_on(queue_name), "-xreadgroup"])
    process = worker_process(url, queue_name, "--engine", "echo")
    try:
        time.sleep(4)  # the read loop retries many times meanwhile (backoff from 0.1 s)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, output
    assert "Traceback" not in output
    # The worker reads through a script, whose refused call Redis 7.0 does not name.
    [line] = [line for line in output.splitlines() if "may not send" in line]
    assert " ERROR " in line
    assert f"for queue '{queue_name}'" in line and "docs/SECURITY.md" in line


def test_a_start_script_the_acl_refuses_leaves_the_job_pending_not_failed(
    acl_user: UserFactory, queue_name: str, redis_url: str
) -> None:
    """The start script's HINCRBY refused: the worker's configuration, not the job's
    fault. The job gets no error and no dead letter; its entry waits for a worker that
    may start it."""
    url = acl_user([*_every_command_on(queue_name), "-hincrby"])
    keys = QueueKeys(queue_name)
    admin = redis.Redis.from_url(redis_url)
    process = worker_process(url, queue_name, "--engine", "echo")
    try:
        time.sleep(2)  # started: the group exists
        admin.xadd(keys.jobs, {"job": '{"id":"refused-start","prompt":"hi"}'})
        time.sleep(2)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
        pending = admin.xpending(keys.jobs, "workers")["pending"]
        dead = admin.xlen(keys.dead)
        result = admin.get(keys.result("refused-start"))
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        admin.close()
    assert pending == 1 and dead == 0 and result is None, output
    assert "may not send" in output and "Traceback" not in output
