"""Helpers shared by the HTTP tests: test texts, in-process reference answers, ranking comparison."""

from __future__ import annotations

import gzip
import json
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from service.engine import Predictor

T = TypeVar("T")


def sample_titles(data_dir: Path, n: int) -> list[str]:
    titles = []
    with gzip.open(data_dir / "tst.json.gz", "rt", encoding="utf-8") as f:
        for line in f:
            title = json.loads(line)["title"]
            if title.strip():
                titles.append(title)
            if len(titles) == n:
                break
    return titles


def reference(bundle_dir: Path, texts: list[str], k: int = 10, *, alpha: float | None = None,
              tree: bool = False, exclude: list[int] | None = None) -> list[list[dict[str, Any]]]:
    """What the engine answers in-process for these texts, as API label dicts."""
    predictor = Predictor.load(bundle_dir)
    rows = None if exclude is None else [exclude] * len(texts)
    if tree:
        preds = predictor.predict_tree(texts, k=k, exclude=rows)
    else:
        preds = predictor.predict(texts, k=k, alpha=alpha, exclude=rows)
    out = [[{"id": p.id, "uid": p.uid, "title": p.title, "score": p.score} for p in row] for row in preds]
    predictor.bundle.close()
    return out


def assert_same_ranking(got: list[dict[str, Any]], want: list[dict[str, Any]], tol: float = 1e-4) -> None:
    """Same labels in the same order, scores equal up to float noise of batch composition.

    Labels whose scores tie within `tol` may come in either order, so positions are compared
    as groups of near-equal scores.
    """
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want, strict=True):
        assert abs(g["score"] - w["score"]) <= tol * max(1.0, abs(w["score"])), (g, w)
    i = 0
    while i < len(want):
        j = i + 1
        while j < len(want) and abs(want[j]["score"] - want[i]["score"]) <= tol * max(1.0, abs(want[i]["score"])):
            j += 1
        assert {x["id"] for x in got[i:j]} == {x["id"] for x in want[i:j]}, (got, want)
        for x in got[i:j]:
            assert set(x) == {"id", "uid", "title", "score"}
        i = j


def renamed_copy(root: Path, source: str, version: str) -> Path:
    """ROOT/version: a copy of bundle `source` renamed consistently (its manifest's version)."""
    dst = root / version
    shutil.copytree(root / source, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["version"] = version
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def flip_a_byte(path: Path) -> None:
    """One byte in the middle of `path` changed, written as a new file (other versions sharing
    the old one by a hard link keep theirs)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.unlink()
    path.write_bytes(bytes(data))


def wait_until(condition: Callable[[], T], what: str, timeout: float = 60.0, interval: float = 0.05) -> T:
    """The first truthy value of `condition()`, polled until `timeout` (AssertionError naming `what`).

    What a test waits for on a server (a metric counted, a log line written, a lock taken) happens
    on the server's schedule: a fixed sleep before checking it fails on a loaded machine. The
    deadline is generous because reaching it means a failure anyway."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting after {timeout:g} s for {what}")
        time.sleep(interval)
    return value


def read_answers(sock: socket.socket) -> list[tuple[int, dict]]:
    """Every answer the server sends until it closes the connection (a reset fails), in order,
    as (status, JSON body); each has a Content-Length, as all of this server's JSON answers do."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    answers = []
    while received:
        head, _, rest = received.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in lines[1:] if line.lower().startswith(b"content-length:"))
        answers.append((int(lines[0].split(b" ", 2)[1]), json.loads(rest[:length])))
        received = rest[length:]
    return answers
