"""A bundle fuzzer: seeded faults written into a copy of a bundle's files, checksums recomputed,
then loaded and queried as the service would (tests/test_bundle_fuzz.py, bench/fuzz_bundles.py).

Every variant is one fault in one file. Structural faults (an id or level out of range, NaN or
Inf, a shape or dtype other than export writes, truncation, appended bytes) must be refused,
naming the file. Blind ones (flipped bits, zeroed ranges) may also be a different but sound
model: then every answer must hold label ids in range and finite scores, on every scorer path.
Nothing may crash the process: variants run in a worker process, and a worker that dies is
reported as a crash of the variant it was on.

    python -m shortlist.bundle_fuzz --bundle DIR --work DIR --seed S --start I --count N
prints one JSON line as each variant starts and one with its outcome.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from service.engine.index import _HEADER
from service.engine.schema import ENCODER, MANIFEST, BundleError, sha256_file

Mutation = Callable[[Path, np.random.Generator], None]


@dataclass(frozen=True)
class Variant:
    index: int
    file: str
    kind: str
    must_refuse: bool


# -- blind faults, any file ------------------------------------------------------------------

def _flip(path: Path, rng: np.random.Generator) -> None:
    data = bytearray(path.read_bytes())
    for _ in range(int(rng.integers(1, 4))):
        at = int(rng.integers(len(data)))
        data[at] ^= 1 << int(rng.integers(8))
    path.write_bytes(bytes(data))


def _zero(path: Path, rng: np.random.Generator) -> None:
    data = bytearray(path.read_bytes())
    width = min(len(data), int(rng.integers(8, 4096)))
    at = int(rng.integers(len(data) - width + 1))
    data[at : at + width] = bytes(width)
    path.write_bytes(bytes(data))


def _truncate(path: Path, rng: np.random.Generator) -> None:
    data = path.read_bytes()
    keep = int(rng.integers(len(data)))
    if path.suffix == ".jsonl":
        # Mid-line: a cut at a line's end (or before the first) leaves a shorter, sound file.
        while keep < 2 or b"\n" in data[keep - 1 : keep + 1]:
            keep = int(rng.integers(len(data)))
    path.write_bytes(data[:keep])


def _extend(path: Path, rng: np.random.Generator) -> None:
    path.write_bytes(path.read_bytes() + b"\x00\xff" * int(rng.integers(2, 64)))


# -- structural faults, by file kind ----------------------------------------------------------

def _npy_rewrite(change: Callable[[np.ndarray, np.random.Generator], np.ndarray]) -> Mutation:
    def mutate(path: Path, rng: np.random.Generator) -> None:
        arr = np.load(path, allow_pickle=False)
        np.save(path, change(np.array(arr), rng), allow_pickle=False)
    return mutate


def _poke(arr: np.ndarray, rng: np.random.Generator, value: float) -> np.ndarray:
    if arr.dtype.kind != "f" and not np.isfinite(value):
        arr = arr.astype(np.float32)  # int8 label vectors: NaN only fits in another dtype, refused as such
    arr.reshape(-1)[int(rng.integers(arr.size))] = value
    return arr


def _bad_id(arr: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    # token_shortlist.npy holds label ids: past the last label, or below -1 (the padding id).
    big = int(arr.max()) + 1 + int(rng.integers(0, 1 << 20))
    return _poke(arr, rng, big if rng.random() < 0.5 else -2 - int(rng.integers(0, 1000)))


NPY_FLOAT_FAULTS: dict[str, Mutation] = {
    "nan": _npy_rewrite(lambda a, rng: _poke(a, rng, np.nan)),
    "inf": _npy_rewrite(lambda a, rng: _poke(a, rng, np.inf if rng.random() < 0.5 else -np.inf)),
    "dtype": _npy_rewrite(lambda a, rng: a.astype(np.float64)),
    "shape": _npy_rewrite(lambda a, rng: a[:-1]),
}
NPY_ID_FAULTS: dict[str, Mutation] = {
    "id_out_of_range": _npy_rewrite(_bad_id),
    "dtype": _npy_rewrite(lambda a, rng: a.astype(np.int64)),
    "shape": _npy_rewrite(lambda a, rng: a[:, :-1]),
}
# classifier_scales.npy, centroid_scales.npy: float32 >= 0.
NPY_SCALE_FAULTS: dict[str, Mutation] = {
    **NPY_FLOAT_FAULTS, "negative": _npy_rewrite(lambda a, rng: _poke(a, rng, -1.0 - float(rng.random()))),
}
# labels_retired.npy: sorted distinct label ids.
RETIRED_FAULTS: dict[str, Mutation] = {
    "id_out_of_range": _npy_rewrite(_bad_id),
    "dtype": _npy_rewrite(lambda a, rng: a.astype(np.int64)),
    "shape": _npy_rewrite(lambda a, rng: a[None, :]),
    "repeated_id": _npy_rewrite(lambda a, rng: np.sort(np.r_[a, a[int(rng.integers(len(a)))]]).astype(a.dtype)),
}


_HEADER_FIELDS = ("offset_level0", "max_elements", "count", "size", "label_offset", "offset_data", "max_level",
                  "enterpoint", "max_m", "max_m0", "m", "mult", "ef_construction")


def _hnsw_edit(edit: Callable[[dict, np.ndarray, np.ndarray, np.random.Generator], None]) -> Mutation:
    """An edit of an hnswlib file in place: `edit(header, level0, tail, rng)` may change the
    header dict, the level-0 blocks (uint32 [count, words]) and the tail's uint32 words."""
    def mutate(path: Path, rng: np.random.Generator) -> None:
        raw = np.frombuffer(bytearray(path.read_bytes()), dtype=np.uint8)
        header = dict(zip(_HEADER_FIELDS, _HEADER.unpack_from(raw, 0), strict=True))
        end = _HEADER.size + header["count"] * header["size"]
        edit(header, raw[_HEADER.size : end].view("<u4").reshape(header["count"], -1), raw[end:].view("<u4"), rng)
        raw[: _HEADER.size] = np.frombuffer(_HEADER.pack(*(header[f] for f in _HEADER_FIELDS)), dtype=np.uint8)
        path.write_bytes(raw.tobytes())
    return mutate


