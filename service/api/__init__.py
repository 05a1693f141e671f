"""HTTP API over the serving engine: `create_app(settings)` builds the FastAPI app.

Routes (schemas in service/api/schemas.py; OpenAPI at /openapi.json, docs at /docs):
  POST /v1/predict        {"text": str} or {"texts": [str, ...]}, "k" (1..max_k, default 10),
                          "alpha" (0..1, default: the bundle's) -> {"version", "results": [[{"id",
                          "uid", "title", "score"}, ...] per text]}
  POST /v1/predict/tree   same body with optional "beam" instead of "alpha"; 409 if the active
                          bundle has no tree scorer
  GET  /healthz, /readyz  liveness; readiness (503 until a validated bundle serves)
  GET  /metrics           Prometheus text format
  GET  /admin/bundles, POST /admin/bundles/activate {"version"}, POST /admin/bundles/rollback
                          only when SHORTLIST_ADMIN_TOKEN is set (bearer token; own port with
                          SHORTLIST_ADMIN_PORT)
Errors are JSON {"error", "message", "details": [{"field", "message"}], "request_id"}; every
response carries X-Request-ID. Settings: service/api/settings.py (environment SHORTLIST_*).
"""

from service.api.app import create_admin_app, create_app
from service.api.settings import Settings

__all__ = ["Settings", "create_admin_app", "create_app"]
