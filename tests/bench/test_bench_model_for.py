"""bench's model argument: a model directory (an EXL2 conversion) is run as it is and named by
its folder; a preset shape is written as a random-weight checkpoint (on the GPU machine, where
its tokenizer library is)."""

from pathlib import Path

import pytest

from bench.make_checkpoint import model_for


def test_a_model_directory_is_used_as_it_is_and_named_by_its_folder(tmp_path: Path) -> None:
    converted = tmp_path / "llama-8b-exl2-4.0bpw"
    converted.mkdir()
    (converted / "config.json").write_text("{}")
    models = tmp_path / "models"
    model, name = model_for(str(converted), models)
    assert (model, name) == (converted, "llama-8b-exl2-4.0bpw")
    assert not models.exists()  # nothing written


def test_a_name_that_is_neither_says_which_shapes_there_are(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown shape '9b'.*'1b'"):
        model_for("9b", tmp_path)
