"""A bundle loaded and checked in a child process first, so native code that crashes on it takes
down the child, not the process serving requests.

Opening a bundle (service.engine.bundle, index, canary) refuses the structural faults we know
of before anything reaches hnswlib or onnxruntime. Those are native libraries: a fault nobody
foresaw could still crash or hang the process that loads it. So the service loads a bundle
only after a child process has loaded it exactly as the service will (same options) and
answered its canaries: a refusal, a crash (killed by a signal) or a hang (past the timeout)
there is a refusal here, naming the bundle, and the service goes on serving what it served.

Run as `python -m service.engine.isolated BUNDLE_DIR --threads N [--max-manifest-bytes B]`: exit 0 when the bundle
loads, 3 with {"error": ...} on stdout when it is refused.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path

from service.engine.schema import MAX_MANIFEST_BYTES, BundleError

_REFUSED = 3


def check_in_child(path: str | Path, *, threads: int = 1, timeout_s: float = 600.0,
                   max_manifest_bytes: int = MAX_MANIFEST_BYTES) -> None:
    """Raise BundleError unless a child process loads the bundle at `path` and passes its canaries."""
    command = [sys.executable, "-m", "service.engine.isolated", str(path), "--threads", str(int(threads)),
               "--max-manifest-bytes", str(int(max_manifest_bytes))]
    try:
        done = subprocess.run(command, capture_output=True, timeout=timeout_s, check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise BundleError(f"{path}: loading did not finish within {timeout_s:g} s in a checking process") from exc
    if done.returncode == 0:
        return
    if done.returncode == _REFUSED:
        try:
            message = json.loads(done.stdout.decode("utf-8", "replace").strip().splitlines()[-1])["error"]
        except (ValueError, IndexError, KeyError, TypeError):
            message = f"{path}: refused (unreadable report from the checking process)"
        raise BundleError(message)
    if done.returncode == -signal.SIGKILL:
        raise BundleError(f"{path}: the checking process was killed (SIGKILL) while loading it: most likely out of "
                          "memory (the machine's, or a container's memory limit, is too small for this bundle); "
                          "not loaded into the serving process")
    if done.returncode < 0:
        raise BundleError(f"{path}: loading crashed the checking process ({_signal_name(-done.returncode)}); "
                          "not loaded into the serving process")
    tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
    raise BundleError(f"{path}: the checking process failed (exit {done.returncode}): {tail[0]}")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# The most a process may raise its own OOM score to (Linux): the kernel's OOM killer picks it first.
_OOM_SCORE_ADJ_MAX = 1000


def first_to_go() -> None:
    """Make this process the first the kernel's OOM killer picks. A bundle too large for the memory
    (a container's limit) then kills the checking child, a refusal naming the bundle, rather than
    the serving process beside it: at start-up the two are of similar size and the kernel picked
    the server (PID 1 of a container: exit 137, no message, a restart loop). Where there is no
    such file (not Linux) nothing changes."""
    try:
        Path("/proc/self/oom_score_adj").write_text(str(_OOM_SCORE_ADJ_MAX))
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.engine.isolated", description=__doc__)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-manifest-bytes", type=int, default=MAX_MANIFEST_BYTES)
    args = parser.parse_args(argv)
    first_to_go()
    from service.engine.predictor import Predictor, PredictorOptions

    try:
        Predictor.load(args.bundle, PredictorOptions(threads=args.threads),
                       max_manifest_bytes=args.max_manifest_bytes)
    except BundleError as exc:
        print(json.dumps({"error": str(exc)}))
        return _REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())