def _upper_lists(h: dict, tail: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Each element's level, and (word offset in the tail, level) of every upper-level link list."""
    words = h["max_m"] + 1
    levels = np.zeros(h["count"], dtype=np.int64)
    lists, j = [], 0
    for i in range(h["count"]):
        levels[i] = int(tail[j]) // (4 * words)
        lists.extend((j + 1 + words * level, level + 1) for level in range(levels[i]))
        j += 1 + words * int(levels[i])
    return levels, lists


def _neighbour_out_of_range(h: dict, level0: np.ndarray, tail: np.ndarray, rng: np.random.Generator) -> None:
    row = int(rng.choice(np.flatnonzero(level0[:, 0] & 0xFFFF)))
    level0[row, 1 + int(rng.integers(level0[row, 0] & 0xFFFF))] = h["count"] + int(rng.integers(0, 1 << 20))


def _upper_link_fault(h: dict, level0: np.ndarray, tail: np.ndarray, rng: np.random.Generator) -> None:
    """An upper-level link past the last element, or to an element with no list on that level."""
    levels, lists = _upper_lists(h, tail)
    lists = [(at, level) for at, level in lists if tail[at] & 0xFFFF]
    at, level = lists[int(rng.integers(len(lists)))]
    slot = at + 1 + int(rng.integers(tail[at] & 0xFFFF))
    if rng.random() < 0.5:
        tail[slot] = h["count"] + int(rng.integers(0, 1000))
    else:
        tail[slot] = int(rng.choice(np.flatnonzero(levels < level)))


def _link_count_too_big(h: dict, level0: np.ndarray, tail: np.ndarray, rng: np.random.Generator) -> None:
    level0[int(rng.integers(len(level0))), 0] = h["max_m0"] + 1 + int(rng.integers(0, 1000))


def _label_fault(h: dict, level0: np.ndarray, tail: np.ndarray, rng: np.random.Generator) -> None:
    at = h["label_offset"] // 4
    row = int(rng.integers(len(level0)))
    if rng.random() < 0.5:
        level0[row, at] = h["count"] + int(rng.integers(0, 1000))  # past the last label
    else:
        level0[row, at : at + 2] = level0[(row + 1) % len(level0), at : at + 2]  # a label twice


def _vector_nan(h: dict, level0: np.ndarray, tail: np.ndarray, rng: np.random.Generator) -> None:
    dim = (h["label_offset"] - h["offset_data"]) // 4
    level0[int(rng.integers(len(level0))), h["offset_data"] // 4 + int(rng.integers(dim))] = 0x7FC00000  # NaN


def _header_fault(h: dict, level0: np.ndarray, tail: np.ndarray, rng: np.random.Generator) -> None:
    name = ("enterpoint", "max_level", "max_elements", "m")[int(rng.integers(4))]
    h[name] = h["count"] + int(rng.integers(5)) if name == "enterpoint" else h[name] + 1 + int(rng.integers(3))


HNSW_FAULTS: dict[str, Mutation] = {
    "neighbour_out_of_range": _hnsw_edit(_neighbour_out_of_range),
    "upper_link_out_of_range": _hnsw_edit(_upper_link_fault),
    "link_count_too_big": _hnsw_edit(_link_count_too_big),
    "header_out_of_range": _hnsw_edit(_header_fault),
    "label_out_of_range_or_twice": _hnsw_edit(_label_fault),
    "vector_nan": _hnsw_edit(_vector_nan),
}


def _tree_edit(change: Callable[[dict[str, np.ndarray], np.random.Generator], None]) -> Mutation:
    def mutate(path: Path, rng: np.random.Generator) -> None:
        with np.load(path, allow_pickle=False) as z:
            arrays = {name: np.array(z[name]) for name in z.files}
        change(arrays, rng)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        path.write_bytes(buffer.getvalue())
    return mutate


def _tree_nan(arrays: dict[str, np.ndarray], rng: np.random.Generator) -> None:
    names = sorted(n for n, a in arrays.items() if a.dtype.kind == "f" and a.size)
    _poke(arrays[names[int(rng.integers(len(names)))]], rng, np.nan)


def _tree_leaf(arrays: dict[str, np.ndarray], rng: np.random.Generator) -> None:
    leaves = arrays["leaf_labels"]
    real = np.flatnonzero(leaves >= 0)
    at = int(rng.choice(real))
    leaves[at] = len(arrays["classifier_bias"]) + int(rng.integers(100)) if rng.random() < 0.5 else leaves[
        real[(np.searchsorted(real, at) + 1) % len(real)]]


def _tree_dtype(arrays: dict[str, np.ndarray], rng: np.random.Generator) -> None:
    name = sorted(arrays)[int(rng.integers(len(arrays)))]
    other = {"f": np.float64, "i": np.int32}.get(arrays[name].dtype.kind, np.float32)
    if arrays[name].dtype == np.int32:
        other = np.int64
    arrays[name] = arrays[name].astype(other)


def _tree_lexical(arrays: dict[str, np.ndarray], rng: np.random.Generator) -> None:
    """xi's token rows broken: a label out of range, a row out of order, offsets past the end
    or decreasing, one of the three arrays missing (a tree without them has nothing to break:
    an unknown array instead)."""
    if "lexical_labels" not in arrays:
        arrays["lexical_extra"] = np.zeros(3, np.float32)
        return
    labels, indptr = arrays["lexical_labels"], arrays["lexical_indptr"]
    fault = int(rng.integers(5))
    if fault == 0:
        labels[int(rng.integers(len(labels)))] = len(arrays["classifier_bias"]) + int(rng.integers(100))
    elif fault == 1:  # two labels of a row swapped (or repeated): no longer strictly ascending
        rows = np.flatnonzero(np.diff(indptr) >= 2)
        lo = int(indptr[rows[int(rng.integers(len(rows)))]])
        labels[lo], labels[lo + 1] = labels[lo + 1], labels[lo]
    elif fault == 2:
        indptr[-1] += 1 + int(rng.integers(10))
    elif fault == 3:
        at = 1 + int(rng.integers(len(indptr) - 2))
        indptr[at] = indptr[at + 1] + 1 + int(rng.integers(10))
    else:
        del arrays[("lexical_indptr", "lexical_labels", "lexical_weights", "lexical_bias")[int(rng.integers(4))]]


TREE_FAULTS: dict[str, Mutation] = {
    "nan": _tree_edit(_tree_nan),
    "leaf_out_of_range_or_twice": _tree_edit(_tree_leaf),
    "shape": _tree_edit(lambda a, rng: a.update(classifier_bias=a["classifier_bias"][:-1])),
    "dtype": _tree_edit(_tree_dtype),
    "lexical_rows": _tree_edit(_tree_lexical),
}


def _lines_edit(change: Callable[[list[bytes], np.random.Generator], list[bytes]]) -> Mutation:
    def mutate(path: Path, rng: np.random.Generator) -> None:
        lines = path.read_bytes().splitlines(keepends=True)
        path.write_bytes(b"".join(change(lines, rng)))
    return mutate


def _drop_line(lines: list[bytes], rng: np.random.Generator) -> list[bytes]:
    del lines[int(rng.integers(len(lines)))]
    return lines


def _bad_row(lines: list[bytes], rng: np.random.Generator) -> list[bytes]:
    lines[int(rng.integers(len(lines)))] = (b'{"uid": "x"}\n', b"[1, 2]\n", b'{"uid": "x", "title": \n')[
        int(rng.integers(3))]
    return lines


def _target_out_of_range(lines: list[bytes], rng: np.random.Generator) -> list[bytes]:
    at = int(rng.integers(len(lines)))
    row = json.loads(lines[at])
    row["target_ind"] = [*row["target_ind"], 10**6 + int(rng.integers(1000))]
    lines[at] = json.dumps(row).encode() + b"\n"
    return lines


def _json_edit(change: Callable[[dict, np.random.Generator], None]) -> Mutation:
    def mutate(path: Path, rng: np.random.Generator) -> None:
        data = json.loads(path.read_text(encoding="utf-8"))
        change(data, rng)
        path.write_text(json.dumps(data), encoding="utf-8")
    return mutate


def _tokenizer_fault(data: dict, rng: np.random.Generator) -> None:
    kind = int(rng.integers(3))
    if kind == 0:
        data["vocab"], data["idf"] = data["vocab"][:-1], data["idf"][:-1]  # one token short
    elif kind == 1:
        data["idf"][int(rng.integers(len(data["idf"])))] = -1.0 - float(rng.random())
    else:
        data["vocab"][int(rng.integers(len(data["vocab"])))] = int(rng.integers(100))


def _manifest_fault(data: dict, rng: np.random.Generator) -> None:
    kind = ("num_labels", "dim", "vocab_size", "alpha", "lexical_form", "format_version")[int(rng.integers(6))]
    if kind == "alpha":
        data["scoring"]["alpha"] = 1.5 + float(rng.random())
    elif kind == "lexical_form":
        data["scoring"]["lexical_form"] = "shares" if data["scoring"]["lexical_form"] == "logistic" else "logistic"
    else:
        data[kind] += 1 + int(rng.integers(3))


def _onnx_edit(change: Callable[[np.ndarray, np.random.Generator], np.ndarray]) -> Mutation:
    """Change the encoder's largest initializer (the token embedding table)."""
    def mutate(path: Path, rng: np.random.Generator) -> None:
        import onnx  # the train extra's; bench and tests have it, the service does not need it
        from onnx import numpy_helper

        model = onnx.load(str(path))
        init = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))
        init.CopyFrom(numpy_helper.from_array(change(numpy_helper.to_array(init).copy(), rng), init.name))
        onnx.save(model, str(path))
    return mutate


