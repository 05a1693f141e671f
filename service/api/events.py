"""The service's structured events: one JSON object a line on the `shortlist.error` logger (stdout,
service.api.observability.setup_logging), which an operator's log pipeline reads beside the access
log. Here without the metrics' imports: the arbiter of several processes logs before its metrics
directory exists."""

from __future__ import annotations

import json
import logging
from typing import Any

event_log = logging.getLogger("shortlist.error")


def log_event(event: str, level: int = logging.INFO, **fields: Any) -> None:
    """One line {"event": event, **fields}."""
    event_log.log(level, json.dumps({"event": event, **fields}, default=str))
