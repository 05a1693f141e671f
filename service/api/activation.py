"""What every registry of the service shares about activations (service.api.registry, and the Ray
Serve app's in service.api.ray_app): their errors, the lock that makes them exclusive, and the
rollback history they record in the state directory (service.api.active_state)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from service.api.active_state import HISTORY_LENGTH, ActiveVersionFile, StateBusy

log = logging.getLogger("shortlist.registry")


class ActivationInProgress(Exception):
    """Another activation holds the lock (HTTP 409)."""


class ActivationLockBusy(ActivationInProgress):
    """The activation lock stayed held past the time a caller waits for it (HTTP 503 with
    Retry-After): what held it is named, and a retry once it is done goes through."""

    retry_after_s = 5


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
