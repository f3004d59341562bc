"""OpenAI's request bodies into exlq jobs, and exlq's results into OpenAI's response bodies.
Shared by the live routes and the Batch API, so both read a body the same way."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from exlq.producer.client import build_request
from exlq.producer.gateways.openai_api.errors import OpenAIError
from exlq.producer.gateways.openai_api.job_errors import error_from_info
from exlq.producer.gateways.openai_api.request_models import (
    ChatBody,
    ChatMessageBody,
    CompletionBody,
)
from exlq.producer.gateways.openai_api.unsupported import refuse_unsupported
from exlq.protocol.keys import Lane
from exlq.protocol.models import (
    MAX_STOP_STRINGS,
    FinishReason,
    InvalidRequest,
    JobResult,
    Usage,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)
# OpenAI's roles that exlq's chat template knows; "developer" is OpenAI's newer name for
# "system" (its SDK sends it for reasoning models).
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# OpenAI has no finish reason for a job ended before its natural end by a cancel (someone
# else's: a client that disconnects hears nothing) or by its deadline: "length" says the
# text was cut short, which is what a client must know.
_FINISH_REASONS: dict[FinishReason, str] = {
    "stop": "stop",
    "length": "length",
    "cancelled": "length",
    "expired": "length",
}


def openai_finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else _FINISH_REASONS[reason]


@dataclass(frozen=True)
class ParsedRequest:
    """One OpenAI request, read and checked: what to submit, and how to answer."""

    endpoint: str
    model: str
    stream: bool
    n: int
    include_usage: bool
    # Alternatives per token the client asked for; None: no logprobs at all.
    top_logprobs: int | None
    priority: Lane
    service_tier: str
    seed: int | None
    # submit()'s keyword arguments shared by every choice (sampling without its seed).
    base_fields: dict[str, Any] = field(repr=False)

    @property
    def is_chat(self) -> bool:
        return self.endpoint == CHAT

    def job_fields(self) -> list[dict[str, Any]]:
        """The keyword arguments of AsyncProducer.submit for each of the n choices (no id):
        with a seed, choice i samples with seed + i, so the choices differ but repeat."""
        jobs = []
        for index in range(self.n):
            fields = {**self.base_fields, "priority": self.priority}
            if self.seed is not None:
                fields["sampling"] = {**fields["sampling"], "seed": self.seed + index}
            jobs.append(fields)
        return jobs


def parse_body(endpoint: str, body: dict[str, Any]) -> ParsedRequest:
    """Read an OpenAI body for ``endpoint``; raises OpenAIError(400) naming the parameter."""
    if endpoint not in ENDPOINTS:
        raise OpenAIError(400, f"endpoint {endpoint!r} is not one of {', '.join(ENDPOINTS)}")
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    model_type = ChatBody if endpoint == CHAT else CompletionBody
    try:
        parsed_body = model_type.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    refuse_unsupported(parsed_body)
    if isinstance(parsed_body, ChatBody):
        fields, top = _chat_fields(parsed_body)
    else:
        fields, top = _completion_fields(parsed_body)
    fields.update(_shared_fields(parsed_body))
    _check_wire(fields)
    return _parsed(endpoint, parsed_body, fields, top)


def _parsed(
    endpoint: str, body: ChatBody | CompletionBody, fields: dict[str, Any], top: int | None
) -> ParsedRequest:
    stream = bool(body.stream)
    if body.stream_options is not None and not stream:
        raise OpenAIError(
            400, "stream_options: only allowed when stream is true", param="stream_options"
        )
    flex = body.service_tier == "flex"
    return ParsedRequest(
        endpoint=endpoint,
        model=body.model,
        stream=stream,
        n=body.n or 1,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        top_logprobs=top,
        priority="batch" if flex else "interactive",
        service_tier="flex" if flex else "default",
        seed=body.seed,
        base_fields=fields,
    )


def _validation_error(exc: ValidationError) -> OpenAIError:
    first = exc.errors(include_url=False)[0]
    param = _param_name(first["loc"])
    if first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    else:
        message = f"{param}: {first['msg']}" if param else first["msg"]
    return OpenAIError(400, message, param=param or None, code="invalid_request")


def _param_name(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif not _is_union_tag(part):
            name += f".{part}" if name else part
    return name


def _is_union_tag(part: str) -> bool:
    # pydantic names the union member it tried: "list[int]", "str", "function-after[...]".
    return "[" in part or part in {"str", "int", "float", "bool", "list", "dict"}


def _chat_fields(body: ChatBody) -> tuple[dict[str, Any], int | None]:
    messages = [_message(index, message) for index, message in enumerate(body.messages)]
    if body.max_tokens is not None and body.max_completion_tokens not in (None, body.max_tokens):
        raise OpenAIError(
            400,
            "max_tokens and max_completion_tokens differ: give one of them",
            param="max_completion_tokens",
        )
    if body.top_logprobs and not body.logprobs:
        raise OpenAIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    fields: dict[str, Any] = {"messages": messages}
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is not None:
        fields["max_new_tokens"] = max_tokens
    top = (body.top_logprobs or 0) if body.logprobs else None
    return fields, top


def _message(index: int, message: ChatMessageBody) -> dict[str, str]:
    where = f"messages[{index}]"
    role = _ROLES.get(message.role)
    if role is None:
        raise OpenAIError(
            400,
            f"{where}.role: role {message.role!r} is not supported; use system, developer, "
            "user or assistant",
            param=f"{where}.role",
        )
    for name in message.model_extra or {}:
        param = f"{where}.{name}"
        raise OpenAIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if message.tool_calls:
        raise OpenAIError(
            400, f"{where}.tool_calls: tool calls are not supported", param=f"{where}.tool_calls"
        )
    content = message.content
    if content is None:
        raise OpenAIError(
            400, f"{where}.content: a message needs its content", param=f"{where}.content"
        )
    if isinstance(content, list):
        content = _joined_text(where, content)
    return {"role": role, "content": content}


def _joined_text(where: str, parts: list[dict[str, Any]]) -> str:
    """Text parts joined with newlines (as vLLM joins them); any other part is refused."""
    texts = []
    for index, part in enumerate(parts):
        kind = part.get("type")
        text = part.get("text")
        if kind != "text" or not isinstance(text, str):
            param = f"{where}.content[{index}]"
            raise OpenAIError(
                400,
                f"{param}: content part type {kind!r} is not supported; only 'text' parts "
                "(with a string 'text')",
                param=param,
            )
        texts.append(text)
    return "\n".join(texts)


def _completion_fields(body: CompletionBody) -> tuple[dict[str, Any], int | None]:
    fields: dict[str, Any] = _prompt_field(body.prompt)
    if body.max_tokens is not None:
        fields["max_new_tokens"] = body.max_tokens
    return fields, body.logprobs


def _prompt_field(prompt: str | list[str] | list[int] | list[list[int]]) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if len(prompt) == 1 and isinstance(prompt[0], str | list):
        return _prompt_field(prompt[0])
    if prompt and all(isinstance(item, int) for item in prompt):
        return {"input_ids": prompt}
    raise OpenAIError(
        400,
        "prompt: give one prompt (a string or a list of token ids); send one request per "
        "prompt instead of a list of several",
        param="prompt",
    )


def _shared_fields(body: ChatBody | CompletionBody) -> dict[str, Any]:
    fields: dict[str, Any] = {"sampling": _sampling(body), "stop": _stop_strings(body.stop)}
    if body.metadata is not None:
        fields["metadata"] = body.metadata
    if body.response_format is not None:
        fields["response_format"] = body.response_format
    if body.regex is not None:
        fields["regex"] = body.regex
    if isinstance(body, ChatBody) and body.logprobs:
        fields["logprobs"] = max(body.top_logprobs or 0, 1)
    elif isinstance(body, CompletionBody) and body.logprobs is not None:
        # logprobs=0 asks for the chosen token's logprob alone: the wire's 1 brings it.
        fields["logprobs"] = max(body.logprobs, 1)
    return fields


def _sampling(body: ChatBody | CompletionBody) -> dict[str, Any]:
    given = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
    }
    sampling = {name: value for name, value in given.items() if value is not None}
    if sampling.get("top_p") == 0.0:
        # A nucleus of no mass keeps the likeliest token alone: greedy.
        del sampling["top_p"]
        sampling["temperature"] = 0.0
    return sampling


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in strings):
        raise OpenAIError(400, "stop: a stop string must not be empty", param="stop")
    if len(strings) > MAX_STOP_STRINGS:
        raise OpenAIError(
            400, f"stop: at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop"
        )
    return strings


# Parameters the wire names as OpenAI does: a wire error's field is the parameter at fault.
_SAME_NAMES = frozenset({"response_format", "regex"})


def _check_wire(fields: dict[str, Any]) -> None:
    """What the wire refuses (a metadata value that is no JSON, a malformed response_format,
    say) as a 400 now, not a failed job later."""
    try:
        build_request(None, fields)
    except InvalidRequest as exc:
        message = str(exc)
        where = message.split(":", 1)[0]
        param = where if where.split(".", 1)[0] in _SAME_NAMES else None
        raise OpenAIError(400, message, param=param, code="invalid_request") from None


# -- responses ------------------------------------------------------------------------------


def usage_body(usages: list[Usage]) -> dict[str, Any]:
    """OpenAI's usage for one request's jobs: the prompt counted once (as OpenAI counts it
    for n choices), the completions summed, the cached tokens those of the least cached."""
    prompt = max((u.prompt_tokens for u in usages), default=0)
    completion = sum(u.completion_tokens for u in usages)
    cached = min((u.cached_tokens for u in usages), default=0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def response_from_results(
    parsed: ParsedRequest, results: list[JobResult], response_id: str, created: int
) -> dict[str, Any]:
    """The whole chat.completion / text_completion body, one choice per result in order.
    A failed result raises its OpenAIError (400 for a request the worker refused, else
    500)."""
    for result in results:
        if result.state == "failed" and result.error is not None:
            raise error_from_info(result.error)
    choices = [_choice(parsed, index, result) for index, result in enumerate(results)]
    body: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion" if parsed.is_chat else "text_completion",
        "created": created,
        "model": parsed.model,
        "choices": choices,
        "usage": usage_body([r.usage for r in results if r.usage is not None]),
        "system_fingerprint": None,
    }
    if parsed.is_chat:
        body["service_tier"] = parsed.service_tier
    return body


def _choice(parsed: ParsedRequest, index: int, result: JobResult) -> dict[str, Any]:
    reason = openai_finish_reason(result.finish_reason)
    if parsed.is_chat:
        message = {"role": "assistant", "content": result.text, "refusal": None}
        return {"index": index, "message": message, "logprobs": None, "finish_reason": reason}
    return {"index": index, "text": result.text, "logprobs": None, "finish_reason": reason}
