"""Several serving processes on one port (`SHORTLIST_PROCESSES` > 1): how they agree on the bundle.

gunicorn's arbiter runs the processes (service.api.supervisor: one listening socket; a process that dies is
restarted; SIGTERM drains them all). Each loads the bundle itself: the .npy arrays are memory
maps of the same files, so their pages are shared, not copied per process. They agree through
the state directory: `active.json` (service.api.active_state) is the version to serve, and
its lock makes activations exclusive among them. An activation lands on one process, which
checks, records and swaps as a single process does; every other process sees the record
within `process_sync_interval_s` and loads and swaps that version too (the bundle was checked
already). Each process publishes what it serves in `processes/<pid>.json`, from before its
first load on (serving nothing yet, and why); the activating process answers once every live
process serves the new version (or said why it cannot), and /readyz on any process reads the same
records to answer for them all (`not_ready`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import orjson

from service.api.active_state import StateUnavailable
from service.api.registry import ActivationFailed, ActivationInProgress, BundleNotFound, BundleRegistry
from service.engine.small_files import read_small_file

log = logging.getLogger("shortlist.processes")
PROCESSES_DIR = "processes"
# The most bytes of a process's record read (pid, version, and a refusal message at most a few KB).
MAX_RECORD_BYTES = 1 << 20
# prometheus-client's directory for the processes' metric files (service.api.observability)
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"
# What a process that has not finished its first load publishes as the reason it serves nothing.
STARTING = "starting: its first bundle is loading"


def every(interval_s: float, stop: threading.Event, fn: Callable[[], object], what: str) -> None:
    """fn() every interval_s until `stop` is set; a failure is logged and the next tick retries."""
    while not stop.wait(interval_s):
        try:
            fn()
        except Exception:  # the loop must outlive any one failure
            log.exception("%s failed", what)


class ProcessesDiverged(Exception):
    """Some process could not serve the version another one activated (HTTP 503)."""


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ProcessGroup:
    """This process among those sharing `state_dir`: follows their activations, reports its own."""

    def __init__(self, state_dir: str | Path, registry: BundleRegistry, interval_s: float,
                 converge_timeout_s: float) -> None:
        if registry.remembered is None:
            raise ValueError("a process group needs the registry to remember the active version")
        self.dir = Path(state_dir) / PROCESSES_DIR
        self.registry = registry
        self.interval_s = interval_s
        self.converge_timeout_s = converge_timeout_s
        self.pid = os.getpid()
        self._failed: tuple[str, str] | None = None  # (version, why): not retried until the record changes
        # Why this process serves nothing (published while it does): start-up's error once it ends.
        self.not_serving: str | None = STARTING
        # False while this process holds its start-up (takes no connections: service.api.app): the
        # others' /readyz leaves it out, since no request reaches it.
        self.accepting = True
        self._not_ready: tuple[float, dict[int, str]] | None = None  # (when read, not_ready's answer)
        self._published: dict[str, Any] | None = None
        self._changed_seen: tuple[object, tuple[int, int, int] | None] | None = None  # (engine, record stamp)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._publishing = threading.Lock()

    def cannot_serve(self, version: str, why: str) -> None:
        """This process failed to load `version` (at start-up, before the group starts): it is
        published as this process's failure and not retried until the record changes (a version
        refused by the checking child would be loaded here unchecked by `follow`)."""
        self._failed = (version, why)

    def announce(self) -> None:
        """Publish this process before its first load (serving nothing, STARTING, and whether it
        takes connections meanwhile): a process that loads while it takes connections is one
        /readyz on the others waits for, not one they cannot see."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._publish()

    def others_serving(self) -> bool:
        """Whether another live process serves a version (this one then joins them)."""
        return any(m.get("version") for pid, m in self.members().items() if pid != self.pid)

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.registry.converge = self.wait_for
        self.registry.served_by_processes = self.served_versions
        self.members()  # drops the records of processes that died (the one this may replace)
        self._publish()
        self._thread = threading.Thread(target=self._run, name="process-sync", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.registry.converge = None
        self.registry.served_by_processes = None
        (self.dir / f"{self.pid}.json").unlink(missing_ok=True)

    def _run(self) -> None:
        every(self.interval_s, self._stop, self.sync, "process sync")

    def sync(self) -> None:
        """Serve the recorded version if this process does not yet, then publish what it serves."""
        wanted = self.registry.remembered.read()  # type: ignore[union-attr]
        failed_version = self._failed[0] if self._failed else None
        again = self._activated_again()
        if wanted is not None and (wanted != self.registry.active_version and wanted != failed_version or again):
            try:
                self.registry.follow(wanted)
                self._failed = None
            except ActivationInProgress:
                pass  # this process is activating itself: its own record decides next tick
            except (ActivationFailed, BundleNotFound) as exc:
                log.error("process %d cannot serve %s, activated by another process: %s", self.pid, wanted, exc)
                self._failed = (wanted, str(exc))
        self._publish()

    def _activated_again(self) -> bool:
        """Whether this process's version changed on disk (service.api.bundle_watch) and the record
        was written since this process saw that: an operator activated a version again, maybe the
        same one, which it loads (and checks) again, once per write of the record."""
        engine = self.registry.active
        if engine is None or engine.changed is None:
            return False
        try:
            st = os.stat(self.registry.remembered.path)  # type: ignore[union-attr]
            record = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            record = None
        seen, self._changed_seen = self._changed_seen, (engine, record)
        return seen is not None and seen[0] is engine and seen[1] != record

    def publish_swap(self) -> None:
        """Publish the version this process now serves, at its swap (best effort: a state
        directory that refuses the record is logged; the sync publishes again)."""
        try:
            self._publish()
        except StateUnavailable as exc:
            log.error("%s", exc)

    def _publish(self) -> None:
        # One writer at a time: the sync thread and an admin request's wait_for both publish, and
        # through the one temporary file the second's rename found it gone (a 503 for a fine state dir).
        with self._publishing:
            version = self.registry.active_version
            record = {"pid": self.pid, "version": version,
                      "failed": {"version": self._failed[0], "error": self._failed[1]} if self._failed else None,
                      "not_serving": None if version else self.not_serving, "accepting": self.accepting}
            if record == self._published:
                return
            tmp = self.dir / f".{self.pid}.json.tmp"
            try:
                tmp.write_text(json.dumps(record), encoding="utf-8")
                os.replace(tmp, self.dir / f"{self.pid}.json")
            except OSError as exc:
                with suppress(OSError):
                    tmp.unlink()
                raise StateUnavailable(self.dir.parent, exc, "publish the version this process serves") from None
            self._published = record

    def members(self) -> dict[int, dict[str, Any]]:
        """What every live process sharing the directory last published, by pid (files of
        processes that died are removed)."""
        out = {}
        for path in self.dir.glob("*.json"):
            try:
                pid = int(path.stem)
                # Read as every small state file is: a FIFO or device there must not stall the sync.
                record = orjson.loads(read_small_file(path, MAX_RECORD_BYTES))
            except (ValueError, OSError):
                continue
            if not process_alive(pid):
                with suppress(OSError):  # tidying; a read-only directory keeps the record of the dead
                    path.unlink()
                continue
            out[pid] = record
        return out

    def served_by(self) -> dict[int, str]:
        """pid -> the version that live process serves (those serving none yet left out)."""
        return {pid: str(m["version"]) for pid, m in self.members().items() if m.get("version")}

    def served_versions(self) -> set[str]:
        """The versions the live processes sharing the directory serve (derived versions kept)."""
        return set(self.served_by().values())

    def not_ready(self) -> dict[int, str]:
        """pid -> why, for each other live process that serves nothing (starting, or start-up
        failed) or could not serve the recorded version: what makes the service not ready on every
        process, not only on the one a probe's connection lands on. One process loading a newer
        version still serves the one before (as a single process does while it swaps), so it is
        ready. Read from the records at most once per sync interval: /readyz is polled."""
        now = time.monotonic()
        cached = self._not_ready
        if cached is not None and now - cached[0] < self.interval_s:
            return cached[1]
        recorded = self.registry.remembered.read()  # type: ignore[union-attr]
        out: dict[int, str] = {}
        for pid, m in self.members().items():
            if pid == self.pid or m.get("accepting") is False:
                continue  # this process's own state is read live; one taking no connections answers nobody
            failed = m.get("failed") or {}
            cannot = f"cannot serve {failed.get('version')}: {failed.get('error')}" if failed else None
            if not m.get("version"):
                out[pid] = f"serves no bundle: {cannot or m.get('not_serving') or 'no reason given'}"
            elif recorded is not None and m["version"] != recorded and failed.get("version") == recorded:
                out[pid] = f"serves {m['version']}, {cannot}"
        self._not_ready = (now, out)
        return out

    def wait_for(self, version: str) -> dict[str, object]:
        """Block until every live process serves `version`: {pid: version}. ProcessesDiverged
        naming each process that cannot, or still does not after `converge_timeout_s` (a process
        alive but stopped, or stuck loading): the version stays recorded, and they follow when they can."""
        self._publish()
        deadline = time.monotonic() + self.converge_timeout_s
        while True:
            members = self.members()
            behind = {pid: m for pid, m in members.items() if m.get("version") != version and not _starting(m)}
            failed = {pid: m["failed"]["error"] for pid, m in behind.items()
                      if (m.get("failed") or {}).get("version") == version}
            if not behind:
                return {str(pid): m.get("version") for pid, m in members.items()}
            timed_out = time.monotonic() > deadline
            if failed or timed_out:
                late = ""
                if timed_out:
                    late = f" after {self.converge_timeout_s:g} s (SHORTLIST_PROCESS_CONVERGE_TIMEOUT_S)"
                reasons = "; ".join(f"process {pid}: " + (failed.get(pid) or f"still serves {m.get('version')}{late}")
                                    for pid, m in behind.items())
                raise ProcessesDiverged(f"{version} is recorded as active and serves on {len(members) - len(behind)} "
                                        f"of {len(members)} processes; {reasons}")
            time.sleep(min(self.interval_s, 0.05))


def _starting(member: dict[str, Any]) -> bool:
    """Whether a process's record says its first load has not swapped anything in. Its start-up
    loads under the activation lock, which an activation holds while it waits for the processes:
    it then serves the version that activation recorded, and waiting for it could only time out
    (audit s25: 60 s, then 503 processes_diverged, for a process restarted at that moment).
    Records are published at each swap, before the lock is let go (publish_swap)."""
    return not member.get("version") and member.get("not_serving") == STARTING and not member.get("failed")
