"""The tokenizer contract: text -> (token ids, TF-IDF weights).

This is the single definition used by training, export, evaluation and serving, so a
document is tokenised the same way wherever it is seen.
"""

from __future__ import annotations

import array
import functools
import json
import math
import re
import threading
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import compress
from pathlib import Path
from typing import NamedTuple

import numpy as np
import orjson

from service.engine.token_schemes import (
    DEFAULT_SCHEME,
    SCHEME_PATTERNS,
    char_class,
    load_scheme_tables,
    scheme_of_pattern,
    splitter,
)

TOKENIZER_FORMAT = 1
# Id 0 is padding: it has weight 0 in every padded batch, so its embedding row never counts.
PAD_ID = 0


def normalize_text(text: str) -> str:
    """NFKC-normalise and lower-case, so full-width and composed forms share tokens.

    A text not in NFKC first gets U+034F (combining grapheme joiner) after every
    MAX_COMBINING_RUN combining characters in a row, as Unicode's Stream-Safe Text Format does
    (UAX #15): NFKC sorts each run by combining class with an insertion sort (CPython), so a
    base letter and 2,000 marks in descending class took 6 ms against 60 us for 2,000 ASCII
    characters. Ordinary text has no such runs (its tokens are unchanged); the joiner is a mark, in
    a word where marks are (service.engine.token_schemes). A text in NFKC needs no sort (CPython's
    check, linear, says no to marks out of order).
    """
    if text.isascii():  # NFKC leaves ASCII as it is
        return text.lower()
    normalized = _recent.get(text)
    if normalized is not None:
        return normalized
    if unicodedata.is_normalized("NFKC", text):
        return text.lower()
    return unicodedata.normalize("NFKC", _stream_safe(text)).lower()


def normalized_length_exceeds(text: str, limit: int) -> bool:
    """Whether normalize_text(text), what the tokenizer reads, is longer than `limit` characters:
    NFKC can make a character up to 18 (U+FDFA). Costs a scan for a text in NFKC already, else
    about the limit's worth of normalisation however long the text grows (counting stops past
    the limit). The normalised form of a text within the limit is kept for normalize_text
    (RECENT_NORMALIZED texts): the service checks a request's texts before its engine call."""
    if text.isascii():  # every request's text: no copy (lower() keeps an ASCII text's length)
        return len(text) > limit
    if unicodedata.is_normalized("NFKC", text):
        return len(text.lower()) > limit  # only U+0130 grows under lower()
    safe = _stream_safe(text)
    tables = _unicode_tables()
    # len(normalize_text) <= len(NFKD): composition only shortens, and lower() lengthens only
    # U+0130, which NFKD makes two characters.
    if len(safe) <= limit and tables.growing.search(safe) is None:
        normalized = unicodedata.normalize("NFKC", safe).lower()  # as long as `safe` at most
        _remember(text, normalized)
        return len(normalized) > limit
    pieces, total, start = [], 0, 0
    while start < len(safe):
        # Pieces split before a character that no normalisation joins to what precedes it, so
        # they normalise as the whole does.
        found = tables.split_point.search(safe, start + _LENGTH_PIECE)
        end = found.start() if found else len(safe)
        pieces.append(unicodedata.normalize("NFKC", safe[start:end]))
        total += len(pieces[-1].lower())
        if total > limit:
            return True
        start = end
    _remember(text, "".join(pieces).lower())
    return False


# Combining characters in a row that NFKC sorts as given; past it, a joiner (normalize_text).
MAX_COMBINING_RUN = 30
_JOINER = "\u034f"
_JOINED = "\\g<0>\u034f"  # a run's match, then the joiner
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")
_LENGTH_PIECE = 256  # characters normalised at once by normalized_length_exceeds
# Texts whose normalised form normalized_length_exceeds keeps (at most 256 x 6,000 characters
# under the service's default limits): a request's texts are checked before its engine call.
RECENT_NORMALIZED = 256
_recent: dict[str, str] = {}
_recent_lock = threading.Lock()


