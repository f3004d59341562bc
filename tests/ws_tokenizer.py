"""A tiny model folder for the WebSocket gateway's token actions: a byte-level BPE
tokenizer.json trained here on a few lines, and a config.json naming its end-of-text id."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "A queue of jobs, a fleet of workers, and one stream of tokens per job.",
    "Paged attention keeps the cache in pages; prefixes are shared between jobs.",
    "Hello world! Hello tokens, hello bytes, hello pairs of bytes.",
]
EOS_TOKEN = "</s>"


def make_tokenizer_folder(folder: Path) -> Path:
    """Write tokenizer.json and config.json into ``folder``; return it."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(LINES, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    (folder / "config.json").write_text(json.dumps({"eos_token_id": eos_id}))
    return folder


def reference_ids(folder: Path, text: str) -> list[int]:
    """The ids the folder's tokenizer gives ``text``, read by a tokenizer of its own."""
    ids: list[int] = (
        Tokenizer.from_file(str(folder / "tokenizer.json"))
        .encode(text, add_special_tokens=False)
        .ids
    )
    return ids


def reference_decode(folder: Path, ids: list[int]) -> str:
    text: str = Tokenizer.from_file(str(folder / "tokenizer.json")).decode(
        ids, skip_special_tokens=False
    )
    return text
