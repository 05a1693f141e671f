"""What every registry of the service shares about activations (service.api.registry, and the Ray
Serve app's in service.api.ray_app): their errors, the lock that makes them exclusive, and the
rollback history they record in the state directory (service.api.active_state)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

from service.api.active_state import HISTORY_LENGTH, ActiveVersionFile, StateBusy
from service.api.events import log_event

log = logging.getLogger("shortlist.registry")


class ActivationInProgress(Exception):
    """Another activation holds the lock (HTTP 409)."""


class ActivationLockBusy(ActivationInProgress):
    """The activation lock stayed held past the time a caller waits for it (HTTP 503 with
    Retry-After): what held it is named, and a retry once it is done goes through."""

    retry_after_s = 5


class ActiveVersionChanged(Exception):
    """A rollback's or label change's `expected_active` is not the active version (HTTP 409):
    nothing was done."""


def expect_active(expected: str | None, active: str | None, undone: str = "nothing was rolled back") -> None:
    """ActiveVersionChanged unless `expected` is None or the active version: a client that retries
    a rollback or a label change it sent with the version it saw active has it done once, not once
    per attempt. `undone`: what the refusal says was not done."""
    if expected is not None and expected != active:
        raise ActiveVersionChanged(f"the active version is {active}, not {expected} (expected_active): {undone}")


class BundleNotFound(Exception):
    """No bundle of that version under the root (HTTP 404)."""


class ActivationFailed(Exception):
    """The bundle failed validation or the quality gate (HTTP 422); the old one keeps serving."""


def with_previous(history: list[str], previous: str | None, new: str | None) -> list[str]:
    """The history to record when `new` replaces `previous`: `previous` pushed (the last
    HISTORY_LENGTH kept), unless nothing served or it is `new` itself (a rollback must go
    somewhere else)."""
    if previous is None or previous == new:
        return history
    return [*history, previous][-HISTORY_LENGTH:]


def roll_back(history: list[str], activate: Callable[[str, list[str]], dict[str, object]],
              forget: Callable[[], None], active: str | None) -> tuple[dict[str, object], list[dict[str, str]]]:
    """activate(version, the history before it) for the newest entry of `history` that still loads
    and is not `active` (rolling back to what serves would change nothing): (its result; the
    entries passed over for not loading, each {"version", "reason"}). An entry that no longer
    loads (deleted, or refused: corrupt, failing the gate) is passed over and left out of the
    history the next one is activated with: otherwise one such entry would fail every rollback
    for good. When none loads, forget() (the caller empties its recorded history) and
    BundleNotFound naming what was passed over. A state directory that cannot record the switch
    (StateUnavailable) is not the entry's fault: raised."""
    skipped: list[dict[str, str]] = []
    while history:
        version, history = history[-1], history[:-1]
        if version == active:
            continue
        try:
            return activate(version, history), skipped
        except (BundleNotFound, ActivationFailed) as exc:
            log.warning("rollback skips %s, which no longer loads: %s", version, exc)
            skipped.append({"version": version, "reason": str(exc)})
    if skipped:
        forget()
    passed = "".join(f"; skipped {s['version']}: {s['reason']}" for s in skipped)
    raise BundleNotFound(f"no previously active bundle to roll back to{passed}")


def starting_version(remembered: ActiveVersionFile | None, configured: str | None) -> str | None:
    """The version start-up serves: the recorded one (the operator's last activation outlives a
    restart), else `configured` (SHORTLIST_VERSION / --version), else None (the newest). A
    configured version passed over is said, since `serve --version X` then serves another."""
    recorded = remembered.read() if remembered else None
    if recorded is not None and configured is not None and configured != recorded:
        log_event("configured_version_passed_over", logging.WARNING, configured=configured, serving=recorded,
                  message=f"SHORTLIST_VERSION / --version {configured} is not served: the state directory "
                          f"records {recorded} as last activated (activate {configured} to serve it)")
    return recorded or configured


def record_no_history(remembered: ActiveVersionFile | None, active: str | None) -> None:
    """Record an emptied history (rollback dropped every entry), so a restart does not bring back
    the entries that no longer load. Best effort: the record stays as it was if it cannot be written."""
    if remembered is None or active is None:
        return
    try:
        remembered.write(active, [])
    except OSError as exc:
        log.warning("could not record the emptied history in %s: %s", remembered.dir, exc)


