"""Label-sharded serving on Ray Serve: one ingress deployment, one deployment per shard.

The ingress serves the same FastAPI app as `shortlist serve` (service.api.app.create_app: routes,
schemas, errors, metrics, admin), answering predictions by fanning out: it encodes each query
once (service.engine.query), sends the encoded query (q, token ids and weights) to every shard
deployment through deployment handles, and merges the shards' top k by score
(service.engine.sharding). A shard deployment is a Predictor over a shard bundle; its replicas
are Ray Serve's (placed, restarted and routed to by Serve).

Activation is all-or-nothing, in two phases: (1) the new version's shards are deployed beside the
serving ones, as Serve applications of their own (one per shard), and Serve starts every replica,
each loading and checking its shard bundle in its constructor (Predictor.load: checksums,
structure, canaries); a replica that fails is retried by Serve and leaves its application
DEPLOY_FAILED; the ingress then checks that the shards belong together (one parent, indices
0..N-1, every label once); (2) only when every shard of the new version is RUNNING and fits, the
ingress switches to it, in one reference assignment, and the old version's applications are
deleted once their requests have drained. Any failure in (1) deletes what (1) started: the old
version keeps serving on every shard.

The ingress is one replica: it is where a version becomes the served one. The shards scale by
replicas. The tree scorer is not sharded: /v1/predict/tree answers 409.

Only this module and service.api.ray_shards (the shard replicas, a version's fan-out) import Ray
(the `ray` extra): `shortlist serve` runs without it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import ApplicationStatus

from service.api.activation import (
    ActivationFailed,
    ActivationInProgress,
    BundleNotFound,
    exclusive_activation,
    expect_active,
    record_no_history,
    roll_back,
    starting_version,
    with_previous,
)
from service.api.active_state import ActiveVersionFile, StateUnavailable
from service.api.app import apply_runtime_tuning, create_app, note_start, note_start_failed
from service.api.dependencies import MinuteBudget, ServiceState
from service.api.events import log_event
from service.api.leases import lease
from service.api.observability import ServiceMetrics, setup_logging
from service.api.quality_gate import require_quality
from service.api.ray_settings import refuse_unapplied
from service.api.ray_shards import (
    SHARD_DEPLOYMENT,
    ShardedEngine,
    ShardReplica,
    answer_sharded,
    shards_readiness,
    why_failed,
)
from service.api.registry import LabelChangesUnavailable
from service.api.schemas import RequestModels
from service.api.settings import Settings, load_settings
from service.engine.manifests import read_manifest
from service.engine.query import QueryEncoder
from service.engine.schema import BundleError, validate_version_name
from service.engine.sharding import (
    check_shard_set,
    merge_gate_rows,
    shard_dirs,
    sharded_versions,
    union_token_rows,
)
from service.engine.store import StoredBundle

log = logging.getLogger("shortlist.ray")
_POLL_S = 0.25


class RayServing(BaseModel):
    """How the application is laid out on Ray (the builder's arguments; `serve-ray` flags).

    num_cpus are Ray's scheduling reservations, not limits: with fractions, the ingress and every
    shard replica of two versions (an activation holds both for a while) fit on a small machine.
    """

    model_config = ConfigDict(extra="forbid")

    bundle_root: str
    version: str | None = None
    state_dir: str | None = None
    shards: int = Field(ge=1, le=4096)
    replicas: int = Field(1, ge=1, le=1024, description="replicas of each shard deployment")
    shard_num_cpus: float = Field(0.1, gt=0.0, le=64.0)
    ingress_num_cpus: float = Field(0.2, gt=0.0, le=64.0)
    # Requests a shard replica works on at once (its engine calls run on Serve's thread pool).
    shard_max_ongoing_requests: int = Field(8, ge=1, le=1024)
    # How long phase 1 may take: every replica of every shard loaded and checked.
    load_timeout_s: float = Field(600.0, gt=0.0)
    # A shard call that fails because its replica died is sent again (Serve routes it to a live
    # replica) this many times: reads are safe to repeat.
    shard_retries: int = Field(2, ge=0, le=10)


class ShardedRegistry:
    """Which sharded version serves, with the admin interface of service.api.registry.BundleRegistry
    (activate, rollback, list, lease), over Ray Serve applications."""

    def __init__(self, layout: RayServing, settings: Settings, app_prefix: str, loop: asyncio.AbstractEventLoop,
                 on_swap: Callable[[str | None, str], None] | None = None) -> None:
        self.root = Path(layout.bundle_root)
        # The ingress's event loop: deployment handles are called on it (with Ray's low-latency
        # layout a handle's router runs on the loop of its first call, not on a thread of its own).
        self.loop = loop
        self.layout = layout
        self.settings = settings
        self.app_prefix = app_prefix
        self.on_swap = on_swap
        # The settings', not the layout's: SHORTLIST_STATE_DIR sets it when --state-dir does not.
        self.remembered = ActiveVersionFile(settings.state_dir) if settings.state_dir else None
        if self.remembered is not None:
            self.remembered.prepare()
        self._active: ShardedEngine | None = None
        self._history: list[str] = []
        self._activation_lock = threading.Lock()
        self._loader = ThreadPoolExecutor(max_workers=4, thread_name_prefix="shard-loader")

    def in_loader(self, fn: Callable[..., object], *args: object) -> Future:
        return self._loader.submit(fn, *args)

    @property
    def active(self) -> ShardedEngine | None:
        return self._active

    @property
    def active_version(self) -> str | None:
        engine = self._active
        return engine.version if engine is not None else None

    def submit_label_change(self, change: object, expected_active: str | None = None) -> NoReturn:
        """Labels are changed on the parent bundle, which is then sharded again (HTTP 409)."""
        raise LabelChangesUnavailable("the sharded service does not change labels: change the parent bundle "
                                      "(shortlist labels add|remove) and shard it again")

    def lease(self) -> AbstractContextManager[ShardedEngine]:
        return lease(lambda: self._active)

    def look_up_label(self, uid: str) -> NoReturn:
        """Labels are looked up on the parent bundle's service (HTTP 409)."""
        raise LabelChangesUnavailable("the sharded service does not look up labels: serve the parent bundle "
                                      "(shortlist serve) to look them up, or read its labels.jsonl")

    def list(self) -> list[tuple[StoredBundle, bool]]:
        """(the version as shard 0 describes its parent; is active), oldest first: the versions
        sharded into as many shards as this service serves (no other could serve here, nor be
        the newest it falls back to)."""
        out = []
        for version, _ in sharded_versions(self.root):
            try:
                m = read_manifest(shard_dirs(self.root / version)[0], self.settings.max_manifest_bytes)
            except BundleError:
                continue
            if m.shard is not None and m.shard.count == self.layout.shards:
                parent = m.model_copy(update={"version": version, "num_labels": m.shard.parent_num_labels})
                out.append((StoredBundle(parent, self.root / version, "root"), version == self.active_version))
        return sorted(out, key=lambda item: (item[0].manifest.created, item[0].version))

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        with exclusive_activation(self._activation_lock, self.remembered, "serve-ray: activating a bundle") as history:
            if history is not None:
                self._history = history
            yield

    def activate(self, version: str | None = None, *, cause: str = "activate",
                 record: bool = True) -> dict[str, object]:
        with self._exclusive():
            version = version if version is not None else self._resolve(None)  # the newest
            if version == self.active_version:
                return {"active": version, "previous": version, "seconds": 0.0, "quality": {}, "unchanged": True}
            return self._activate_locked(version, with_previous(self._history, self.active_version, version),
                                         cause=cause, record=record)

    def rollback(self, expected_active: str | None = None) -> dict[str, object]:
        """Serve the most recent previously active version that still loads (registry.roll_back),
        when `expected_active` (if given) is the active version (activation.expect_active)."""
        with self._exclusive():
            expect_active(expected_active, self.active_version)
            result, skipped = roll_back(
                self._history, lambda version, rest: self._activate_locked(version, rest, cause="rollback"),
                self._forget_history, self.active_version)
            return {**result, "skipped": skipped}

    def _forget_history(self) -> None:
        self._history = []
        record_no_history(self.remembered, self._active.version if self._active is not None else None)

    def start(self, configured: str | None = None) -> dict[str, object]:
        """The remembered version, else `configured`, else the newest; if that one cannot serve,
        the newest that can (with "fallback_from" and "reason")."""
        wanted = starting_version(self.remembered, configured)
        try:
            return self.activate(wanted, cause="start")
        except (ActivationFailed, BundleNotFound) as exc:
            first_error: Exception = exc
        log.error("cannot serve %s: %s; falling back to the newest version that loads", wanted or "(newest)",
                  first_error)
        listed = [stored.manifest.version for stored, _ in self.list()]  # by creation, as "newest" is
        tried = wanted or (listed[-1] if listed else None)
        for version in reversed(listed):
            if version == tried:
                continue
            try:  # not recorded, as serve's fallback: a restart tries the operator's choice again
                result = self.activate(version, cause="fallback", record=False)
            except (ActivationFailed, BundleNotFound) as exc:
                log.error("fallback version %s cannot be served either: %s", version, exc)
                continue
            return {**result, "fallback_from": wanted or "(newest)", "reason": str(first_error)}
        raise first_error

    def _activate_locked(self, version: str | None, history: list[str], *, cause: str,
                         record: bool = True) -> dict[str, object]:
        """`cause` (start, activate, rollback, fallback) goes into the bundle_activated event, as
        serve's registry says it."""
        t0 = time.perf_counter()
        engine, quality = self._deploy(self._resolve(version))  # phase 1: every shard loaded and checked
        # A restart leaves a record that already names what it serves as it is: its activated_at
        # is the operator's activation (as serve's registry._remember).
        if record and self.remembered is not None and not (
                cause == "start" and self.remembered.records(engine.version, history)):
            try:
                self.remembered.write(engine.version, history)
            except StateUnavailable:
                self._delete_apps(engine.apps)
                raise
        self._history = history
        old, self._active = self._active, engine  # phase 2: the switch
        if old is not None:
            old._retire()
            threading.Thread(target=self._drain_and_delete, args=(old,), daemon=True).start()
        seconds = time.perf_counter() - t0
        if self.on_swap is not None:
            self.on_swap(old.version if old else None, engine.version)
        log_event("bundle_activated", version=engine.version, previous=old.version if old else None, cause=cause,
                  recorded=record and self.remembered is not None, seconds=round(seconds, 3), pid=os.getpid())
        return {"active": engine.version, "previous": old.version if old else None, "seconds": seconds,
                "quality": quality}

    def _resolve(self, version: str | None) -> str:
        if version is None:
            listed = self.list()  # oldest first
            if not listed:
                raise BundleNotFound(f"no sharded version under {self.root.resolve()}")
            return listed[-1][0].version
        try:
            validate_version_name(version)
        except BundleError as exc:
            raise ActivationFailed(str(exc)) from exc
        if not (self.root / version).is_dir():
            raise BundleNotFound(f"no sharded version {version!r} under {self.root.resolve()}")
        return version

    def _deploy(self, version: str) -> tuple[ShardedEngine, dict[str, float]]:
        """Phase 1: the shard applications of `version` started and RUNNING, their shards checked
        to belong together, and past the quality gate when one is set (its scores returned);
        ActivationFailed (and the applications deleted) otherwise."""
        layout = self.layout
        try:
            dirs = shard_dirs(self.root / version)
            if len(dirs) != layout.shards:
                raise BundleError(f"{self.root / version}: {len(dirs)} shards, this service serves {layout.shards}")
            encoder = QueryEncoder.open(dirs[0], self.settings.engine_threads,
                                        max_manifest_bytes=self.settings.max_manifest_bytes)
        except BundleError as exc:
            raise ActivationFailed(str(exc)) from exc
        nonce = uuid.uuid4().hex[:8]
        apps = [f"{self.app_prefix}.{version}.{nonce}.shard-{i}" for i in range(len(dirs))]
        deployment = ShardReplica.options(
            num_replicas=layout.replicas, max_ongoing_requests=layout.shard_max_ongoing_requests,
            ray_actor_options={"num_cpus": layout.shard_num_cpus})
        try:
            targets = [serve.RunTarget(deployment.bind(str(d), self.settings.engine_threads,
                                                         self.settings.max_manifest_bytes), name=name,
                                       route_prefix=None) for d, name in zip(dirs, apps, strict=True)]
            serve.run_many(targets, wait_for_ingress_deployment_creation=False,
                           wait_for_applications_running=False)
            self._wait_running(apps)
            handles = [serve.get_deployment_handle(SHARD_DEPLOYMENT, app_name=name) for name in apps]
            parent = check_shard_set(self._call_all(handles, "info"))
            if parent.parent_version != version:
                raise BundleError(f"{self.root / version}: its shards are of {parent.parent_version}")
            texts = self._call_all(handles, "canary_texts")
            self._call_all(handles, "check_canaries", [(encoder(t),) for t in texts])
            rows = self._call_all(handles, "token_rows")
            token_rows = union_token_rows(rows, encoder.tokenizer.vocab_size)
            engine = ShardedEngine(version, encoder, handles, apps, parent, token_rows, layout.shard_retries,
                                   self.settings.shard_timeout_s)
            return engine, self._quality_gate(engine)
        except Exception as exc:
            self._delete_apps(apps)
            if isinstance(exc, ActivationFailed):
                raise
            raise ActivationFailed(f"{version}: {type(exc).__name__}: {exc}") from exc

    def _quality_gate(self, engine: ShardedEngine) -> dict[str, float]:
        """QUALITY_GATE_MIN_P1 on the validation rows the shards store, answered by the shards
        merged, as the service will answer ({} without a floor)."""
        floor = self.settings.quality_gate_min_p1
        if floor is None:
            return {}
        rows = merge_gate_rows(self._call_all(engine.handles, "gate_rows"), engine.parent)

        def top5(batch: list[str]) -> np.ndarray:
            merged = asyncio.run_coroutine_threadsafe(engine.merged(batch, 5, None, []), self.loop).result()
            return np.array([[p.id for p in row] + [-1] * (5 - len(row)) for row in merged], dtype=np.int64)

        return require_quality(str(self.root / engine.version), rows.texts, rows.truths, rows.retired, top5, floor,
                               rows.weights)

    def _call_all(self, handles: list[DeploymentHandle], method: str,
                  args: list[tuple[Any, ...]] | None = None) -> list[Any]:
        """`method` of every handle's deployment (with args[i] for handle i), called at once on the
        ingress's loop (from a loader thread), within the load timeout."""
        async def gather() -> list[Any]:
            calls = (getattr(h, method).remote(*(args[i] if args else ())) for i, h in enumerate(handles))
            return await asyncio.wait_for(asyncio.gather(*calls), self.layout.load_timeout_s)

        return asyncio.run_coroutine_threadsafe(gather(), self.loop).result()

    def _wait_running(self, apps: list[str]) -> None:
        deadline = time.monotonic() + self.layout.load_timeout_s
        seen: set[str] = set()
        while True:
            statuses = serve.status().applications
            for name in apps:
                app = statuses.get(name)
                if (app is None and name in seen) or (app is not None and app.status == ApplicationStatus.DELETING):
                    raise ActivationFailed(f"shard application {name} was deleted while it started")
                if app is None:
                    continue
                seen.add(name)
                if app.status in (ApplicationStatus.DEPLOY_FAILED, ApplicationStatus.UNHEALTHY):
                    raise ActivationFailed(f"shard application {name} is {app.status.value}: {why_failed(app)}")
            if all(name in statuses and statuses[name].status == ApplicationStatus.RUNNING for name in apps):
                return
            if time.monotonic() > deadline:
                raise ActivationFailed(f"the shards were not all running after {self.layout.load_timeout_s:.0f}s "
                                       "(not enough resources for a second copy of every shard?)")
            time.sleep(_POLL_S)

    def _delete_apps(self, apps: list[str]) -> None:
        live = serve.status().applications
        for name in apps:
            if name in live:
                serve.delete(name, _blocking=False)

    def _drain_and_delete(self, engine: ShardedEngine) -> None:
        if not engine._drained.wait(self.settings.drain_timeout_s):
            log.warning("version %s still had requests after %.0fs; deleting its shards", engine.version,
                        self.settings.drain_timeout_s)
        self._delete_apps(engine.apps)

    def left_behind(self) -> list[str]:
        """This prefix's shard applications now: before this replica deploys any (the nonce in
        every name it deploys is new), those of an ingress replica before it."""
        return [name for name in serve.status().applications if name.startswith(f"{self.app_prefix}.")]

    def delete_stale(self, stale: list[str]) -> None:
        """Delete `stale` (left_behind() before this replica's start) after the drain time their
        requests may still need."""
        time.sleep(self.settings.drain_timeout_s)
        self._delete_apps(stale)

    def close(self) -> None:
        """Stop serving; the active version's shard applications are deleted with this replica
        (`serve delete` of the application leaves none behind)."""
        engine, self._active = self._active, None
        if engine is not None:
            engine._retire()
            try:
                self._delete_apps(engine.apps)
            except Exception as exc:  # noqa: BLE001  Serve itself may be shutting down: nothing left to delete
                log.warning("could not delete the shard applications of %s: %s", engine.version, exc)
        self._loader.shutdown(wait=False, cancel_futures=True)


@serve.ingress()
class ShardedIngress:
    """The HTTP face: service.api.app's app over a ShardedRegistry. Its constructor serves the
    remembered / configured / newest version before the replica reports ready."""

    async def __init__(self, layout: dict[str, Any]) -> None:
        self.layout = RayServing.model_validate(layout)
        self.settings = load_settings(settings_flags(self.layout))
        # The process's own stdout, before any event: a throughput-optimized Serve replica's
        # sys.stdout is a logger that buffers 1,000 records (RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE)
        # into Serve's replica log, so events written there came late, or never at a stop.
        setup_logging(self.settings.log_level, stream=sys.__stdout__)
        refuse_unapplied(self.settings, on_cluster=False)  # `serve deploy` too; the front's limits are its own
        metrics = ServiceMetrics()

        def on_swap(_old: str | None, new: str) -> None:
            metrics.swaps.inc()
            metrics.set_active(new)

        prefix = serve.get_replica_context().app_name
        self.registry = ShardedRegistry(self.layout, self.settings, prefix, asyncio.get_running_loop(), on_swap)
        # No EngineRunner: the sharded answer awaits its shards on the event loop.
        self.state = ServiceState(self.settings, self.registry, None, metrics,  # type: ignore[arg-type]
                                  RequestModels(self.settings),
                                  MinuteBudget(self.settings.admin_auth_failures_per_minute),
                                  MinuteBudget(self.settings.label_changes_per_minute))
        apply_runtime_tuning(self.settings)
        await self._start()

    async def _start(self) -> None:
        registry = self.registry
        stale = await asyncio.wrap_future(registry.in_loader(registry.left_behind))
        try:  # said as serve says it: /readyz names why nothing serves, events for both outcomes
            note_start(self.state, await asyncio.wrap_future(registry.in_loader(registry.start, self.settings.version)))
        except (ActivationFailed, BundleNotFound, ActivationInProgress, StateUnavailable) as exc:
            note_start_failed(self.state, exc)
        if stale:
            registry.in_loader(registry.delete_stale, stale)

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.settings, state=self.state, answer=answer_sharded, readiness=shards_readiness)

    def __del__(self) -> None:
        self.registry.close()


def build_app(args: dict[str, Any]) -> serve.Application:
    """The application: `serve run service.api.ray_app:build_app bundle_root=ROOT shards=N`, or a
    Serve config's import_path with `args` (RayServing's fields)."""
    layout = RayServing.model_validate(args)
    ingress = serve.deployment(ShardedIngress, name="ingress", num_replicas=1,
                               ray_actor_options={"num_cpus": layout.ingress_num_cpus})
    return ingress.bind(layout.model_dump())


def settings_flags(layout: RayServing) -> dict[str, tuple[str, Any]]:
    """The settings `shortlist serve-ray`'s flags set (load_settings), the environment the rest."""
    given = {"bundle_root": layout.bundle_root, "version": layout.version, "state_dir": layout.state_dir}
    return {name: (f"--{name.replace('_', '-')}", value) for name, value in given.items() if value is not None}
