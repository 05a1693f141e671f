"""The settings `shortlist serve-ray` does not apply, and the start-up check that refuses them.

The sharded service builds the same Settings as `shortlist serve`, but has no engine line, no
process group, no admin port and no file watch of its own, and HAProxy takes
over the HTTP limits: a variable set for one of those would be read, validated and then ignored,
and an operator who set it (a queue bound, say) would believe it holds. NOT_APPLIED is the one
list of them: the check refuses each one set to anything but its default, and README ("Past one
machine", settings) quotes it. Settings that only make sense with a feature the sharded service
answers 409 (label changes) or does not have (PROCESSES's tuning) are not listed: with that
feature off they change nothing under `serve` either.

No Ray import: the check runs before Ray starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.api.settings import Settings, SettingsError, variable_name


@dataclass(frozen=True)
class Unapplied:
    """Why serve-ray does not apply a setting; `cluster_only`: applied by the HAProxy front
    `serve-ray` configures for the local Ray instance it starts, not on a cluster (--address)."""

    reason: str
    cluster_only: bool = False
    # A value besides the default that asks for nothing: one another setting's cross-check demands.
    also_accepted: Callable[[Settings], Any] | None = None


_FRONT = "on a cluster (--address) serve-ray configures no HAProxy front"
NOT_APPLIED: dict[str, Unapplied] = {
    "processes": Unapplied("the sharded service runs one ingress replica; shards scale by --replicas"),
    "admin_port": Unapplied("the sharded service serves the admin routes on --port only; with it set, "
                            "no port would serve them"),
    # MAX_BATCH past 4096 needs MAX_QUEUED_TEXTS at least as large (Settings): that floor is accepted.
    "max_queued_texts": Unapplied("the ingress has no engine line to shed load from; a prediction waits "
                                  "for its shards up to SHORTLIST_SHARD_TIMEOUT_S",
                                  also_accepted=lambda settings: settings.max_batch),
    "max_queue_wait_ms": Unapplied("the ingress has no engine line to shed load from; a prediction waits "
                                   "for its shards up to SHORTLIST_SHARD_TIMEOUT_S"),
    "bundle_check_interval_s": Unapplied("the sharded service never compares the served files with what "
                                         "was loaded"),
    "load_check_timeout_s": Unapplied("a shard replica loads in its own Ray process, within the layout's "
                                      "load_timeout_s (600 s)"),
    "loader_nice": Unapplied("shards load in their own Ray replica processes, at Ray's priority"),
    "heap_tuning": Unapplied("shards load in Ray replica processes, whose heap is not tuned"),
    "huge_pages": Unapplied("shards load their indices in Ray replica processes, which keep the default "
                            "(huge pages on Linux)"),
    "max_header_bytes": Unapplied("HAProxy's buffer (16 KiB) bounds a request head"),
    "send_timeout_s": Unapplied("HAProxy cuts an unread answer after SHORTLIST_BODY_TIMEOUT_S"),
    "forwarded_allow_ips": Unapplied("Ray's HTTP server decides which forwarding headers it believes"),
    "max_connections": Unapplied(_FRONT, cluster_only=True),
    "header_timeout_s": Unapplied(_FRONT, cluster_only=True),
    "body_timeout_s": Unapplied(_FRONT, cluster_only=True),
}


def unapplied(settings: Settings, on_cluster: bool) -> list[str]:
    """One line per setting of NOT_APPLIED set to other than its default (those applied by the
    local front only when `on_cluster`), naming its variable and why."""
    lines = []
    for field, why in NOT_APPLIED.items():
        if why.cluster_only and not on_cluster:
            continue
        value = getattr(settings, field)
        if value == Settings.model_fields[field].get_default(call_default_factory=True):
            continue  # a default asks for nothing serve-ray fails to do
        if why.also_accepted is not None and value == why.also_accepted(settings):
            continue
        name = variable_name(field)
        raw = next((v for k, v in os.environ.items() if k.upper() == name), value)
        shown = str(raw) if len(str(raw)) <= 80 else str(raw)[:80] + "..."
        lines.append(f"{name}={shown!r}: not applied by the sharded service ({why.reason}): unset it")
    return lines


def refuse_unapplied(settings: Settings, on_cluster: bool) -> None:
    """SettingsError (a line per setting) if `settings` set any that serve-ray does not apply."""
    lines = unapplied(settings, on_cluster)
    if lines:
        raise SettingsError("\n".join(lines))
