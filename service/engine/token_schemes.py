"""How a normalised text splits into tokens: a tokenizer's scheme, saved with it (its
`token_pattern` field), so a bundle tokenizes as it was trained whatever the code's default.

- "words" (`\\w+`, every bundle trained before schemes existed): runs of word characters.
  Combining marks are not word characters, so a word of a script written with vowel signs
  (Devanagari, Thai, Bengali, Tamil, ...) broke into pieces at every sign, and a script written
  without spaces (Chinese, Japanese, Thai, ...) made a whole sentence one token: a query shared
  no token with any document unless the two sentences were the same.
- "unicode-words" (the default): runs of word characters and the combining marks that go with
  them; inside a run, characters of scripts written without spaces become overlapping pairs of
  characters (a character with its marks), a lone one itself, as Lucene's CJK bigrams do;
  the rest of the run stays one word ("iphone手机壳" -> "iphone", "手机", "机壳"). ASCII text
  (and any text without marks or such scripts) splits exactly as under "words".
"""

from __future__ import annotations

import functools
import operator
import re
import unicodedata
from collections.abc import Callable, Iterable
from typing import NamedTuple

WORDS = "words"
UNICODE_WORDS = "unicode-words"
DEFAULT_SCHEME = UNICODE_WORDS
# What a tokenizer file's `token_pattern` says for each scheme ("words" is its regular
# expression, as bundles before schemes wrote it; code that knows only that one refuses the rest).
SCHEME_PATTERNS = {WORDS: r"\w+", UNICODE_WORDS: "unicode-words-1"}

# Scripts written without spaces between words (Unicode blocks): Thai, Lao, Myanmar, Khmer,
# Hiragana, Katakana (and its extension and half-width forms), CJK ideographs (every extension,
# the compatibility ones). Hangul is written with spaces: its words stay words.
_NO_SPACE_BLOCKS = (
    (0x0E00, 0x0EFF), (0x1000, 0x109F), (0x1780, 0x17FF), (0x3040, 0x30FF), (0x31F0, 0x31FF),
    (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0xFF66, 0xFF9F), (0x20000, 0x3134F),
)
_ASCII_WORD = re.compile(r"\w+")


class _Classes(NamedTuple):
    special: re.Pattern[str]  # a mark, a character of a script without spaces, or an astral one
    word: re.Pattern[str]  # a run of word characters and combining marks
    no_space: re.Pattern[str]  # a character of a script written without spaces
    mark: re.Pattern[str]  # a combining mark
    parts: re.Pattern[str]  # a run's parts: such characters (with their marks), or the rest
    unit: re.Pattern[str]  # one such character with its marks


@functools.cache
def _classes() -> _Classes:
    """Built once a process from the running Python's unicodedata (~0.3 s; the service builds it
    as it starts, with the other Unicode tables).

    A character class is tested item by item, and its astral ranges cost every character that
    fails the items before them: the marks of the astral planes are tested only for astral
    characters (a lookbehind), and a text with no `special` character (most non-ASCII text:
    accented Latin, Cyrillic, Greek after NFKC) is split by `\\w+` alone, as under "words"."""
    marks = [chr(cp) for cp in range(0x110000) if unicodedata.category(chr(cp))[0] == "M"]
    bmp_marks = char_class(m for m in marks if ord(m) <= 0xFFFF)
    astral_marks = char_class(m for m in marks if ord(m) > 0xFFFF)
    # The blocks' marks are marks: they go with the character before them, of any script.
    no_space = char_class(chr(cp) for lo, hi in _NO_SPACE_BLOCKS for cp in range(lo, hi + 1)
                          if unicodedata.category(chr(cp))[0] != "M")
    mark = f"(?:[{bmp_marks}]|[\U00010000-\U0010ffff](?<=[{astral_marks}]))"
    return _Classes(
        re.compile(f"[{bmp_marks}{no_space}\U00010000-\U0010ffff]"),
        re.compile(f"(?:\\w|{mark})+"),
        re.compile(f"[{no_space}]"),
        re.compile(mark),
        re.compile(f"(?:[{no_space}]{mark}*)+|[^{no_space}]+"),
        re.compile(f"[{no_space}]{mark}*"),
    )


def char_class(chars: Iterable[str]) -> str:
    """A regular expression character class's body matching exactly `chars`, as ranges."""
    points = sorted(set(map(ord, chars)))
    parts, i = [], 0
    while i < len(points):
        j = i
        while j + 1 < len(points) and points[j + 1] == points[j] + 1:
            j += 1
        parts.append(re.escape(chr(points[i])) + (f"-{re.escape(chr(points[j]))}" if j > i else ""))
        i = j + 1
    return "".join(parts)


def load_scheme_tables() -> None:
    """Build the character classes now, so that the first non-ASCII text does not wait for them."""
    _classes()


def _words(text: str) -> list[str]:
    return _ASCII_WORD.findall(text)


def _unicode_words(text: str) -> list[str]:
    if text.isascii():
        return _ASCII_WORD.findall(text)
    classes = _classes()
    if classes.special.search(text) is None:
        return _ASCII_WORD.findall(text)
    runs = classes.word.findall(text)
    if classes.no_space.search(text) is None:
        return runs
    tokens: list[str] = []
    for run in runs:
        if classes.no_space.search(run) is None:
            tokens.append(run)
            continue
        for part in classes.parts.findall(run):
            if classes.no_space.match(part) is None:
                tokens.append(part)
                continue
            # Characters without marks (Chinese, Japanese): pairs of the part's characters, not
            # of matches (a third of the time on a 6,000-character text).
            units = part if classes.mark.search(part) is None else classes.unit.findall(part)
            tokens.extend([part] if len(units) == 1 else map(operator.add, units, units[1:]))
    return tokens


_SPLITTERS: dict[str, Callable[[str], list[str]]] = {WORDS: _words, UNICODE_WORDS: _unicode_words}


def splitter(scheme: str) -> Callable[[str], list[str]]:
    """The function that splits a normalised text into tokens under `scheme` (ValueError naming
    the known schemes otherwise)."""
    try:
        return _SPLITTERS[scheme]
    except KeyError:
        raise ValueError(f"unknown token scheme {scheme!r}; known: {', '.join(_SPLITTERS)}") from None


def scheme_of_pattern(pattern: object) -> str:
    """The scheme a tokenizer file's `token_pattern` names (ValueError if none)."""
    for scheme, known in SCHEME_PATTERNS.items():
        if pattern == known:
            return scheme
    raise ValueError(f"tokenizer was built with another token pattern ({pattern!r}); this version reads "
                     f"{', '.join(repr(p) for p in SCHEME_PATTERNS.values())}")
