"""The fields of exllamav2's requests, validated, and an infer's fields as exlq's submit.

Types are strict (a string is not a number, 1 is not true); a float field takes an integer,
as JSON does not tell them apart. Keys exllamav2's server does not read are ignored, as it
ignores them, so that a client written for it works unchanged. Absent sampling settings
take exllamav2's server's defaults, so a client that leaves them out samples as it did.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

T = TypeVar("T")
_STRICT = ConfigDict(extra="ignore", strict=True, frozen=True, allow_inf_nan=False)


class UnsupportedSetting(ValueError):
    """An exllamav2 setting exlq has no equivalent of, set to something other than off."""


class TextRequest(BaseModel):
    """estimate_token."""

    model_config = _STRICT
    text: str


class TrimRequest(BaseModel):
    """lefttrim_token: keep the last ``trimmed_length`` tokens of ``text``."""

    model_config = _STRICT
    text: str
    trimmed_length: int = Field(ge=0)


class InferRequest(BaseModel):
    """infer; the defaults are those of exllamav2 0.3.2's server."""

    model_config = _STRICT
    text: str
    max_new_tokens: int
    stream: bool
    stream_full: bool = False
    top_p: float = 0.8
    top_k: int = 100
    top_a: float = 0.0
    min_p: float = 0.0
    typical: float = 0.0
    temperature: float = 0.9
    skew: float = 0.0
    rep_pen: float = Field(
        1.05, validation_alias=AliasChoices("rep_pen", "token_repetition_penalty")
    )
    freq_pen: float = 0.0
    pres_pen: float = 0.0
    custom_bos: str = Field("", validation_alias="customBos")
    stop_conditions: list[str | int] | str | int = Field(default_factory=list)
    token_healing: bool = False
    bann_bann: list[int] | int = Field(default_factory=list)

    @property
    def util_text(self) -> str:
        """The context the model sees. exllamav2 trims it to its max_seq_len; exlq does not
        (a worker refuses a prompt too long for its model), so it is the whole prompt."""
        return self.custom_bos + self.text

    def submit_fields(self, eos_ids: frozenset[int]) -> dict[str, Any]:
        """Keyword arguments of AsyncProducer.submit; the SDK checks their ranges.
        ``eos_ids``: the model's end-of-text ids, the only ones ``bann_bann`` may hold."""
        self._refuse_unsupported()
        stops = _as_list(self.stop_conditions)
        return {
            "prompt": self.util_text,
            "max_new_tokens": self.max_new_tokens,
            "sampling": self._sampling(),
            "stop": [s for s in stops if isinstance(s, str)],
            "stop_token_ids": [s for s in stops if isinstance(s, int)],
            "ignore_eos": self._bans_eos(eos_ids),
        }

    def _sampling(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            # exllamav2 turns top-p and typical off with 0; exlq with 1.
            "top_p": self.top_p or 1.0,
            "typical": self.typical or 1.0,
            "min_p": self.min_p,
            "repetition_penalty": self.rep_pen,
            "frequency_penalty": self.freq_pen,
            "presence_penalty": self.pres_pen,
        }

    def _refuse_unsupported(self) -> None:
        if self.top_a:
            raise UnsupportedSetting("top_a: exlq has no top-A sampling; send 0 or leave it out")
        if self.skew:
            raise UnsupportedSetting("skew: exlq has no skew sampling; send 0 or leave it out")
        if self.token_healing:
            raise UnsupportedSetting(
                "token_healing: exlq does not heal tokens; send false or leave it out"
            )

    def _bans_eos(self, eos_ids: frozenset[int]) -> bool:
        """Whether bann_bann asks to ban the end-of-text token (exlq: ignore_eos). exlq bans
        strings, not token ids, so any other id is refused."""
        banned = set(_as_list(self.bann_bann))
        if not banned:
            return False
        if eos_ids and banned <= eos_ids:
            return True
        known = (
            f"the model's end-of-text ids are {sorted(eos_ids)}"
            if eos_ids
            else ("pass --tokenizer with a folder whose config.json names eos_token_id")
        )
        raise UnsupportedSetting(
            f"bann_bann: exlq can ban only the end-of-text token ({known}); got {sorted(banned)}"
        )


def _as_list(value: list[T] | T) -> list[T]:
    # exllamav2 takes a single stop condition or banned id where a list is expected.
    return value if isinstance(value, list) else [value]
