"""A request's prompt as exllamav2's and exllamav3's generators take it: int64 token ids on
the CPU, shape (1, tokens). Their tokenizers encode alike (``encode(text, add_bos=...,
encode_special_tokens=...)``); torch and numpy are imported by the caller's engine."""

from __future__ import annotations

import array
from typing import Any

from exlq.protocol.models import InvalidRequest
from exlq.worker.engines.chat_template import ChatFormatter
from exlq.worker.engines.engine_request import EngineRequest, pack_ids


def prompt_tensor(
    request: EngineRequest, tokenizer: Any, chat: ChatFormatter, vocab_size: int
) -> Any:
    """The request's prompt: its token ids (checked against the vocabulary), its chat
    messages through the model's template, or its text after a BOS. InvalidRequest for an
    id outside the vocabulary."""
    if request.prompt_ids is not None:
        import numpy
        import torch

        # A uint32 array (a PackedRequest's ids already are one) is read through numpy
        # without a copy, checked there and copied once into the int64 tensor: cheaper than
        # Python's max() over the ids and torch's frombuffer() on an int64 array, though
        # that wraps without a copy.
        packed = pack_ids(request.prompt_ids)
        ids = (
            numpy.frombuffer(packed, dtype=numpy.uint32)
            if isinstance(packed, array.array)
            else None  # an id past 32 bits
        )
        if ids is None or not len(ids) or ids.max() >= vocab_size:
            raise InvalidRequest(
                "the prompt's token ids (input_ids or input_ids_b64) hold an id outside "
                f"the vocabulary (0..{vocab_size - 1})"
            )
        return torch.from_numpy(ids.astype(numpy.int64).reshape(1, -1))
    if request.messages is not None:
        # The template writes the special tokens (a BOS where the model wants one).
        text = chat.render(request.messages)
        return tokenizer.encode(text, add_bos=False, encode_special_tokens=True)
    return tokenizer.encode(request.prompt or "", add_bos=True)
