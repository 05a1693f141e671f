"""The sharded service's request path on Ray Serve: a shard deployment's replica (a Predictor over
one shard bundle) and one served version's fan-out (ShardedEngine: encode once, ask every shard,
merge their top k as the parent answers). service.api.ray_app deploys them and swaps versions.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import re
from typing import Any

import grpc
import numpy as np
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import ApplicationStatus, ApplicationStatusOverview
from starlette.requests import Request
from starlette.responses import Response

from service.api.dependencies import ServiceState, lease_engine
from service.api.errors import ApiError
from service.api.leases import Leased
from service.api.predict import json_response, label_rows, unknown_excluded_uids
from service.engine.predictor import Prediction, PredictorOptions
from service.engine.query import QueryEncoder
from service.engine.schema import MAX_MANIFEST_BYTES, ShardOf
from service.engine.sharding import (
    GateRows,
    ShardAnswer,
    ShardPredictor,
    head_rows,
    merge_answers,
    unknown_excluded,
)

log = logging.getLogger("shortlist.ray")
SHARD_DEPLOYMENT = "shard"
# A shard call that failed in transport (the replica died under it, or Serve has none to route it
# to): retried, then a 503. Over gRPC (the low-latency layout) a replica that dies after accepting
# a call surfaces as the RPC's error or Serve's RuntimeError("Unexpected error (UNAVAILABLE) ...").
SHARD_CALL_FAILURES = (RayActorError, grpc.aio.AioRpcError, RuntimeError, ReplicaUnavailableError,
                       DeploymentUnavailableError, BackPressureError)


@serve.deployment(name=SHARD_DEPLOYMENT)
class ShardReplica:
    """A Predictor over one shard bundle (service.engine.sharding.ShardPredictor), without an
    encoder session (the ingress encodes). The constructor loads and checks the bundle's files: a
    replica that cannot serve them never starts; the ingress checks the canaries of a version
    before it serves (a replica Serve starts later, in place of one that died, loads the same
    checksummed files)."""

    def __init__(self, path: str, threads: int = 1, max_manifest_bytes: int = MAX_MANIFEST_BYTES) -> None:
        self.shard = ShardPredictor.load(path, PredictorOptions(threads=threads),
                                         max_manifest_bytes=max_manifest_bytes)

    def info(self) -> Any:
        return self.shard.info()

    def token_rows(self) -> np.ndarray | None:
        return self.shard.token_rows()

    def canary_texts(self) -> list[str]:
        return self.shard.canary_texts()

    def gate_rows(self) -> GateRows:
        return self.shard.gate_rows()

    def check_canaries(self, queries: Any) -> None:
        self.shard.check_canaries(queries)

    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> None:
        """Answers when a replica can take a call (service.api.app's /readyz)."""

    def predict(self, queries: Any, k: int, alpha: float | None, exclude: list[str],
                head: np.ndarray | None) -> ShardAnswer:
        return self.shard.predict(queries, k, alpha, exclude, head)


class ShardedEngine(Leased):
    """One version served by its shard deployments: the query encoder, a handle per shard, and the
    parent's token rows (for the head's fallback rule)."""

    def __init__(self, version: str, encoder: QueryEncoder, handles: list[DeploymentHandle], apps: list[str],
                 parent: ShardOf, token_rows: np.ndarray | None, retries: int, timeout_s: float) -> None:
        super().__init__()
        self._version = version
        self.encoder = encoder
        self.handles = handles
        self.apps = apps
        self.parent = parent
        self.token_rows = token_rows
        self.retries = retries
        self.timeout_s = timeout_s

    @property
    def version(self) -> str:
        return self._version

    async def _ask(self, handle: DeploymentHandle, *args: Any) -> ShardAnswer:
        for attempt in itertools.count():
            try:
                return await handle.predict.remote(*args)
            except RayTaskError:  # the shard's own code raised: not a transport failure
                raise
            except SHARD_CALL_FAILURES as exc:  # the replica died under the call: Serve routes the retry elsewhere
                if attempt >= self.retries:
                    raise
                log.warning("shard call failed (%s), retrying", type(exc).__name__)
        raise AssertionError("unreachable")

    async def answer(self, req: Any, alpha: float | None) -> Response:
        results = await self.merged(req.all_texts, req.k, alpha, list(req.exclude or ()))
        return json_response({"version": self.version, "results": [label_rows(r) for r in results]})

    async def merged(self, texts: list[str], k: int, alpha: float | None, exclude: list[str]) -> list[list[Prediction]]:
        """Each text's top k over every shard, as the parent answers it; ApiError 503 or 422 else."""
        # Off the event loop (a 128-text batch took 8.8 ms to encode there): the ingress goes on
        # relaying other requests' shard answers meanwhile, as serve's engine threads do.
        queries, head = await asyncio.to_thread(self._encoded, texts)
        calls = asyncio.gather(*(self._ask(h, queries, k, alpha, exclude, head) for h in self.handles))
        try:
            answers = await _within(calls, self.timeout_s)
        except TimeoutError:
            raise self._unavailable(f"not every shard answered within {self.timeout_s:g} s "
                                    "(SHORTLIST_SHARD_TIMEOUT_S)") from None
        except SHARD_CALL_FAILURES as exc:  # its retries spent
            raise self._unavailable(f"a shard call failed {self.retries + 1} times: {type(exc).__name__}") from exc
        missing = unknown_excluded(exclude, answers)
        if missing:
            raise unknown_excluded_uids(exclude, missing, self.version)
        return merge_answers(answers, k)

    def _encoded(self, texts: list[str]) -> tuple[Any, np.ndarray | None]:
        queries = self.encoder(texts)
        return queries, head_rows(self.token_rows, queries.tokens)

    async def unavailable_shard(self) -> str | None:
        """Why a shard cannot answer now, naming each shard that does not and what Serve says of
        its application (None: every shard answers a call within the shard timeout). Serve holds
        a call to a shard with no live replica until it has a new one."""
        calls = [asyncio.ensure_future(h.ping.remote()) for h in self.handles]
        done, late = await asyncio.wait(calls, timeout=self.timeout_s)
        for call in late:
            call.cancel()  # not awaited: the answer does not wait for the calls to end
        problems = []
        for index, call in enumerate(calls):
            if call in late:
                problems.append((index, f"no answer within {self.timeout_s:g} s (SHORTLIST_SHARD_TIMEOUT_S)"))
            elif (error := call.exception()) is not None:
                if not isinstance(error, SHARD_CALL_FAILURES):
                    raise error
                problems.append((index, f"its call failed: {type(error).__name__}"))
        if not problems:
            return None
        states = await asyncio.to_thread(_application_states, [self.apps[i] for i, _ in problems])
        return "; ".join(f"shard {i} ({self.apps[i]}): {why}{states[self.apps[i]]}" for i, why in problems)

    def _unavailable(self, why: str) -> ApiError:
        # Serve replaces a dead shard replica in ~10 s; a client (or a load balancer) retries
        # rather than waits: the wait is bounded, the answer says when to come back.
        log.warning("shard unavailable: %s", why)
        return ApiError(503, "shard_unavailable", f"a shard of {self.version} is unavailable: {why}; retry later",
                        headers={"Retry-After": str(math.ceil(self.timeout_s))})


async def answer_sharded(request: Request, scorer: str, req: Any, params: dict[str, Any]) -> Response:
    """service.api.predict.Answer of the sharded service."""
    if scorer == "tree":
        raise ApiError(409, "no_tree_scorer", "the sharded service has no tree scorer (the tree is not sharded); "
                       "use /v1/predict")
    with lease_engine(request) as engine:
        return await engine.answer(req, params.get("alpha"))


async def _within(calls: asyncio.Future[Any], timeout_s: float) -> Any:
    """The result of `calls`, or TimeoutError once `timeout_s` has passed. Unlike asyncio.wait_for,
    it does not wait for the cancelled calls to end: the deadline does not depend on how soon
    Serve's router gives up a call it holds for a replica."""
    done, _ = await asyncio.wait({calls}, timeout=timeout_s)
    if not done:
        calls.cancel()
        calls.add_done_callback(lambda f: f.cancelled() or f.exception())  # its outcome retrieved, unlogged
        raise TimeoutError
    return calls.result()


async def shards_readiness(state: ServiceState) -> str | None:
    """service.api.app.Readiness of the sharded service: /readyz 503 while a shard cannot answer."""
    with state.registry.lease() as engine:
        return await engine.unavailable_shard()  # type: ignore[attr-defined]  # a ShardedEngine here


def _application_states(apps: list[str]) -> dict[str, str]:
    """", its application STATUS: why" for each of `apps` Serve does not report RUNNING (its
    replicas failing to start, say), else "" (Serve's controller is asked: off the event loop)."""
    try:
        statuses = serve.status().applications
    except Exception:  # noqa: BLE001  the reason without Serve's word rather than no reason
        return dict.fromkeys(apps, "")
    out = {}
    for name in apps:
        app = statuses.get(name)
        running = app is not None and app.status == ApplicationStatus.RUNNING
        out[name] = "" if running else (f", its application {app.status.value}: {why_failed(app)}"
                                        if app is not None else ", its application is gone")
    return out


def _last_line(message: str) -> str:
    """The last non-empty line of a Serve status message (a replica's traceback ends with the error)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1] if lines else message


# "service.engine.schema.BundleError: ..." -> "BundleError: ...": the error, not where its class lives.
_QUALIFIED_ERROR = re.compile(r"^(?:\w+\.)+(?=\w+: )")


def why_failed(app: ApplicationStatusOverview) -> str:
    """Why a shard application failed, for the activation's 422: the error its replica's
    constructor raised (the last line of its deployment's message, which holds the traceback),
    not the application's own message ("Failed to update the deployments ['shard']."), which
    says only that something did."""
    reasons = [_last_line(d.message) for d in app.deployments.values() if d.message.strip()]
    return "; ".join(_QUALIFIED_ERROR.sub("", r) for r in reasons) or _last_line(app.message)
