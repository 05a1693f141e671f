"""Which bundle is serving: loading, validation, atomic swap, drain and release.

Every request takes a lease (service.api.leases) on the active `Engine` and keeps it until its
answer is built, so a swap never changes the bundle under a request. The retired engine is
closed once its last lease is returned (or after a drain timeout).

Label changes (service.engine.label_changes) derive a new bundle from the active one into the
state directory and activate it through the same path as any activation: one way for a new
version to serve. They run one at a time, in the order they arrived, on their own thread.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from service.api.activation import (
    ActivationFailed,
    ActivationGate,
    ActivationInProgress,
    BundleNotFound,
    expect_active,
    record_no_history,
    roll_back,
    starting_version,
    with_previous,
)
from service.api.active_state import ACTIVE_FILE, ActiveVersionFile, StateUnavailable
from service.api.events import log_event
from service.api.leases import Engine, Lease, NoBundle
from service.api.quality_gate import check_quality
from service.engine import heap
from service.engine.bundle import Bundle, drop_cached_pages
from service.engine.file_guard import check_files
from service.engine.isolated import check_in_child
from service.engine.label_changes import ChangeReport, LabelChange, LabelEditor
from service.engine.label_ledger import IdRecord, LabelLedger, Unconfirmed
from service.engine.label_lookup import LabelStatus, look_up
from service.engine.predictor import Predictor, PredictorOptions
from service.engine.schema import BundleError, validate_version_name
from service.engine.store import DERIVED_DIR, BundleStore, StoredBundle

log = logging.getLogger("shortlist.registry")


class LabelChangesUnavailable(Exception):
    """No state directory to write derived bundles to (HTTP 409)."""


class TooManyPendingChanges(Exception):
    """The queue of label changes is full (HTTP 429)."""


def _newest_or_none(store: BundleStore) -> str | None:
    """The version `activate(None)` picks, or None when there is none."""
    try:
        return store.newest_version()
    except BundleError:
        return None


def _lower_priority(nice: int) -> None:
    # Linux keeps a nice value per thread, and setpriority() given a thread id renices only
    # that thread; elsewhere this is a no-op and loads run at the serving threads' priority.
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:
        log.warning("could not lower the bundle loader's priority: %s", exc)


def _check_parent(engine: Engine) -> None:
    """The serving version's files as it loaded them, before a label change reads them: BundleChanged
    for one written in place, BundleError naming one removed or replaced (its maps serve on, but
    a change links and reads the files themselves)."""
    if engine.changed is not None:
        raise engine.changed
    gone = check_files(engine.bundle)
    if gone:
        more = f"; and {len(gone) - 3} more files" if len(gone) > 3 else ""
        raise BundleError(f"cannot derive a label change from the served version {engine.version}: "
                          f"{'; '.join(gone[:3])}{more}; activate a version whose files are all there")


def _parent_fault(exc: OSError, parent: Bundle) -> BundleError | None:
    """An error reading a file of the version a change derives from (one path, in its directory)
    is that version's fault, not the state directory's (a write there names its own path)."""
    if exc.filename is None or exc.filename2 is not None:
        return None
    path = Path(os.fsdecode(exc.filename))
    if path.parent.resolve() != parent.path.resolve():
        return None
    return BundleError(f"{path}: cannot be read from the served version {parent.version} ({exc.strerror}); "
                       "activate a version whose files are all there")


class BundleRegistry:
    def __init__(
        self,
        root: str | Path | BundleStore,
        *,
        engine_threads: int = 1,
        quality_gate_min_p1: float | None = None,
        drain_timeout_s: float = 30.0,
        on_swap: Callable[[str | None, str], None] | None = None,
        loader_nice: int = 0,
        remembered: ActiveVersionFile | None = None,
        check_timeout_s: float | None = 600.0,
        editor: LabelEditor | None = None,
        max_pending_changes: int = 64,
        preloaded: Bundle | None = None,
        keep_derived_versions: int | None = None,
        activation_lock_wait_s: float = 60.0,
    ) -> None:
        self.store = root if isinstance(root, BundleStore) else BundleStore(root)
        # Derived versions kept beyond those in use after each activation (None: all, for ever).
        self.keep_derived_versions = keep_derived_versions
        # A bundle opened and checked by the process this one was forked from (service.api.supervisor):
        # the first load of its directory serves it, sharing its pages; any other load closes it.
        self._preloaded = preloaded
        self.editor = editor or LabelEditor()
        self.max_pending_changes = max_pending_changes
        self._pending_changes = 0
        self._pending_lock = threading.Lock()
        # One thread: label changes apply one at a time, in the order they were submitted.
        self._changes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="label-changes",
                                           initializer=_lower_priority, initargs=(loader_nice,))
        # None: bundles load into this process without a checking process first.
        self.check_timeout_s = check_timeout_s
        self.remembered = remembered
        self.engine_threads = engine_threads
        self.quality_gate_min_p1 = quality_gate_min_p1
        self.drain_timeout_s = drain_timeout_s
        self.on_swap = on_swap
        # Set by a ProcessGroup: waits until every process serves a version this one activated;
        # the versions the processes sharing the state directory serve.
        self.converge: Callable[[str], dict[str, object]] | None = None
        self.served_by_processes: Callable[[], set[str]] | None = None
        self._active: Engine | None = None
        self._history: list[str] = []  # previously active versions, most recent last
        self._gate = ActivationGate(self.remembered)
        # How long an activation or rollback waits for the activation lock held by another section.
        self.activation_lock_wait_s = activation_lock_wait_s
        if engine_threads > 1 and loader_nice > 0:
            # onnxruntime's intra-op threads are started by the thread that makes the session
            # (the loader) and would inherit its nice value while serving.
            log.info("engine_threads > 1: bundle loads run at normal priority")
            loader_nice = 0
        # Loading a bundle costs ~0.5 s of CPU (checksums, onnxruntime session, index copy);
        # on the loader's own low-priority threads that CPU goes to requests first. Several
        # threads, so a concurrent activation reaches the lock and gets its 409 at once.
        self._loader = ThreadPoolExecutor(max_workers=8, thread_name_prefix="bundle-loader",
                                          initializer=_lower_priority, initargs=(loader_nice,))

    def in_loader(self, fn: Callable[..., object], *args: object) -> Future:
        """Run fn(*args) (activate, rollback, list, close) on a bundle-loader thread."""
        return self._loader.submit(fn, *args)

    # -- serving side -------------------------------------------------------------------

    @property
    def active(self) -> Engine | None:
        return self._active

    @property
    def active_version(self) -> str | None:
        engine = self._active
        return engine.version if engine is not None else None

    def lease(self) -> AbstractContextManager[Engine]:
        """The active engine, guaranteed not to be closed until the block exits."""
        return Lease(lambda: self._active)

    def look_up_label(self, uid: str) -> tuple[str, LabelStatus | None]:
        """The active version and its label `uid` (label_lookup). Raises NoBundle, BundleChanged."""
        with self.lease() as engine:
            engine.bundle.check_maps()
            return engine.version, look_up(engine.bundle, uid)

    # -- admin side ---------------------------------------------------------------------

    def list(self) -> list[tuple[StoredBundle, bool]]:
        """(bundle, is active) for every readable bundle of every place, oldest first."""
        active = self.active_version
        return [(b, b.version == active) for b in self.store.list()]

    def submit_label_change(self, change: LabelChange, expected_active: str | None = None) -> Future:
        """Queue `change` behind those already waiting; the future gives change_labels' result
        (`expected_active`: change_labels').

        Raises LabelChangesUnavailable without a state directory, TooManyPendingChanges when
        max_pending_changes are waiting (a change is never dropped once accepted)."""
        if self.store.derived_root is None:
            raise LabelChangesUnavailable("label changes need a state directory (SHORTLIST_STATE_DIR) to write "
                                          "the bundles they make")
        with self._pending_lock:
            if self._pending_changes >= self.max_pending_changes:
                raise TooManyPendingChanges(f"{self._pending_changes} label changes are waiting; retry shortly")
            self._pending_changes += 1
        try:
            future = self._changes.submit(self._change_in_state_dir, change, expected_active)
        except RuntimeError:  # shut down
            self._change_done(None)
            raise NoBundle("the service is shutting down") from None
        future.add_done_callback(self._change_done)
        return future

    def _change_done(self, _future: Future | None) -> None:
        with self._pending_lock:
            self._pending_changes -= 1

    def _change_in_state_dir(self, change: LabelChange, expected_active: str | None) -> dict[str, object]:
        """change_labels, a storage error writing the new version said as StateUnavailable: the
        derive removed what it had staged, and the serving version serves on."""
        try:
            return self.change_labels(change, expected_active)
        except StateUnavailable:
            raise
        except OSError as exc:
            state_dir = self.store.derived_root.parent if self.store.derived_root is not None else Path()
            raise StateUnavailable(state_dir, exc, "write the new version") from exc

    def change_labels(self, change: LabelChange, expected_active: str | None = None) -> dict[str, object]:
        """Derive a bundle from the serving one with `change` applied, write it to the state
        directory and activate it (waiting for an activation in progress, here or in another
        process sharing the state directory, never refused for it), when `expected_active` (if
        given) is the active version once this change's turn comes (expect_active). Raises
        LabelChangeRejected (nothing written), ActiveVersionChanged, ActivationFailed,
        ProcessesDiverged or NoBundle."""
        derived_root = self.store.derived_root
        if derived_root is None:
            raise LabelChangesUnavailable("label changes need a state directory (SHORTLIST_STATE_DIR)")
        ledger = LabelLedger(derived_root.parent)
        with self._exclusive(f"label change (+{len(change.add)}, -{len(change.retire)} labels)",
                             wait_s=2 * (self.check_timeout_s or 600.0), bound="twice SHORTLIST_LOAD_CHECK_TIMEOUT_S",
                             change=True):
            self._catch_up()
            expect_active(expected_active, self._current(), "no label was changed")
            try:
                with self.lease() as engine:
                    _check_parent(engine)
                    try:
                        report = self._derive(engine.bundle, change, derived_root, ledger)
                    except OSError as exc:
                        fault = _parent_fault(exc, engine.bundle)
                        if fault is None:
                            raise
                        raise fault from exc
                log_event("label_change_written", parent=report.parent, version=report.version, added=report.added,
                          retired=report.retired, seconds=round(report.seconds, 3))
                history = with_previous(self._history, self._current(), report.version)
                result = self._converged(self._activate_locked(report.version, history=history, cause="label_change"))
            finally:
                try:
                    self._settle_unconfirmed(ledger)  # confirmed if activated, else set aside
                except StateUnavailable as exc:  # left to the next section; not this change's outcome
                    log.error("%s", exc)
        return {**result, "change": report}

    def _derive(self, parent: Bundle, change: LabelChange, derived_root: Path, ledger: LabelLedger) -> ChangeReport:
        """The change's version written to the state directory, given the ids and uids no version
        of its base has given out, and marked unconfirmed before it is renamed into place."""
        lineage = parent.manifest.lineage
        base = lineage.base if lineage else parent.version
        version = self.store.derived_version(base)
        record = ledger.current(base, parent.manifest.tree_labels, parent.labels, lambda: self.store.lineage_of(base))

        def reserve() -> None:
            ledger.mark(Unconfirmed(version, base, record.first_id, keep=len(record.uids)))
            ledger.write(IdRecord(base, record.first_id, record.uids + tuple(lab.uid for lab in change.add)))

        return self.editor.derive(parent, change, derived_root, version,
                                  record.given_out_past(len(parent.labels)), before_commit=reserve)

    def _settle_unconfirmed(self, ledger: LabelLedger, *, change: bool = False) -> None:
        """Under the activation lock, before anything changes active.json: a version marked
        unconfirmed (label_ledger) is confirmed when the record (or, without one, this registry)
        names it active or in the history; otherwise it was never activated, and is set aside with
        its ids taken back. A mark that stays (a record that cannot be read, a mark that cannot be
        removed) is StateUnavailable for a `change` (its own mark would replace this one) and for
        any section when the record names its version (a rollback would drop it from the history)."""
        pending = ledger.unconfirmed()
        if pending is None:
            return
        if self.remembered is not None:
            recorded, history = self.remembered.read(), self.remembered.history()
            if recorded is None and self.remembered.path.exists():
                log.error("version %s is unconfirmed and %s cannot be read: it stays marked", pending.version,
                          self.remembered.path)
                if change:  # why: the record's own problem, as read() logged it (the last one it kept)
                    why = OSError(errno.EIO, self.remembered.problem or "it cannot be read")
                    raise StateUnavailable(ledger.state_dir, why, (
                        f"tell whether the unconfirmed label change {pending.version} was activated, since "
                        f"{ACTIVE_FILE} cannot be read (fix or remove it)"))
                return
        else:
            recorded, history = self.active_version, self._history
        activated = pending.version in (recorded, *history)
        try:
            if not activated:
                where = ledger.state_dir / DERIVED_DIR / pending.version
                if where.is_dir():
                    log_event("label_change_set_aside", logging.WARNING, version=pending.version,
                              moved_to=str(ledger.quarantine(where, self.keep_derived_versions)),
                              message=f"label change {pending.version} was never activated (the service stopped "
                                      "before it was recorded)")
                ledger.undo(pending)
            ledger.confirm()
        except OSError as exc:
            log.error("could not settle the unconfirmed version %s: %s", pending.version, exc)
            if change or activated:
                raise StateUnavailable(ledger.state_dir, exc,
                                       f"settle the unconfirmed label change {pending.version}") from None

    def _confirm_recorded(self, version: str) -> None:
        """`version` was just recorded active: if a change's mark names it, it is confirmed for
        good (later rollbacks drop it from the history, and a later settle must not take it for
        one never activated). Best effort: a mark left names a version the record names, which
        the next exclusive section confirms before it changes the record."""
        if self.store.derived_root is None:
            return
        ledger = LabelLedger(self.store.derived_root.parent)
        pending = ledger.unconfirmed()
        if pending is not None and pending.version == version:
            try:
                ledger.confirm()
            except OSError as exc:
                log.error("could not confirm the label change %s now active: %s", version, exc)

    def _catch_up(self) -> None:
        """Serve the recorded version before deriving from it: another process sharing the state
        directory may have activated (or changed labels) since this one last followed, and a
        change derived from an older version would undo that one."""
        recorded = self.remembered.read() if self.remembered is not None else None
        if recorded is not None and recorded != self.active_version:
            self._activate_locked(recorded, history=self._history, follow=True, cause="follow")

    @contextmanager
    def _exclusive(self, what: str, *, shared_state: bool = True, wait_s: float | None = None,
                   bound: str = "SHORTLIST_ACTIVATION_LOCK_WAIT_S", change: bool = False) -> Iterator[None]:
        """The activation lock for `what` (ActivationGate.exclusive: at once, or waiting up to
        `wait_s`, then ActivationLockBusy naming `bound`). A section that may change the record
        (`shared_state`) first settles a change's mark (_settle_unconfirmed; `change`: for a label
        change): its version may be recorded active now and not after this section."""
        with self._gate.exclusive(what, shared_state=shared_state, wait_s=wait_s, bound=bound,
                                  change=change) as history:
            if history is not None:
                self._history = history
            if shared_state and self.store.derived_root is not None:
                self._settle_unconfirmed(LabelLedger(self.store.derived_root.parent), change=change)
            yield

    @contextmanager
    def _operator_turn(self, what: str) -> Iterator[None]:
        """The activation lock for an activation or rollback (`what`), taken ahead of the label
        changes waiting for it (ActivationGate.operator_turn), after at most
        activation_lock_wait_s of waiting for the section holding it (ActivationLockBusy)."""
        with self._gate.operator_turn(what), self._exclusive(what, wait_s=self.activation_lock_wait_s):
            yield

    def activate(self, version: str | None = None) -> dict[str, object]:
        """Load, validate and swap in `version` (default: the newest bundle of any place). The
        version this process serves and the state directory records is left as it is: nothing
        loaded, nothing pushed onto the rollback history (the result's "unchanged"). Start-up's
        first load is `start`'s, which leaves a record naming the version it serves as it is (its
        activated_at is the operator's activation, not this restart's).

        Raises ActivationInProgress (another activation or rollback is in progress),
        ActivationLockBusy (_operator_turn), BundleNotFound, ActivationFailed or StateUnavailable;
        on any failure the active bundle is untouched.
        """
        with self._operator_turn(f"activation of {version or 'the newest bundle'}"):
            wanted = version if version is not None else _newest_or_none(self.store)
            current = self._current()
            changed = self._active is not None and self._active.changed is not None  # loaded again, checked
            if wanted is not None and wanted == current == self.active_version and not changed:
                return self._converged({"active": wanted, "previous": wanted, "seconds": 0.0, "quality": {},
                                        "unchanged": True})
            history = with_previous(self._history, current, wanted)
            return self._converged(self._activate_locked(wanted, history=history, cause="activate"))

    def _current(self) -> str | None:
        """What an activation replaces: the recorded version (another process sharing the state
        directory may have activated it since this one last followed), None while this process
        serves nothing (start-up: a recorded version that failed to load is not history)."""
        if self.active_version is None:
            return None
        recorded = self.remembered.read() if self.remembered is not None else None
        return recorded or self.active_version

    def rollback(self, expected_active: str | None = None) -> dict[str, object]:
        """Serve the most recent previously active version that still loads (roll_back), when
        `expected_active` (if given) is the active version (expect_active)."""
        with self._operator_turn("rollback"):
            expect_active(expected_active, self._current())
            result, skipped = roll_back(self._history, lambda version, rest: self._activate_locked(
                version, history=rest, cause="rollback"), self._forget_history, self._current())
            return {**self._converged(result), "skipped": skipped}

    def _forget_history(self) -> None:
        self._history = []
        record_no_history(self.remembered, self.active_version)

    def follow(self, version: str) -> dict[str, object]:
        """Serve `version`, which another process sharing the state directory activated (it has
        checked, gated and recorded it): load and swap only."""
        with self._exclusive(f"following {version}, activated by another process", shared_state=False):
            return self._activate_locked(version, history=self._history, follow=True, cause="follow")

    def _converged(self, result: dict[str, object]) -> dict[str, object]:
        """The activation's result, once every process sharing the state directory serves it."""
        if self.converge is None:
            return result
        return {**result, "processes": self.converge(str(result["active"]))}

    def _activate_locked(self, version: str | None, *, history: list[str], cause: str, follow: bool = False,
                         record: bool = True, starting: bool = False) -> dict[str, object]:
        """Load, check (unless `follow`: another process did) and swap in `version`; record it
        in the state directory unless `follow` or not `record` (or `starting` and recorded already).
        `cause` (activate, rollback, label_change, start, fallback, follow) goes into its event line."""
        record = record and not follow
        t0 = time.perf_counter()
        path = self._resolve(version)
        try:
            predictor = self._load(path, check=not follow)
            quality = {} if follow else self._quality_gate(predictor)
        except ActivationFailed:
            drop_cached_pages(path)  # nothing will serve what the checks read
            raise
        if record:
            self._remember(predictor, history, starting)
            self._confirm_recorded(predictor.bundle.version)
        self._history = history
        new = Engine(predictor.bundle, predictor)
        old = self._active
        self._active = new  # the swap: one reference assignment
        if old is not None:
            old._retire()
            threading.Thread(target=self._drain_and_close, args=(old,), daemon=True).start()
        else:
            heap.trim()  # the load's buffers; otherwise the release of `old` trims
        if record:
            self._prune_derived({new.version, *history, *([old.version] if old else [])})
        seconds = time.perf_counter() - t0
        if self.on_swap is not None:
            self.on_swap(old.version if old else None, new.version)
        log_event("bundle_activated", version=new.version, previous=old.version if old else None, cause=cause,
                  recorded=record and self.remembered is not None, seconds=round(seconds, 3), pid=os.getpid())
        return {"active": new.version, "previous": old.version if old else None, "seconds": seconds,
                "quality": quality}

    def start(self, configured: str | None = None, *, fall_back: bool = True) -> dict[str, object]:
        """The first activation: the remembered version (the operator's last choice), else
        `configured`, else the newest bundle; if that one cannot be served, with `fall_back` the
        newest bundle that can (the result's "fallback_from" names what was wanted and "reason"
        why not). Processes sharing a state directory start one after another, each serving what
        the one before it chose."""
        deadline = time.monotonic() + 2 * (self.check_timeout_s or 600.0)
        while True:
            try:
                return self._start(configured, fall_back)
            except ActivationInProgress:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _start(self, configured: str | None, fall_back: bool) -> dict[str, object]:
        # The activation lock (which settles a change's mark), not an operator's turn: an
        # activation or rollback sent while a restarted process loads waits for it (up to
        # ACTIVATION_LOCK_WAIT_S) instead of answering 409 as if another operator were at work.
        with self._exclusive("start-up: loading the first bundle"):
            for stored in self.store.list():
                if stored.shadowed:  # said once here; every activation of the version says it again
                    log.warning("%s", self.store.shadow_message(stored.version))
            wanted = starting_version(self.remembered, configured)
            try:
                return self._activate_locked(wanted, history=self._history, starting=True, cause="start")
            except (ActivationFailed, BundleNotFound) as exc:
                if not fall_back:
                    raise
                first_error: Exception = exc
        log.error("cannot serve bundle %s: %s; falling back to the newest bundle that loads",
                  wanted or "(newest)", first_error)
        tried = wanted or _newest_or_none(self.store)
        for stored in reversed(self.store.list()):
            if stored.version == tried or stored.unconfirmed or stored.shadowed:
                continue
            try:
                result = self._serve_fallback(stored.version)
            except (ActivationFailed, BundleNotFound) as exc:
                log.error("fallback bundle %s cannot be served either: %s", stored.version, exc)
                continue
            return {**result, "fallback_from": wanted or "(newest)", "reason": str(first_error)}
        raise first_error

    def _serve_fallback(self, version: str) -> dict[str, object]:
        """Serve `version` in this process only: checked and gated as any activation, never
        recorded. A fallback is one process's stopgap, not the operator's choice: recorded, every
        process sharing the state directory would follow it (one process's failed load switching
        the whole service), and restarts would keep serving it once the wanted version loads again."""
        with self._exclusive(f"start-up, falling back to {version}", shared_state=False):
            return self._activate_locked(version, history=self._history, record=False, cause="fallback")

    def _prune_derived(self, in_use: set[str]) -> None:
        """Remove the derived versions past keep_derived_versions that nothing may serve: not
        `in_use` (the active version, the rollback history, the one draining) nor served by a
        process sharing the state directory. Under the activation lock, so no activation
        elsewhere picks one meanwhile; a failure is logged, never the activation's."""
        if self.keep_derived_versions is None or self.store.derived_root is None:
            return
        try:
            served = self.served_by_processes() if self.served_by_processes is not None else set()
            self.store.prune_derived(self.keep_derived_versions, in_use | served)
        except (OSError, BundleError) as exc:
            log.warning("could not remove old derived versions: %s", exc)

    def _remember(self, predictor: Predictor, history: list[str], starting: bool = False) -> None:
        """Record the version about to serve before it does: served is always remembered. At
        start-up a record that already says so is not written again (audit 7 F5: every restart
        rewrote activated_at). Any other activation writes, even an unchanged record: processes
        sharing the directory take a new write as "activated again" (processes._activated_again)."""
        if self.remembered is None or starting and self.remembered.records(predictor.bundle.version, history):
            return
        try:
            self.remembered.write(predictor.bundle.version, history)
        except StateUnavailable:
            predictor.bundle.close()
            raise

    def _resolve(self, version: str | None) -> Path:
        """The directory of `version` (default: the newest bundle of any place)."""
        if version is None:
            try:
                version = self.store.newest_version()
            except BundleError as exc:
                raise BundleNotFound(str(exc)) from exc
        try:
            validate_version_name(version)
        except BundleError as exc:
            raise ActivationFailed(str(exc)) from exc
        try:
            return self.store.resolve(version)
        except BundleError as exc:
            if "no bundle" in str(exc):
                raise BundleNotFound(str(exc)) from exc
            raise ActivationFailed(str(exc)) from exc

    def _load(self, path: Path, *, check: bool = True) -> Predictor:
        preloaded, self._preloaded = self._preloaded, None
        if preloaded is not None and preloaded.path != path:
            preloaded.close()
            preloaded = None
        try:
            if preloaded is not None:  # checked in a child before the forking process opened it
                return Predictor.checked(preloaded, PredictorOptions(threads=self.engine_threads))
            limit = self.store.max_manifest_bytes
            if check and self.check_timeout_s is not None:
                check_in_child(path, threads=self.engine_threads, timeout_s=self.check_timeout_s,
                               max_manifest_bytes=limit)
            return Predictor.load(path, PredictorOptions(threads=self.engine_threads), max_manifest_bytes=limit)
        except BundleError as exc:
            raise ActivationFailed(str(exc)) from exc

    def _quality_gate(self, predictor: Predictor) -> dict[str, float]:
        return {} if self.quality_gate_min_p1 is None else check_quality(predictor, self.quality_gate_min_p1)

    def _drain_and_close(self, engine: Engine) -> None:
        if not engine._drained.wait(self.drain_timeout_s):
            log.warning("bundle %s still had requests after %.0fs; closing it", engine.version,
                        self.drain_timeout_s)
        engine._close()
        del engine
        # No gc.collect() here: a full collection holds the GIL for tens of ms and stalls
        # serving; the bundle's arrays and indices are freed by reference counting.
        # Freed index memory (hnswlib, onnxruntime arenas) stays in glibc's heap unless
        # trimmed; without this, alternating activations look like a leak in RSS.
        heap.trim()

    def close(self) -> None:
        preloaded, self._preloaded = self._preloaded, None
        if preloaded is not None:
            preloaded.close()
        engine, self._active = self._active, None
        if engine is not None:
            engine._retire()
            self._drain_and_close(engine)
        self._changes.shutdown(wait=False, cancel_futures=True)
        self._loader.shutdown(wait=False, cancel_futures=True)