def _remember(text: str, normalized: str) -> None:
    with _recent_lock:
        _recent[text] = normalized
        if len(_recent) > RECENT_NORMALIZED:
            del _recent[next(iter(_recent))]


class _UnicodeTables(NamedTuple):
    combining: frozenset[str]  # characters that NFKD makes combining characters only
    # A run of more than MAX_COMBINING_RUN of them: in the BMP (matched from a run's start, so a
    # search is linear), and anywhere (every astral character taken as one, checked after).
    bmp_long_run: re.Pattern[str]
    long_run: re.Pattern[str]
    bmp_run: re.Pattern[str]  # MAX_COMBINING_RUN of them in the BMP, followed by another
    split_point: re.Pattern[str]  # a character no normalisation joins to the one before it
    growing: re.Pattern[str]  # a character NFKD makes several (every astral one is taken as such)


def load_unicode_tables() -> None:
    """Build the tables normalize_text and the token schemes need for text not in NFKC or not
    ASCII now (~0.5 s, once a process), so that the first such text does not wait for them: the
    service calls it as it starts."""
    _unicode_tables()
    load_scheme_tables()


@functools.cache
def _unicode_tables() -> _UnicodeTables:
    """The character classes of normalize_text and normalized_length_exceeds, from the running
    Python's unicodedata (the Unicode version its NFKC follows), built once a process (~0.25 s).

    The regular expressions name BMP characters only and take every astral character as a
    candidate (re tests an astral range by range, ~200 ns a character against ~3 ns for a BMP
    bitmap): an astral character is never a split point, and a run of them is checked one
    character at a time."""
    # No list of every code point's values (+18 MiB at the peak of every process that builds
    # these): the classes in bytes, the few thousand decompositions by code point.
    everything = range(0x110000)
    combining_class = bytes(map(unicodedata.combining, map(chr, everything)))
    decompositions = {cp: unicodedata.decomposition(chr(cp))
                      for cp in compress(everything, map(unicodedata.decomposition, map(chr, everything)))}
    # Characters that canonical composition joins to the one before them: the second of every
    # two-character canonical decomposition, and Hangul's vowel and final jamo.
    joins_back = {chr(int(d.split()[1], 16)) for d in decompositions.values() if d[0] != "<" and len(d.split()) == 2}
    joins_back.update(map(chr, range(0x1161, 0x1176)), map(chr, range(0x11A8, 0x11C3)))
    combining, unsafe, growing = set(), set(), set()
    # Other characters are starters of their own: not combining, unsafe only if they join back.
    for cp in sorted(decompositions.keys() | set(compress(everything, combining_class))):
        char = chr(cp)
        nfkd = unicodedata.normalize("NFKD", char) if cp in decompositions else char
        if all(combining_class[ord(c)] for c in nfkd):
            combining.add(char)
        if combining_class[ord(nfkd[0])] or nfkd[0] in joins_back:
            unsafe.add(char)
        if len(nfkd) > 1:
            growing.add(char)
    unsafe.update(c for c in joins_back if ord(c) <= 0xFFFF)
    unsafe = {c for c in unsafe if ord(c) <= 0xFFFF}  # every astral character is unsafe (below)
    bmp = char_class(c for c in combining if ord(c) <= 0xFFFF)
    anywhere = f"{bmp}\U00010000-\U0010ffff"
    return _UnicodeTables(
        frozenset(combining),
        re.compile(f"(?<![{bmp}])[{bmp}]{{{MAX_COMBINING_RUN + 1}}}"),
        re.compile(f"(?<![{anywhere}])[{anywhere}]{{{MAX_COMBINING_RUN + 1}}}"),
        re.compile(f"[{bmp}]{{{MAX_COMBINING_RUN}}}(?=[{bmp}])"),
        re.compile(f"[^{char_class(unsafe)}\U00010000-\U0010ffff]"),
        re.compile(f"[{char_class(c for c in growing if ord(c) <= 0xFFFF)}\U00010000-\U0010ffff]"),
    )


