"""The web playground: static files (``services/api/static/``, no build step) served beside the API."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI

PLAYGROUND_DIR = Path(__file__).parent / "static"


def mount_playground(app: FastAPI) -> None:
    """Serve the web playground (``services/api/static/``, static files, no build step): ``GET /`` is its page
    and ``/playground/*`` its assets. Only these paths are taken, so ``/v1/*``, ``/healthz``, ``/readyz``,
    ``/metrics`` and ``/docs`` keep their routes, and an unknown path stays an OpenAI-shaped 404."""
    from fastapi.responses import FileResponse
    from fastapi.staticfiles import StaticFiles

    @app.get("/", include_in_schema=False)
    async def playground_page():
        """The playground's page (``services/api/static/index.html``)."""
        return FileResponse(PLAYGROUND_DIR / "index.html", media_type="text/html")

    app.mount("/playground", StaticFiles(directory=PLAYGROUND_DIR), name="playground")
