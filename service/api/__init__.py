"""HTTP API over the serving engine: `create_app(settings)` builds the FastAPI app."""

from service.api.app import create_admin_app, create_app
from service.api.settings import Settings

__all__ = ["Settings", "create_admin_app", "create_app"]