@contextmanager
def exclusive_activation(lock: threading.Lock, remembered: ActiveVersionFile | None,
                         holder: str = "") -> Iterator[list[str] | None]:
    """`lock` (a registry's activation lock) and, with a state directory, the one the processes
    sharing it hold (ActivationInProgress at once if either is taken; `holder` says what for, to
    the processes that find it taken: ActiveVersionFile.holder); yields the recorded
    history of versions (other processes may have activated since: their record is the truth),
    None without a state directory or when the record there cannot be read (the caller keeps the
    history it holds: the next write replaces the record without dropping it)."""
    if not lock.acquire(blocking=False):
        raise ActivationInProgress("another activation is in progress")
    try:
        if remembered is None:
            yield None
            return
        try:
            with remembered.exclusive(holder):
                yield remembered.readable_history()
        except StateBusy as exc:
            raise ActivationInProgress(str(exc)) from None
    finally:
        lock.release()


# How often a section waiting for the activation lock tries it again (it polls: ActivationGate.exclusive).
LOCK_POLL_S = 0.05


class ActivationGate:
    """A registry's activation lock and, with a state directory (`remembered`), the one the
    processes sharing it hold; and the turn an activation or rollback takes ahead of the label
    changes waiting for that lock (a feed of changes polling it back to back starved them: 27 of
    27 got 409)."""

    def __init__(self, remembered: ActiveVersionFile | None) -> None:
        self.remembered = remembered
        self._lock = threading.Lock()
        self._holder: str | None = None  # what this process holds the lock for, named to those that wait
        # Held by this process's activation or rollback in progress (operator_turn): one at a time.
        self._operator_lock = threading.Lock()
        self._operator: str | None = None

    @contextmanager
    def exclusive(self, what: str, *, shared_state: bool = True, wait_s: float | None = None,
                  bound: str = "", change: bool = False) -> Iterator[list[str] | None]:
        """Both locks, held for `what` (exclusive_activation's, yielding its history):
        ActivationInProgress at once if either is taken, or with `wait_s` ActivationLockBusy
        naming the holder once they stayed taken that long (`bound`: the setting). Waiting polls
        rather than blocks, so this process keeps following the activation it waits for (process
        sync takes the lock between polls) and that activation's wait for every process ends. A
        label change (`change`) does not try the lock while an activation or rollback holds its
        turn, and lets it go again if one took its turn while it tried (between the look and the
        lock): the operator's command is not starved by a feed of changes, nor passed by one."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        with ExitStack() as held:
            while True:
                if not (change and self.operator_waiting()):
                    attempt = ExitStack()
                    try:
                        history = attempt.enter_context(exclusive_activation(
                            self._lock, self.remembered if shared_state else None, what))
                    except ActivationInProgress:
                        if deadline is None:
                            raise
                    else:
                        if not (change and self.operator_waiting()):
                            held.enter_context(attempt)
                            break
                        attempt.close()
                if deadline is None or time.monotonic() > deadline:
                    raise ActivationLockBusy(
                        f"the activation lock is still held after {wait_s or 0:g} s ({bound}), by "
                        f"{self.lock_holder()}; retry in {ActivationLockBusy.retry_after_s} s")
                time.sleep(LOCK_POLL_S)
            self._holder = what
            held.callback(setattr, self, "_holder", None)
            yield history

    def operator_waiting(self) -> bool:
        """Whether an activation or rollback, here or in a process sharing the state directory, holds its turn."""
        return self._operator_lock.locked() or (self.remembered is not None and self.remembered.operator_waiting())

    def lock_holder(self) -> str:
        """What holds the activation lock, as far as this process can tell."""
        here = self._holder
        if here is not None:
            return f"this process ({os.getpid()}): {here}"
        noted = self.remembered.holder() if self.remembered is not None else None
        return noted or "another process sharing the state directory"

    @contextmanager
    def operator_turn(self, what: str) -> Iterator[None]:
        """The turn of an activation or rollback (`what`): one at a time among the processes sharing
        the state directory (ActivationInProgress at once for a second one); label changes waiting
        for the activation lock here or there let it go first while it holds the turn."""
        if not self._operator_lock.acquire(blocking=False):
            raise ActivationInProgress(f"another activation or rollback is in progress: {self._operator or 'starting'}")
        try:
            self._operator = what
            with ExitStack() as turn:
                if self.remembered is not None:
                    try:
                        turn.enter_context(self.remembered.operator_turn())
                    except StateBusy as exc:
                        raise ActivationInProgress(str(exc)) from None
                yield
        finally:
            self._operator = None
            self._operator_lock.release()
