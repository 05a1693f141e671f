"""service.engine.heap: memory touched by `prefault` is what the next allocation gets.

Heap settings are process-wide, so each case runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc only")

_PROBE = textwrap.dedent("""
    import json, resource, sys, threading
    import numpy as np
    from service.engine import heap

    tuned = heap.tune_for_loads() if sys.argv[1] == "tuned" else False
    n = 48 << 20
    out = {"tuned": tuned}

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

    def run():  # on a thread of its own, as bundle loads run
        f0, r0 = faults(), rss()
        heap.prefault(n)
        f1, r1 = faults(), rss()
        block = np.empty(n, dtype=np.uint8)
        block.fill(1)
        f2, r2 = faults(), rss()
        # Faults alone would not tell: numpy asks for huge pages, 512 x fewer faults.
        out.update(prefault_faults=f1 - f0, fill_faults=f2 - f1, prefault_rss=r1 - r0, fill_rss=r2 - r1,
                   rss_with_block=r2)
        del block
        heap.trim()
        out["rss_after_trim"] = rss()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    out["pages"] = n // 4096
    print(json.dumps(out))
""")


def _probe(mode: str) -> dict:
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], cwd=root, capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_prefaulted_block_is_reused_resident_and_trimmed_after() -> None:
    out = _probe("tuned")
    assert out["tuned"] is True
    # The faults happen in prefault (with the GIL released), and the freed block stays resident
    # for the allocation after it, which then adds nothing to the resident set.
    assert out["prefault_faults"] >= 0.9 * out["pages"], out
    assert out["prefault_rss"] >= 0.9 * out["pages"] * 4096, out
    assert out["fill_rss"] <= 0.05 * out["pages"] * 4096, out
    assert out["fill_faults"] <= 0.05 * out["pages"], out
    # Freed and trimmed, the block leaves the process's resident set.
    assert out["rss_with_block"] - out["rss_after_trim"] >= 0.9 * out["pages"] * 4096, out


def test_untuned_prefault_does_nothing() -> None:
    # Without the settings the block would be unmapped on free: touching it would be wasted.
    out = _probe("untuned")
    assert out["tuned"] is False
    assert out["prefault_faults"] <= 0.05 * out["pages"], out
    assert out["prefault_rss"] <= 0.05 * out["pages"] * 4096, out
    assert out["fill_rss"] >= 0.9 * out["pages"] * 4096, out
