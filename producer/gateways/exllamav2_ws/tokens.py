"""The model's tokenizer, from its tokenizer.json (the `tokenizers` library: no torch, no
GPU), for estimate_token and lefttrim_token."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

# Where a model folder names its end-of-text ids, read in this order.
_EOS_SOURCES = ("generation_config.json", "config.json")


class ModelTokenizer:
    """Counts and trims text in the model's tokens, as exllamav2's server does: no BOS
    token added, special tokens kept when decoding."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self.eos_ids = eos_ids

    @classmethod
    def load(cls, folder: Path) -> ModelTokenizer:
        """Raises ValueError where the folder holds no readable tokenizer.json."""
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{folder} holds no tokenizer.json: pass the model's folder")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for a bad file
            raise ValueError(
                f"{path} is not a tokenizer the tokenizers library reads: {exc}"
            ) from None
        return cls(tokenizer, _eos_ids(folder))

    def count(self, text: str) -> int:
        return len(self._ids(text))

    def keep_last(self, text: str, tokens: int) -> str:
        """The text of the last ``tokens`` tokens of ``text``; the text itself where it has
        no more than that."""
        ids = self._ids(text)
        if len(ids) <= tokens:
            return text
        if tokens == 0:
            return ""
        decoded: str = self._tokenizer.decode(ids[-tokens:], skip_special_tokens=False)
        return decoded

    def _ids(self, text: str) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids


def _eos_ids(folder: Path) -> frozenset[int]:
    """The end-of-text ids the model folder names, if any (for bann_bann)."""
    for name in _EOS_SOURCES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (ValueError, AttributeError):
            continue
        ids = value if isinstance(value, list) else [value]
        found = frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool))
        if found:
            return found
    return frozenset()
