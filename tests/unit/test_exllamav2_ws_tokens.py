"""The WebSocket gateway's tokenizer: counts and left-trims as exllamav2's server does,
from a tokenizer.json trained in the test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exlq.producer.gateways.exllamav2_ws.tokens import ModelTokenizer
from tests.ws_tokenizer import EOS_TOKEN, make_tokenizer_folder, reference_decode, reference_ids

TEXT = "The quick brown fox jumps over the lazy dog. Hello world!"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return make_tokenizer_folder(tmp_path / "model")


def test_count_is_the_number_of_ids_without_a_bos(folder: Path) -> None:
    tokenizer = ModelTokenizer.load(folder)
    expected = len(reference_ids(folder, TEXT))
    assert expected > 5
    assert tokenizer.count(TEXT) == expected
    assert tokenizer.count("") == 0


def test_keep_last_decodes_the_last_tokens(folder: Path) -> None:
    tokenizer = ModelTokenizer.load(folder)
    ids = reference_ids(folder, TEXT)
    trimmed = tokenizer.keep_last(TEXT, 4)
    assert trimmed == reference_decode(folder, ids[-4:])
    assert TEXT.endswith(trimmed) and trimmed != TEXT


def test_keep_last_returns_short_text_whole(folder: Path) -> None:
    tokenizer = ModelTokenizer.load(folder)
    count = tokenizer.count(TEXT)
    assert tokenizer.keep_last(TEXT, count) == TEXT
    assert tokenizer.keep_last(TEXT, count + 10) == TEXT
    assert tokenizer.keep_last(TEXT, 0) == ""


def test_special_tokens_survive_a_trim(folder: Path) -> None:
    tokenizer = ModelTokenizer.load(folder)
    text = f"Hello world!{EOS_TOKEN}"
    assert tokenizer.keep_last(text, 1) == EOS_TOKEN


def test_eos_ids_come_from_the_model_folder(folder: Path) -> None:
    (eos_id,) = reference_ids(folder, EOS_TOKEN)
    assert ModelTokenizer.load(folder).eos_ids == {eos_id}
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert ModelTokenizer.load(folder).eos_ids == {7, 9}


def test_a_folder_without_eos_id_has_none(folder: Path) -> None:
    (folder / "config.json").write_text("{}")
    assert ModelTokenizer.load(folder).eos_ids == frozenset()


def test_a_folder_without_tokenizer_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        ModelTokenizer.load(tmp_path)


def test_a_bad_tokenizer_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a tokenizer"):
        ModelTokenizer.load(tmp_path)
