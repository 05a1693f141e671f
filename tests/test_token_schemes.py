"""How texts split into tokens (service.engine.token_schemes): scripts written without spaces
and words with vowel signs are read as words, not as whole sentences or broken pieces; every
other text splits as bundles trained before schemes split it; a tokenizer keeps its scheme."""

from __future__ import annotations

import gzip
import json
import random
import unicodedata
from pathlib import Path

import pytest

from model_export.evaluate import evaluate_bundle
from model_export.export import export_checkpoint
from service.engine.token_schemes import UNICODE_WORDS, WORDS
from service.engine.tokenizer import Tokenizer
from training.config import TrainConfig
from training.pipeline import train
from training.synthetic import _SYLLABLES


def _tokens(text: str, scheme: str = UNICODE_WORDS) -> list[str]:
    return Tokenizer([], [], scheme=scheme).tokens(text)


def test_text_without_marks_or_spaceless_scripts_splits_as_before() -> None:
    """ASCII, accented Latin (composed by NFKC), Greek, Cyrillic, Hangul, digits and punctuation:
    the same tokens under both schemes, so bundles of such text train as they did."""
    alphabet = ("abcXYZ019_ ,.-'!?" "éèüßçñØÅ" "αβγΩ" "жыЯ" "한국어" "ｆｕｌ" "\u00a0\t\n")
    rng = random.Random(7)
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert _tokens(text) == _tokens(text, WORDS), text
    text = "Straße CAFÉ e\u0301te\u0301 Ἀθῆναι"  # decomposed accents compose under NFKC
    assert _tokens(text) == _tokens(text, WORDS) == ["straße", "café", "été", "ἀθῆναι"]


@pytest.mark.parametrize(("text", "tokens"), [
    ("网络流量监控工具", ["网络", "络流", "流量", "量监", "监控", "控工", "工具"]),
    ("ネットワーク", ["ネッ", "ット", "トワ", "ワー", "ーク"]),
    ("iPhone手机壳 case", ["iphone", "手机", "机壳", "case"]),  # the rest of a run stays a word
    ("ｶﾀｶﾅ", ["カタ", "タカ", "カナ"]),  # half-width forms: NFKC first
    ("สวัสดี", ["สวั", "วัส", "สดี"]),  # a Thai character keeps its vowel and tone marks
])
def test_scripts_written_without_spaces_split_into_pairs_of_characters(text: str, tokens: list[str]) -> None:
    assert _tokens(text) == tokens
    assert len(_tokens(text, WORDS)) < len(tokens)  # before: a run, or pieces cut at the marks


def test_a_lone_character_of_such_a_script_is_itself() -> None:
    assert _tokens("手 x 機") == ["手", "x", "機"]


def test_words_keep_their_vowel_signs_and_marks() -> None:
    assert _tokens("नेटवर्क निगरानी") == ["नेटवर्क", "निगरानी"]
    assert _tokens("नेटवर्क निगरानी", WORDS) == ["न", "टवर", "क", "न", "गर", "न"]  # cut at every sign
    # A mark of the astral planes (U+1D165) stays in its word too; a symbol (an emoji) is no word.
    assert _tokens("a\U0001d165b \U0001f600 emoji") == ["a\U0001d165b", "emoji"]
    # Every mark NFKC leaves in a text is in a word under unicode-words.
    marks = [chr(cp) for cp in range(0x110000) if unicodedata.category(chr(cp))[0] == "M"]
    assert all(_tokens("x" + m) == [unicodedata.normalize("NFKC", "x" + m).lower()] for m in marks
               if unicodedata.is_normalized("NFKC", "x" + m))


def test_a_query_finds_documents_written_without_spaces_by_their_shared_words() -> None:
    documents = ["网络流量监控工具", "图形界面文本编辑器", "音频视频播放器"]
    new = Tokenizer.fit(documents)
    old = Tokenizer.fit(documents, scheme=WORDS)
    assert len(new.encode("流量监控")[0]) == 3 and len(new.encode("文本编辑")[0]) == 3
    assert old.encode("流量监控") == ([], [])  # a whole sentence was one token: nothing shared


def test_a_tokenizer_keeps_its_scheme_and_an_old_file_its_split(tmp_path: Path) -> None:
    for scheme in (UNICODE_WORDS, WORDS):
        fitted = Tokenizer.fit(["网络流量 monitor", "नेटवर्क निगरानी"], scheme=scheme)
        fitted.save(tmp_path / f"{scheme}.json")
        loaded = Tokenizer.load(tmp_path / f"{scheme}.json")
        assert loaded.scheme == scheme and loaded.vocab == fitted.vocab
        assert loaded.encode("网络流量 नेटवर्क") == fitted.encode("网络流量 नेटवर्क")
    # The field bundles trained before schemes wrote: their tokenizer splits as it did.
    data = json.loads((tmp_path / "words.json").read_text())
    assert data["token_pattern"] == r"\w+"
    data["token_pattern"] = "bpe-2"
    (tmp_path / "other.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"other\.json: tokenizer was built with another token pattern \('bpe-2'\)"):
        Tokenizer.load(tmp_path / "other.json")


def test_the_training_config_names_an_unknown_scheme() -> None:
    with pytest.raises(ValueError, match="token_scheme must be one of"):
        TrainConfig.from_dict({"token_scheme": "bpe"})


_HAN = {syllable: chr(0x4E00 + 37 * i) for i, syllable in enumerate(_SYLLABLES)}


def _spaceless(text: str) -> str:
    """The generated words' syllables as ideographs, written without spaces (a label's content
    starts with "about", which is no syllable: it stays a word)."""
    return "".join(word if word == "about" else "".join(_HAN[word[i : i + 2]] for i in range(0, len(word), 2))
                   for word in text.split())


def _spaceless_copy(data: Path, out: Path) -> Path:
    out.mkdir()
    for name in ("trn.json.gz", "tst.json.gz", "lbl.json.gz"):
        with gzip.open(data / name, "rt") as src, gzip.open(out / name, "wt", encoding="utf-8") as dst:
            for line in src:
                row = json.loads(line)
                row["title"], row["content"] = _spaceless(row["title"]), _spaceless(row["content"])
                dst.write(json.dumps(row, ensure_ascii=False) + "\n")
    return out


def test_a_dataset_written_without_spaces_trains_and_serves_nearly_as_well_as_with_them(
        synthetic_data, bundle_root, tmp_path):
    """The tests' dataset written in ideographs without spaces: trained with the default scheme,
    the served bundle ranks nearly as well as the same data with spaces (bundle v1: same config,
    same seed); under "words" every text was one token no other text had, so training refused it."""
    spaceless = _spaceless_copy(synthetic_data, tmp_path / "spaceless")
    with pytest.raises(ValueError, match="0 documents with both a label and a token"):
        train(spaceless, TrainConfig(**{**TrainConfig.tiny().__dict__, "token_scheme": WORDS}), seed=1)
    train(spaceless, TrainConfig.tiny(), seed=1).save(tmp_path / "ckpt")
    bundle = export_checkpoint(tmp_path / "ckpt", tmp_path / "bundles", "spaceless")
    with_spaces = evaluate_bundle(bundle_root / "v1", synthetic_data)["P@1"]
    without = evaluate_bundle(bundle, spaceless)["P@1"]
    assert without >= 0.85 * with_spaces, (without, with_spaces)