def is_blank_char(char: str) -> bool:
    """A character that shows a reader nothing and gives the tokenizer no word: Unicode whitespace
    (U+00A0, U+3000, ...), a control (Cc: NUL, ...) or a format character (Cf: U+200B, the BOM,
    bidi marks, ...). The one definition of blank: is_blank and the API's NON_BLANK."""
    return char.isspace() or unicodedata.category(char) in ("Cc", "Cf")


def is_blank(text: str) -> bool:
    """True for a text of blank characters only (is_blank_char), or none."""
    return all(map(is_blank_char, text))


# Where Unicode assigns blank characters: the BMP, plane 1 and the tags of plane 14.
_BLANK_PLANES = (range(0x20000), range(0xE0000, 0xE1000))


def non_blank_pattern() -> str:
    """A regular expression that finds a character that is not blank (is_blank_char): the same in
    Python's re, the Rust regex pydantic validates with and a JSON Schema (ECMA-262) client,
    BMP characters written as \\uXXXX, astral ones as themselves."""
    parts = []
    for plane in _BLANK_PLANES:
        points = [cp for cp in plane if is_blank_char(chr(cp))]
        starts = [cp for i, cp in enumerate(points) if i == 0 or points[i - 1] != cp - 1]
        ends = [cp for i, cp in enumerate(points) if i == len(points) - 1 or points[i + 1] != cp + 1]
        for first, last in zip(starts, ends, strict=True):
            one = (lambda cp: f"\\u{cp:04X}") if first <= 0xFFFF else chr
            parts.append(one(first) + (f"-{one(last)}" if last > first else ""))
    return f"[^{''.join(parts)}]"


def _stream_safe(text: str) -> str:
    """`text` with a joiner after every MAX_COMBINING_RUN combining characters in a row."""
    tables = _unicode_tables()
    if _ASTRAL.search(text) is None:
        if tables.bmp_long_run.search(text) is None:
            return text
        return tables.bmp_run.sub(_JOINED, text)
    if tables.long_run.search(text) is None:
        return text
    out, run = [], 0  # astral characters: the same rule, one character at a time
    for char in text:
        if char in tables.combining:
            if run == MAX_COMBINING_RUN:
                out.append(_JOINER)
                run = 0
            run += 1
        else:
            run = 0
        out.append(char)
    return "".join(out)


