"""HTTP API over the serving engine: `create_app(settings)` builds the FastAPI app.

Routes (schemas in service/api/schemas.py; OpenAPI at /openapi.json, docs at /docs):
  POST /v1/predict        {"text": str} or {"texts": [str, ...]}, "k" (1..max_k, default 10),
                          "alpha" (0..1, default: the bundle's) -> {"version", "results": [[{"id",
                          "uid", "title", "score"}, ...] per text]}
  POST /v1/predict/tree   same body with optional "beam" instead of "alpha"; 409 if the active
                          bundle has no tree scorer, or every label its tree holds is retired
  GET  /healthz, /readyz  liveness; readiness (503 until a validated bundle serves)
  GET  /metrics           Prometheus text format
  GET  /admin/bundles, POST /admin/bundles/activate {"version"}, POST /admin/bundles/rollback
                          only when SHORTLIST_ADMIN_TOKEN is set (bearer token; own port with
                          SHORTLIST_ADMIN_PORT)
Errors are JSON {"error", "message", "details": [{"field", "message"}], "request_id"}; every
response carries X-Request-ID. Settings: service/api/settings.py (environment SHORTLIST_*).
"""

from typing import Any

__all__ = ["Settings", "create_admin_app", "create_app"]


def __getattr__(name: str) -> Any:
    # Imported on first use, not with the package: `shortlist serve` reads its settings and,
    # for several processes, sets prometheus-client's multiprocess directory before anything
    # imports prometheus-client (it picks its mode once, at import; service.api.server).
    if name == "Settings":
        from service.api.settings import Settings

        return Settings
    if name in ("create_app", "create_admin_app"):
        from service.api import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