ONNX_FAULTS: dict[str, Mutation] = {
    "embedding_nan": _onnx_edit(lambda a, rng: _poke(a, rng, np.nan)),
    "embedding_short": _onnx_edit(lambda a, rng: a[: -1 - int(rng.integers(len(a) // 2))]),
}


def _external_nan(path: Path, rng: np.random.Generator) -> None:
    """A NaN written over one value of a floating-point initializer in the encoder's external
    data (the graph beside it says where each lies; an int8 table's bytes hold no NaN)."""
    import onnx  # the train extra's; bench and tests have it, the service does not need it
    from onnx import TensorProto

    model = onnx.load(str(path.with_name(ENCODER)), load_external_data=False)
    floats = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
    spans = []
    for init in model.graph.initializer:
        where = {e.key: e.value for e in init.external_data}
        if init.data_location == TensorProto.EXTERNAL and init.data_type in floats and "length" in where:
            spans.append((int(where.get("offset", 0)), int(where["length"]), floats[init.data_type]))
    start, length, dtype = spans[int(rng.integers(len(spans)))]
    width = np.dtype(dtype).itemsize
    at = start + width * int(rng.integers(length // width))
    data = bytearray(path.read_bytes())
    data[at : at + width] = np.array(np.nan, dtype=dtype).tobytes()
    path.write_bytes(bytes(data))


BLIND: dict[str, tuple[Mutation, bool]] = {
    "flip": (_flip, False), "zero": (_zero, False), "truncate": (_truncate, True), "extend": (_extend, True),
}


def catalogue(files: list[str]) -> list[tuple[str, str, Mutation, bool]]:
    """(file, kind, mutation, must_refuse) of every fault this fuzzer writes into these files."""
    out = []
    for name in sorted(files):
        for kind, (mutation, structural) in BLIND.items():
            # Bytes after a zip's or protobuf's end, or after the external data's last tensor:
            # readers may ignore them.
            must = structural and not (kind == "extend" and name.endswith((".onnx", ".npz", ".onnx.data")))
            out.append((name, kind, mutation, must))
        targeted: dict[str, Mutation] = {}
        if name.endswith(".npy"):
            targeted = {"token_shortlist.npy": NPY_ID_FAULTS, "token_overflow.npy": NPY_ID_FAULTS,
                        "labels_retired.npy": RETIRED_FAULTS, "classifier_scales.npy": NPY_SCALE_FAULTS,
                        "centroid_scales.npy": NPY_SCALE_FAULTS}.get(name, NPY_FLOAT_FAULTS)
        elif name.startswith("hnsw_"):
            targeted = HNSW_FAULTS
        elif name == "tree.npz":
            targeted = TREE_FAULTS
        elif name == "encoder.onnx":
            targeted = ONNX_FAULTS
        elif name == "encoder.onnx.data":
            targeted = {"nan": _external_nan}
        elif name == "labels.jsonl":
            targeted = {"drop_line": _lines_edit(_drop_line), "bad_row": _lines_edit(_bad_row)}
        elif name == "validation.jsonl":
            targeted = {"target_out_of_range": _lines_edit(_target_out_of_range), "bad_row": _lines_edit(_bad_row)}
        elif name == "tokenizer.json":
            targeted = {"bad_vocab_or_idf": _json_edit(_tokenizer_fault)}
        elif name == MANIFEST:
            targeted = {"field_out_of_range": _json_edit(_manifest_fault)}
        out.extend((name, kind, mutation, True) for kind, mutation in targeted.items())
    return out


# -- running variants ------------------------------------------------------------------------

def make_variant(template: Path, work: Path, seed: int, index: int, version: str | None = None) -> tuple[Variant, Path]:
    """A copy of the bundle at `template` as work/VERSION (default: the template's name) with
    variant `index`'s fault written in and the manifest's checksums recomputed (except for
    faults in the manifest itself). The first len(catalogue) variants write each fault once;
    later ones repeat them at other places (the rng is seeded by seed and index)."""
    manifest = json.loads((template / MANIFEST).read_text(encoding="utf-8"))
    faults = catalogue([*manifest["files"], MANIFEST])
    name, kind, mutation, must = faults[index % len(faults)]
    path = work / (version or template.name)
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(template, path)
    manifest["version"] = path.name
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    mutation(path / name, np.random.default_rng([seed, index]))
    if name != MANIFEST:
        manifest["files"][name] = sha256_file(path / name)
        (path / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return Variant(index, name, kind, must), path


def index_of(template: Path, file: str, kind: str) -> int:
    """The variant index that writes fault `kind` into `file` of the bundle at `template`."""
    manifest = json.loads((template / MANIFEST).read_text(encoding="utf-8"))
    faults = [(name, k) for name, k, _, _ in catalogue([*manifest["files"], MANIFEST])]
    return faults.index((file, kind))


def outcome(path: Path) -> tuple[str, str]:
    """("refused", why) when loading refuses the bundle; ("refused on first need", why) when it
    serves but a source its scoring does not search (read only by a Predictor whose options
    do) is refused when first opened; ("served", "") when every answer on every path is sound;
    ("error", what broke) otherwise."""
    from service.engine.predictor import Predictor, PredictorOptions

    try:
        predictor = Predictor.load(path)
    except BundleError as exc:
        return "refused", str(exc)
    bundle = predictor.bundle
    try:
        _check_answers(predictor)
        every_source = PredictorOptions(k_w=10, k_mu=10, k_tok=1 if bundle.token_table() is not None else 0)
        try:
            _check_answers(Predictor(bundle, every_source))
        except BundleError as exc:
            return "refused on first need", str(exc)
    except Exception as exc:  # anything a request would have turned into a 5xx
        return "error", f"{type(exc).__name__}: {exc}"
    finally:
        bundle.close()
    return "served", ""


def _check_answers(predictor) -> None:
    bundle, labels = predictor.bundle, predictor.num_labels
    vocab = bundle.tokenizer.vocab
    texts = [c.text for c in bundle.manifest.canary] + list(bundle.labels.titles[:5]) + [
        "", " ".join(vocab[:: max(1, len(vocab) // 40)]), "zzz-unknown-word"]
    k = min(100, labels)
    answers = [predictor.predict_ids(texts, k=k, alpha=a) for a in (None, 0.0, 0.5, 1.0)]
    answers.append(predictor.predict_ids(texts, k=k, exclude=[[0]] * len(texts)))
    answers.extend(predictor.predict_ids([t], k=1) for t in texts[:3])
    if bundle.tree is not None:
        answers.extend(predictor.predict_tree_ids(texts, k=k, beam=b) for b in (None, 1, 64))
    for ids, scores in answers:
        if ids.min() < -1 or ids.max() >= labels or not np.isfinite(scores).all():
            raise ValueError(f"answer out of range: ids {ids.min()}..{ids.max()}, finite {np.isfinite(scores).all()}")
    predictor.predict(texts[:2], k=3)  # names too: the label table row of every id


def run(template: Path, work: Path, seed: int, start: int, count: int) -> Iterator[dict]:
    """Each variant's record, a start record before it (so a crash can be pinned on it)."""
    for index in range(start, start + count):
        variant, path = make_variant(template, work, seed, index)
        yield {"event": "start", **asdict(variant)}
        result, message = outcome(path)
        shutil.rmtree(path, ignore_errors=True)
        yield {"event": "done", **asdict(variant), "outcome": result, "message": message[:500]}


def fuzz(template: Path, work: Path, seed: int, count: int,
         progress: Callable[[dict], None] | None = None) -> list[dict]:
    """Run `count` variants in worker processes; a worker that dies is restarted after the
    variant it died on, which is recorded with outcome "crash"."""
    records: list[dict] = []
    start = 0
    while start < count:
        command = [sys.executable, "-m", "shortlist.bundle_fuzz", "--bundle", str(template), "--work", str(work),
                   "--seed", str(seed), "--start", str(start), "--count", str(count - start)]
        current = None
        with subprocess.Popen(command, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL) as worker:
            for line in worker.stdout:
                record = json.loads(line)
                if record["event"] == "start":
                    current = record
                    continue
                current = None
                records.append(record)
                if progress:
                    progress(record)
        if current is None:
            break
        records.append({**current, "event": "done", "outcome": "crash", "message": f"worker exit {worker.returncode}"})
        start = current["index"] + 1
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shortlist.bundle_fuzz", description=__doc__)
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--count", type=int, default=100)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    for record in run(args.bundle, args.work, args.seed, args.start, args.count):
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
