"""The actions of exllamav2's WebSocket protocol, served from one exlq queue.

Unlike exllamav2's server, which runs one infer at a time under a model lock, each infer
here is its own task: the queue's workers batch them. echo, estimate_token,
lefttrim_token and stop are answered in the order they arrive.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from exlq.producer.client import AsyncProducer
from exlq.producer.gateways.exllamav2_ws import protocol
from exlq.producer.gateways.exllamav2_ws.infer import run_infer
from exlq.producer.gateways.exllamav2_ws.protocol import (
    Message,
    error_message,
    infer_head,
    reply_head,
)
from exlq.producer.gateways.exllamav2_ws.request_models import (
    InferRequest,
    TextRequest,
    TrimRequest,
)
from exlq.producer.gateways.exllamav2_ws.session import Session
from exlq.producer.gateways.exllamav2_ws.tokens import ModelTokenizer
from exlq.protocol.models import describe_validation_error

log = logging.getLogger(__name__)

Action = Callable[[Session, Message], Awaitable[None]]


class Gateway:
    def __init__(self, producer: AsyncProducer, tokenizer: ModelTokenizer | None) -> None:
        self._producer = producer
        self._tokenizer = tokenizer
        self._eos_ids = tokenizer.eos_ids if tokenizer is not None else frozenset()
        self._infers: set[asyncio.Task[None]] = set()
        self._actions: dict[str, Action] = {
            "echo": self._echo,
            "estimate_token": self._estimate_token,
            "lefttrim_token": self._lefttrim_token,
            "infer": self._infer,
            "stop": self._stop,
        }

    async def serve_connection(self, websocket: ServerConnection) -> None:
        """Answer one client's messages until it leaves; then cancel its jobs."""
        session = Session(websocket)
        try:
            async for raw in websocket:
                await self.dispatch(session, raw)
        except ConnectionClosed:
            pass  # a close without a close frame: the same as a clean one here
        finally:
            await session.stop_all()

    async def dispatch(self, session: Session, raw: str | bytes) -> None:
        """Answer one message; every failure becomes an error message on it."""
        request = _decode(raw)
        if isinstance(request, str):
            await session.send(error_message({}, protocol.INVALID_JSON, request))
            return
        name = request.get("action")
        action = self._actions.get(name) if isinstance(name, str) else None
        if action is None:
            await session.send(_unknown_action(request))
            return
        try:
            await action(session, request)
        except ValidationError as exc:
            text = f"{request['action']}: {describe_validation_error(exc)}"
            await session.send(error_message(_error_head(request), protocol.INVALID_REQUEST, text))
        except Exception as exc:  # a bug here must not end the connection
            log.exception("%s failed", request["action"])
            message = f"the gateway failed: {exc!r}"
            await session.send(
                error_message(_error_head(request), protocol.INTERNAL_ERROR, message)
            )

    async def drain(self, grace_s: float) -> None:
        """Let infers in flight end (their jobs were cancelled when their connections
        closed); cancel those still running after ``grace_s``."""
        if self._infers:
            _, pending = await asyncio.wait(set(self._infers), timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _echo(self, session: Session, request: Message) -> None:
        await session.send(reply_head(request))

    async def _estimate_token(self, session: Session, request: Message) -> None:
        tokenizer = await self._need_tokenizer(session, request)
        if tokenizer is not None:
            text = TextRequest.model_validate(request).text
            # Off the event loop: a long text takes a while to encode.
            num_tokens = await asyncio.to_thread(tokenizer.count, text)
            await session.send({**reply_head(request), "num_tokens": num_tokens})

    async def _lefttrim_token(self, session: Session, request: Message) -> None:
        tokenizer = await self._need_tokenizer(session, request)
        if tokenizer is not None:
            trim = TrimRequest.model_validate(request)
            trimmed = await asyncio.to_thread(tokenizer.keep_last, trim.text, trim.trimmed_length)
            await session.send({**reply_head(request), "trimmed_text": trimmed})

    async def _infer(self, session: Session, request: Message) -> None:
        infer = InferRequest.model_validate(request)
        # Registered before the task starts, so that a stop read next already sees it.
        running = session.start_infer()
        task = asyncio.create_task(
            run_infer(session, running, self._producer, infer_head(request), infer, self._eos_ids)
        )
        self._infers.add(task)
        task.add_done_callback(self._infers.discard)

    async def _stop(self, session: Session, request: Message) -> None:
        await session.stop_all()
        await session.send(reply_head(request))

    async def _need_tokenizer(self, session: Session, request: Message) -> ModelTokenizer | None:
        if self._tokenizer is None:
            message = (
                f"{request['action']} needs the model's tokenizer: start the gateway with "
                "--tokenizer DIR (the model's folder, holding tokenizer.json)"
            )
            await session.send(error_message(reply_head(request), protocol.NO_TOKENIZER, message))
        return self._tokenizer


def _decode(raw: str | bytes) -> dict[str, Any] | str:
    """The message as a JSON object, or a sentence that says why it is not one."""
    try:
        request = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        return f"the message is not JSON: {exc}"
    if not isinstance(request, dict):
        return f"the message must be a JSON object, not {type(request).__name__}"
    return request


def _refuse_constant(name: str) -> object:
    # Python reads NaN and Infinity, which JSON has not: an echoed id would not be JSON.
    raise ValueError(f"{name} is not a JSON value")


def _unknown_action(request: Message) -> Message:
    if "action" not in request:
        text = f"the message has no action: send one of {', '.join(protocol.ACTIONS)}"
        return error_message(reply_head(request), protocol.INVALID_REQUEST, text)
    text = f"unknown action {request['action']!r}: send one of {', '.join(protocol.ACTIONS)}"
    return error_message(reply_head(request), protocol.UNKNOWN_ACTION, text)


def _error_head(request: Message) -> Message:
    return infer_head(request) if request.get("action") == "infer" else reply_head(request)
