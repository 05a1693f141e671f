"""A bundle's arrays are memory-mapped (service/engine/mapped.py): .npy files and the stored
members of an .npz, and the pages a check read are handed back; exact scoring over all labels
holds a bounded block of scores."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest

from service.engine.mapped import MappedArrays
from service.engine.scorers import exact_chunk


def _resident_kib(path: Path) -> int:
    """Rss of this process's maps of `path`, from /proc/self/smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_pages_a_check_read_are_handed_back(tmp_path: Path) -> None:
    path = tmp_path / "big.npy"
    values = np.arange(1 << 21, dtype=np.float32).reshape(-1, 64)  # 8 MiB
    np.save(path, values)
    maps = MappedArrays()
    arr = maps.npy(path)
    assert np.isfinite(arr).all()  # reads every page
    assert _resident_kib(path) > 6 * 1024
    maps.release()
    assert _resident_kib(path) < 1024
    np.testing.assert_array_equal(arr[12345], values[12345])  # still readable: mapped again on access


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_a_resident_copy_hands_back_the_maps_pages_as_it_goes(tmp_path: Path) -> None:
    """The label vectors' copy in memory (Bundle.label_vectors) never holds the whole map too:
    the rows copied are handed back piece by piece; the copy is exact."""
    from service.engine import heap

    path = tmp_path / "big.npy"
    values = np.arange(1 << 21, dtype=np.float32).reshape(-1, 64)  # 8 MiB, four pieces of 2 MiB
    np.save(path, values)
    maps = MappedArrays()
    arr = maps.npy(path)
    resident: list[int] = []

    def copied(start: int, stop: int) -> None:
        maps.release_rows(arr, start, stop)
        resident.append(_resident_kib(path))

    previous, heap.RESIDENT_COPY_BYTES = heap.RESIDENT_COPY_BYTES, 2 << 20
    try:
        copy = heap.resident_copy(arr, copied)
    finally:
        heap.RESIDENT_COPY_BYTES = previous
    np.testing.assert_array_equal(copy, values)
    assert len(resident) == 4 and max(resident) < 3 * 1024  # never more than a piece or so of the 8 MiB
    maps.release_rows(np.ones(4), 0, 4)  # an array over none of its maps: nothing happens
    np.testing.assert_array_equal(arr[-1], values[-1])  # the map reads again


def test_npz_members_are_mapped_where_they_lie_and_checked(tmp_path: Path) -> None:
    arrays = {"big": np.random.default_rng(0).random((300, 40)).astype(np.float16), "small": np.arange(3)}
    np.savez(tmp_path / "a.npz", **arrays)
    np.savez_compressed(tmp_path / "b.npz", **arrays)
    for name in ("a.npz", "b.npz"):
        got = MappedArrays().npz(tmp_path / name)
        assert set(got) == set(arrays)
        for key, value in arrays.items():
            np.testing.assert_array_equal(got[key], value)
    with zipfile.ZipFile(tmp_path / "a.npz") as z:
        big = z.getinfo("big.npy")
    data = bytearray((tmp_path / "a.npz").read_bytes())
    # the member's npy header declares more rows than the member holds
    header_at = data.index(b"(300, 40)", big.header_offset)
    data[header_at : header_at + 9] = b"(301, 40)"
    (tmp_path / "c.npz").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="the header declares"):
        MappedArrays().npz(tmp_path / "c.npz")


def test_exact_scoring_holds_a_bounded_block_of_scores() -> None:
    assert exact_chunk(1_000) == 512 and exact_chunk(42_242) == 512
    assert exact_chunk(1_000_000) == 33 and exact_chunk(10**9) == 1
