"""The chat page: `/` and `/chat`, and its assets under `/static/`, all from router/static/.

The page is plain HTML, CSS and JavaScript, read once from the package's data and served
from memory: nothing comes from a CDN, and nothing in it is secret, so it is served without the
API key (the page asks for the key and sends it to the API itself). Every answer carries a strict
Content-Security-Policy: only this origin's scripts, styles, images and fetches, no inline script,
no frames, no plugins, no form posts.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pdserve.router.errors import APIError

STATIC_DIR = Path(__file__).resolve().parent / "static"
PAGE = "chat.html"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",  # a new router version's page is picked up at once
}


class ChatPage:
    """The page's files, read from `folder` when made; `routes()` serves them (GET and HEAD)."""

    def __init__(self, folder: Path = STATIC_DIR) -> None:
        self.assets: dict[str, tuple[bytes, str]] = {
            f.name: (f.read_bytes(), CONTENT_TYPES[f.suffix])
            for f in sorted(folder.iterdir())
            if f.is_file() and f.suffix in CONTENT_TYPES
        }
        if PAGE not in self.assets:
            raise FileNotFoundError(f"the chat page {folder / PAGE} is missing")

    def routes(self) -> list[Route]:
        return [
            Route("/", self.page, methods=["GET"]),
            Route("/chat", self.page, methods=["GET"]),
            Route("/static/{name}", self.asset, methods=["GET"]),
        ]

    async def page(self, request: Request) -> Response:
        return self._send(PAGE)

    async def asset(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name == PAGE or name not in self.assets:  # only the listed files: no path is joined
            return APIError(404, f"no asset {name!r}", code="not_found").response()
        return self._send(name)

    def _send(self, name: str) -> Response:
        body, content_type = self.assets[name]
        return Response(body, headers={**HEADERS, "content-type": content_type})
