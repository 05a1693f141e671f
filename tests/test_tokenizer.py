"""Tokenizer behaviour: normalisation, unknown tokens, empty input, weights, save/load."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from service.engine.tokenizer import Tokenizer, word_tokens


@pytest.fixture()
def tok() -> Tokenizer:
    return Tokenizer.fit(["Café au lait", "the cafe menu", "the menu of the day", "ｆｕｌｌ width"])


def test_normalisation_lowercases_and_nfkc() -> None:
    assert word_tokens("Ｆｕｌｌ-Width CAFÉ") == ["full", "width", "café"]


def test_unknown_tokens_are_dropped(tok: Tokenizer) -> None:
    ids, _ = tok.encode("menu zebra quux")
    assert ids == tok.encode("menu")[0]
    assert len(ids) == 1


def test_empty_and_all_unknown_give_empty(tok: Tokenizer) -> None:
    assert tok.encode("") == ([], [])
    assert tok.encode("zebra quux !!!") == ([], [])
    ids, weights = tok.encode_batch(["", "zebra"])
    assert ids.shape == (2, 1) and not ids.any() and not weights.any()


def test_weights_are_unit_norm_and_idf_ordered(tok: Tokenizer) -> None:
    ids, weights = tok.encode("the day")
    assert math.isclose(sum(w * w for w in weights), 1.0, rel_tol=1e-6)
    # "day" is rarer than "the", so it weighs more.
    by_token = {tok.vocab[i - 1]: w for i, w in zip(ids, weights, strict=True)}
    assert by_token["day"] > by_token["the"]


def test_same_text_same_encoding_and_case_insensitive(tok: Tokenizer) -> None:
    assert tok.encode("THE MENU") == tok.encode("the menu")


def test_batch_is_padded_with_zero(tok: Tokenizer) -> None:
    ids, weights = tok.encode_batch(["the menu of the day", "menu"])
    assert ids.dtype == np.int64 and weights.dtype == np.float32
    assert ids.shape[0] == 2 and ids[1, 1:].sum() == 0 and weights[1, 1:].sum() == 0
    assert 0 not in tok.encode("menu")[0]  # id 0 is padding only


def test_max_tokens_keeps_most_informative() -> None:
    tok = Tokenizer.fit(["a b c d", "a b", "a"], max_tokens=2)
    ids, _ = tok.encode("a b c d")
    assert len(ids) == 2
    assert {tok.vocab[i - 1] for i in ids} == {"c", "d"}


def test_save_load_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path / "tok.json")
    back = Tokenizer.load(tmp_path / "tok.json")
    assert back.vocab == tok.vocab and back.vocab_size == tok.vocab_size
    for text in ["café menu", "the day", "nothing known"]:
        assert back.encode(text) == tok.encode(text)


def test_load_bad_file_names_it(tmp_path: Path) -> None:
    bad = tmp_path / "tok.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="tok.json"):
        Tokenizer.load(bad)


def test_one_text_batches_exactly_like_a_row_of_a_larger_batch() -> None:
    tok = Tokenizer.fit(["the menu of the day", "menu", "day light"])
    texts = ["the menu of the day", "menu", "", "zebra", "day day menu"]
    ids, weights = tok.encode_batch(texts)
    for row, text in enumerate(texts):
        one_ids, one_w = tok.encode_batch([text])
        assert one_ids.dtype == np.int64 and one_w.dtype == np.float32 and one_ids.shape == one_w.shape
        width = max(1, len(tok.encode(text)[0]))
        assert one_ids.shape == (1, width)
        np.testing.assert_array_equal(one_ids[0], ids[row, :width])
        np.testing.assert_array_equal(one_w[0], weights[row, :width])
        assert not ids[row, width:].any()
