"""A soak of the running container: load at a share of saturation for minutes, with an activation
every minute (alternating two versions of the bundle, and a faulty one that must be refused).

    python bench/load/soak.py --bundle DIR --rate REQ_PER_S [--minutes 10] [--publish]

REQ_PER_S: 70% of the saturation `make load` measured (bench/RESULTS.md). Versions "a" and "b"
are hard links of DIR (copies across devices) and "bad" a copy with a NaN written into its
centroids (checksums recomputed: only the structural checks can refuse it). Per minute: req/s,
p50/p99 and failures (locust, one run a minute), the activation's outcome, and the container's
memory (docker stats every 5 s). Bars: no failed request; the last minute's p99 at most 1.5x the
first's; memory in the last minute at most 5% above the second minute's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/_common
import _common  # noqa: E402
from run import CONTAINERS, container, locust  # noqa: E402

from shortlist.bundle_fuzz import index_of, make_variant  # noqa: E402

TOKEN = "soak-test-admin-token"


def _versions(bundle: Path, root: Path) -> None:
    for version in ("a", "b"):
        dst = root / version
        dst.mkdir(parents=True)
        for f in bundle.iterdir():
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copy2(f, dst / f.name)
        manifest = json.loads((dst / "manifest.json").read_text())
        (dst / "manifest.json").unlink()  # a hard link: write a file of this version's own
        (dst / "manifest.json").write_text(json.dumps({**manifest, "version": version}))
    make_variant(root / "a", root, 0, index_of(root / "a", "centroids.npy", "nan"), version="bad")
    for path in (root, *root.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _memory_mib(name: str) -> tuple[float, float, float]:
    """(docker stats' usage, the serving process's anonymous RSS, the container's active file
    pages), MiB. docker stats counts anonymous memory and the page cache of files read more than
    once (active_file: every activation's checking process and the server read the bundle),
    which the kernel reclaims under pressure; the anonymous RSS is the service's own memory."""
    usage = subprocess.run(["docker", "stats", "--no-stream", "--format", "{{.MemUsage}}", name],
                           capture_output=True, text=True).stdout.split("/")[0].strip()
    value, unit = float(usage[:-3]), usage[-3:]
    # The server is the container's PID 1; read its status from the host (docker exec would
    # start processes in the container every sample, load the soak measures).
    pid = subprocess.run(["docker", "inspect", "--format", "{{.State.Pid}}", name], capture_output=True,
                         text=True).stdout.strip()
    status = Path(f"/proc/{pid}/status").read_text() if pid.isdigit() else ""
    anon = next((float(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("RssAnon:")), 0.0)
    return value * {"KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}[unit], anon, _active_file_mib(name)


def _active_file_mib(name: str) -> float:
    """The container's active page cache from its memory cgroup (v1 or v2 layouts), or NaN."""
    cid = subprocess.run(["docker", "inspect", "--format", "{{.Id}}", name], capture_output=True,
                         text=True).stdout.strip()
    for d in (f"/sys/fs/cgroup/memory/docker/{cid}", f"/sys/fs/cgroup/system.slice/docker-{cid}.scope",
              f"/sys/fs/cgroup/docker/{cid}"):
        stat = Path(d) / "memory.stat"
        if cid and stat.is_file():
            fields = dict(line.split() for line in stat.read_text().splitlines())
            return int(fields.get("active_file", 0)) / 2**20
    return float("nan")


def _drop_page_cache() -> bool:
    """Empty the host's page cache, so the container is charged for every bundle page it reads:
    a page already cached stays charged to whoever read it first, and docker stats would show
    only the pages the container happens to read first, as it reads them. Needs root."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1")
        return True
    except OSError:
        return False


def soak(url: str, rate: float, minutes: int, out: Path) -> list[dict]:
    name, stop, memory = CONTAINERS[url], threading.Event(), []

    def sample() -> None:
        while not stop.is_set():
            memory.append((time.monotonic(), _memory_mib(name)))
            stop.wait(5)

    threading.Thread(target=sample, daemon=True).start()
    plan, rows = ["b", "bad", "a"], []
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {TOKEN}"}, timeout=600) as admin:
        for minute in range(minutes):
            started = time.monotonic()
            version = plan[minute % len(plan)]
            activation: dict = {}
            t = threading.Thread(target=lambda v=version, a=activation: a.update(
                status=admin.post("/admin/bundles/activate", json={"version": v}).status_code))
            threading.Timer(20, t.start).start()  # mid-minute, under load
            stats = locust(url, 16, 60, out / f"soak-minute{minute + 1}", rate=rate / 16)["Aggregated"]
            t.join()
            mem = [m for ts, m in memory if ts >= started]
            rows.append({"minute": minute + 1, **stats, "activated": version, "status": activation.get("status"),
                         "memory_mib": statistics.mean(m[0] for m in mem) if mem else float("nan"),
                         "anon_mib": statistics.mean(m[1] for m in mem) if mem else float("nan"),
                         "active_file_mib": statistics.mean(m[2] for m in mem) if mem else float("nan")})
            print(json.dumps(rows[-1]), flush=True)
    stop.set()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--rate", type=float, required=True, help="requests/s to offer (70%% of saturation)")
    ap.add_argument("--minutes", type=int, default=10)
    ap.add_argument("--image", default=os.environ.get("IMAGE", "shortlist:cpu"))
    ap.add_argument("--out", type=Path, default=_common.OUT_DIR / "soak")
    ap.add_argument("--publish", action="store_true")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="soak-", dir=args.out) as tmp:
        root = Path(tmp) / "bundles"
        _versions(args.bundle.resolve(), root)
        dropped = _drop_page_cache()
        print(f"page cache dropped before the container started: {dropped}", flush=True)
        with container(root / "a", args.image, SHORTLIST_ADMIN_TOKEN=TOKEN) as url:
            rows = soak(url, args.rate, args.minutes, args.out)
    failed = sum(round(r["fail"] * r["rps"] * 60) for r in rows)
    p99_ratio = rows[-1]["p99"] / max(rows[0]["p99"], 1e-9)
    second = rows[min(1, len(rows) - 1)]
    mem_ratio = rows[-1]["memory_mib"] / second["memory_mib"]
    anon_ratio = rows[-1]["anon_mib"] / second["anon_mib"]
    refused_ok = all(r["status"] == (422 if r["activated"] == "bad" else 200) for r in rows)
    lines = ["## Soak: the container under load with an activation a minute", "",
             f"Command: `{_common.command_line()}` (commit {_common.git_revision()}); locust on the same "
             f"{os.cpu_count()} cores.", "",
             "| minute | req/s | p50 (ms) | p99 (ms) | failures | activated | answer | docker stats (MiB) | "
             "server anon RSS (MiB) | active file pages (MiB) |", "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {r['minute']} | {r['rps']:.0f} | {r['p50']:.0f} | {r['p99']:.0f} | {100 * r['fail']:.2f}% | "
              f"{r['activated']} | {r['status']} | {r['memory_mib']:.0f} | {r['anon_mib']:.0f} | "
              f"{r['active_file_mib']:.0f} |" for r in rows]
    lines += ["", f"Failed requests {failed}; p99 last/first minute {p99_ratio:.2f} (bar <= 1.5); memory last/second "
              f"minute: docker stats {mem_ratio:.3f}, the server's anonymous RSS {anon_ratio:.3f} (bar <= 1.05); "
              f"activations answered as expected: {refused_ok}."]
    body = "\n".join(lines)
    print(body)
    if args.publish:
        _common.replace_section(_common.BENCH_DIR / "RESULTS.md", "soak", body)
    return 0 if failed == 0 and p99_ratio <= 1.5 and mem_ratio <= 1.05 and refused_ok else 1


if __name__ == "__main__":
    sys.exit(main())
