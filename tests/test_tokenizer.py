"""Tokenizer behaviour: normalisation, unknown tokens, empty input, weights, save/load."""

from __future__ import annotations

import math
import random
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from service.engine.token_schemes import DEFAULT_SCHEME, WORDS
from service.engine.tokenizer import (
    MAX_COMBINING_RUN,
    Tokenizer,
    normalize_text,
    normalized_length_exceeds,
)


def word_tokens(text: str, scheme: str = DEFAULT_SCHEME) -> list[str]:
    return Tokenizer([], [], scheme=scheme).tokens(text)


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


# Characters normalisation treats specially: combining marks of several classes (and a
# character NFKD makes two marks), Hangul jamo that compose with what precedes them, a
# half-width voiced mark, characters that grow (U+FDFA by 18), a final-sigma pair, astral marks
# and vowel signs, the joiner itself.
_SPECIAL = ([chr(c) for c in range(0x300, 0x370, 7)] + list("\u0316\u0323\u0f73\uff9e\uff76\u1100\u1161\u11a8\u3131"
            "\u314f\uac00\ufdfa\ufb01\u0130\u03a3\u0391 ae\u2026\u3300\u09c7\u09be\u0958\u2adc\u0344\u1e08\u212b\u034f")
            + ["\U0001133e", "\U00011347", "\U0001d15e", "\U0001d165", "\U0001f600"])


def test_the_normalised_length_limit_is_the_length_the_tokenizer_reads() -> None:
    rng = random.Random(0)
    for _ in range(1000):
        length = rng.randint(1, 1500) if rng.random() < 0.2 else rng.randint(1, 30)
        text = "".join(rng.choice(_SPECIAL) for _ in range(length))
        normalized = normalize_text(text)
        assert normalized_length_exceeds(text, len(normalized) - 1), repr(text[:60])
        assert normalized_length_exceeds(text, len(normalized) // 2)
        # Within the limit, the form it kept (normalised in pieces) is the one the tokenizer reads.
        assert not normalized_length_exceeds(text, len(normalized))
        assert normalize_text(text) == normalized


def test_ordinary_text_normalises_as_nfkc_lowercased() -> None:
    for text in ["Ｆｕｌｌ－ｗｉｄｔｈ ＡＢＣ", "ﬁnance ½ …", "Ἀθῆναι ΟΔΟΣ", "e\u0301te\u0301", "한국어 ㄱㅏ",
                 "ｶﾞｷﾞ", "İstanbul", "Zalgo: " + "a" + "\u0301\u0316" * 15]:
        assert normalize_text(text) == unicodedata.normalize("NFKC", text).lower()


def test_a_long_run_of_combining_marks_is_cut_every_30_as_unicode_stream_safe_text() -> None:
    # NFKC sorts a run of marks by class with an insertion sort: a run of 2,000 in descending
    # class was quadratic. A joiner after every 30 bounds the sort; the words are the same.
    text = "word e" + "\u0301" * 999 + "\u0316" * 1000 + " other"
    normalized = normalize_text(text)
    assert normalized.count("\u034f") == (1999 - 1) // MAX_COMBINING_RUN
    assert word_tokens(text, WORDS) == ["word", "é", "other"]
    assert [token[0] for token in word_tokens(text)] == ["w", "é", "o"]  # the marks stay with their letter
    # A run in the astral planes is cut the same way.
    astral = normalize_text("x" + "\U0001d165\U0001d167" * 40 + "\u0301")
    assert astral.count("\u034f") == 80 // MAX_COMBINING_RUN
