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
import itertools
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
    parts: re.Pattern[str]  # a run's parts: such characters (with their marks), or the rest
    # Inside a part of such characters, every other character is a mark:
    mark: re.Pattern[str]  # a mark in such a part
    unit: re.Pattern[str]  # one character of such a part with its marks


@functools.cache
def _classes() -> _Classes:
    """Built once a process from the running Python's unicodedata (~0.3 s; the service builds it
    as it starts, with the other Unicode tables).

    Every repeated item is one character class: re keeps a backtracking record for each repeat
    of a group (an alternation repeated over a 2-million-character run took 300 MB), none for a
    class. A class is tested item by item, and its astral ranges cost every character that fails
    the items before them: a text with no `special` character (most non-ASCII text: accented
    Latin, Cyrillic, Greek after NFKC) is split by `\\w+` alone, as under "words"."""
    marks = [chr(cp) for cp in range(0x110000) if unicodedata.category(chr(cp))[0] == "M"]
    bmp_marks = char_class(m for m in marks if ord(m) <= 0xFFFF)
    all_marks = char_class(marks)
    # The blocks' marks are marks: they go with the character before them, of any script.
    no_space = char_class(chr(cp) for lo, hi in _NO_SPACE_BLOCKS for cp in range(lo, hi + 1)
                          if unicodedata.category(chr(cp))[0] != "M")
    return _Classes(
        re.compile(f"[{bmp_marks}{no_space}\U00010000-\U0010ffff]"),
        re.compile(f"[\\w{all_marks}]+"),
        re.compile(f"[{no_space}]"),
        re.compile(f"[{no_space}][{no_space}{all_marks}]*|[^{no_space}]+"),
        re.compile(f"[^{no_space}]"),
        re.compile(f"[{no_space}][^{no_space}]*"),
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


def _unicode_words(text: str) -> Iterable[str]:
    if text.isascii():
        return _ASCII_WORD.findall(text)
    classes = _classes()
    if classes.special.search(text) is None:
        return _ASCII_WORD.findall(text)
    runs = classes.word.findall(text)
    if classes.no_space.search(text) is None:
        return runs
    # Lazily: a text of n such characters makes n - 1 new strings, which a reader counts one at
    # a time (a list of them was ~80 bytes a character: 5 GB for a 64 Mi-character line).
    return itertools.chain.from_iterable(_run_tokens(run, classes) for run in runs)


def _run_tokens(run: str, classes: _Classes) -> Iterable[str]:
    if classes.no_space.search(run) is None:
        return (run,)
    return itertools.chain.from_iterable(
        (part,) if classes.no_space.match(part) is None else _pairs(part, classes)
        for part in classes.parts.findall(run))


def _pairs(part: str, classes: _Classes) -> Iterable[str]:
    """Overlapping pairs of the part's characters (each with its marks), or the one character."""
    if classes.unit.fullmatch(part):
        return (part,)
    if classes.mark.search(part) is None:  # Chinese, Japanese: the characters themselves
        return map(operator.add, part, part[1:])
    units = map(re.Match.group, classes.unit.finditer(part))
    return itertools.starmap(operator.add, itertools.pairwise(units))


_SPLITTERS: dict[str, Callable[[str], Iterable[str]]] = {WORDS: _words, UNICODE_WORDS: _unicode_words}


def splitter(scheme: str) -> Callable[[str], Iterable[str]]:
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
    raise ValueError(f"tokenizer was built with another token pattern ({str(pattern)[:80]!r}); this version reads "
                     f"{', '.join(repr(p) for p in SCHEME_PATTERNS.values())}")