class Tokenizer:
    """Word tokens with TF-IDF weights over a fixed vocabulary.

    Unknown tokens are dropped; a text with no known token encodes to an empty list,
    which the encoder maps to the zero vector (a valid input, not an error). `scheme` says how a
    normalised text splits into tokens (service.engine.token_schemes); it is saved with the
    vocabulary, so a tokenizer reads texts as it did when it was fitted.
    """

    def __init__(self, vocab: Sequence[str], idf: Sequence[float], max_tokens: int = 64,
                 scheme: str = DEFAULT_SCHEME) -> None:
        self.scheme = scheme
        self._split = splitter(scheme)
        if len(vocab) != len(idf):
            raise ValueError(f"vocab has {len(vocab)} tokens but idf has {len(idf)} values")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        # Tuples for the same reason as LabelTable's: untracked by the cyclic GC.
        self.vocab: tuple[str, ...] = tuple(vocab)
        self.idf = np.asarray(idf, dtype=np.float32)
        self.max_tokens = int(max_tokens)
        # ids are 1-based: PAD_ID = 0 is reserved.
        self._index: dict[str, int] = {tok: i + 1 for i, tok in enumerate(self.vocab)}
        # array.array, not a tuple of floats: 8 bytes an entry instead of 32 (each serving
        # process holds its own), and indexing it gives a Python float as fast.
        self._idf_by_id = array.array("d", (0.0, *self.idf.tolist()))

    @property
    def vocab_size(self) -> int:
        """Number of embedding rows the encoder needs (vocabulary plus the padding row)."""
        return len(self.vocab) + 1

    @classmethod
    def fit(
        cls,
        texts: Iterable[str],
        min_df: int = 1,
        max_vocab: int | None = None,
        max_tokens: int = 64,
        scheme: str = DEFAULT_SCHEME,
    ) -> Tokenizer:
        """Build the vocabulary and smoothed idf = ln((1 + n) / (1 + df)) + 1 from `texts`."""
        split = splitter(scheme)
        df: Counter[str] = Counter()
        n = 0
        for text in texts:
            df.update(set(split(normalize_text(text))))
            n += 1
        items = [(tok, c) for tok, c in df.items() if c >= min_df]
        # Most frequent first, ties broken by the token so the vocabulary is deterministic.
        items.sort(key=lambda tc: (-tc[1], tc[0]))
        if max_vocab is not None:
            items = items[:max_vocab]
        vocab = [tok for tok, _ in items]
        idf = [math.log((1 + n) / (1 + c)) + 1.0 for _, c in items]
        return cls(vocab, idf, max_tokens=max_tokens, scheme=scheme)

    def tokens(self, text: str) -> list[str]:
        """The tokens this tokenizer reads in `text` (known to its vocabulary or not), in order."""
        return list(self._split(normalize_text(text)))

    def encode(self, text: str) -> tuple[list[int], list[float]]:
        """Token ids (first-occurrence order) and their L2-normalised tf * idf weights."""
        index = self._index
        counts: dict[int, int] = {}
        for tok in self._split(normalize_text(text)):
            i = index.get(tok)
            if i is not None:
                counts[i] = counts.get(i, 0) + 1
        if not counts:
            return [], []
        idf = self._idf_by_id
        ids = list(counts)
        weights = [counts[i] * idf[i] for i in ids]
        if len(ids) > self.max_tokens:
            # Keep the most informative tokens of a long text, in their original order.
            keep = sorted(sorted(range(len(ids)), key=lambda j: -weights[j])[: self.max_tokens])
            ids = [ids[j] for j in keep]
            weights = [weights[j] for j in keep]
        norm = math.sqrt(sum(w * w for w in weights))
        return ids, [w / norm for w in weights]

    def encode_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Padded int64 ids and float32 weights, both [len(texts), T] with T >= 1."""
        if len(texts) == 1:  # the single-query path: one array each, nothing to pad
            tok_ids, tok_w = self.encode(texts[0])
            return np.array([tok_ids or [PAD_ID]], dtype=np.int64), np.array([tok_w or [0.0]], dtype=np.float32)
        encoded = [self.encode(t) for t in texts]
        width = max(1, max((len(ids) for ids, _ in encoded), default=1))
        ids = np.zeros((len(texts), width), dtype=np.int64)
        weights = np.zeros((len(texts), width), dtype=np.float32)
        for row, (tok_ids, tok_w) in enumerate(encoded):
            ids[row, : len(tok_ids)] = tok_ids
            weights[row, : len(tok_w)] = tok_w
        return ids, weights

    def to_dict(self) -> dict:
        return {
            "format": TOKENIZER_FORMAT,
            "normalization": "NFKC+lower",
            "token_pattern": SCHEME_PATTERNS[self.scheme],
            "max_tokens": self.max_tokens,
            "vocab": self.vocab,
            "idf": [float(x) for x in self.idf],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), ensure_ascii=False), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        try:
            # orjson: bundles load beside live traffic, and one json.loads of this file held
            # the GIL for ~10 ms on debian-deps (37K tokens); orjson takes ~2.5 ms.
            data = orjson.loads(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot read tokenizer: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a tokenizer is a JSON object")
        if data.get("format") != TOKENIZER_FORMAT:
            raise ValueError(f"{path}: tokenizer format {data.get('format')!r}, expected {TOKENIZER_FORMAT}")
        try:
            scheme = scheme_of_pattern(data.get("token_pattern"))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        try:
            tokenizer = cls(data["vocab"], data["idf"], max_tokens=data.get("max_tokens", 64), scheme=scheme)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: bad tokenizer: {exc!r}") from exc
        if not all(isinstance(token, str) for token in tokenizer.vocab):
            raise ValueError(f"{path}: vocabulary entries must be strings")
        if not (np.isfinite(tokenizer.idf).all() and (tokenizer.idf >= 0).all()):
            raise ValueError(f"{path}: idf values must be finite and >= 0")
        return tokenizer
