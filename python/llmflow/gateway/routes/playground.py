"""The playground page and the browser client it is built on (`docs/browser-client.md`).

`/playground` streams a chat through `/static/llmflow-client.js` and shows the WebSocket window
at work: what was rendered, what is unacknowledged, what the gateway merged, and the request as
`/api/state` sees it. The page is behind the same keys as the API: a browser cannot send a Bearer
header when it navigates, so a gateway with keys answers 401 with a Basic challenge and the
browser asks for the key (any user name, the key as password); the page's script never sees that
password, so the user gives the key to the page once more, for the socket. The static files hold
no data and no secret, so they are served to anyone: a frontend imports the library from here.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from llmflow.gateway.auth import _basic_to_bearer
from llmflow.gateway.errors import GatewayError
from llmflow.gateway.routes.deps import gateway

__all__ = ["router"]

router = APIRouter(tags=["playground"])

_STATIC = files("llmflow.gateway").joinpath("static")
_MEDIA = {".js": "text/javascript", ".ts": "text/plain", ".css": "text/css"}
_FILES = {  # the only names /static answers: read once, no path from the client reaches a disk
    name: (_STATIC.joinpath(name).read_bytes(), _MEDIA[name[name.rindex(".") :]])
    for name in ("llmflow-client.js", "llmflow-client.d.ts", "playground.js", "playground.css")
}
_PAGE = _STATIC.joinpath("playground.html").read_text(encoding="utf-8")
_CHALLENGE = 'Basic realm="llmflow playground", charset="UTF-8"'  # a browser asks for the key
_PRIVATE = {"Cache-Control": "no-store"}  # a page behind a key is not for shared caches


@router.get("/playground", response_class=HTMLResponse)
async def playground(request: Request) -> HTMLResponse:
    """The playground page; with keys configured, only for a valid API key (Bearer or Basic)."""
    keyring = gateway(request).keyring
    try:
        keyring.authenticate(_basic_to_bearer(request.headers.get("authorization")))
    except GatewayError as exc:
        raise GatewayError(
            401,
            f"{exc.message}; a browser may give the key as the password of the login prompt",
            "invalid_api_key",
            headers={"WWW-Authenticate": _CHALLENGE},
        ) from None
    auth = "required" if keyring.enabled else "none"
    return HTMLResponse(_PAGE.replace("{{auth}}", auth), headers=_PRIVATE)


@router.get("/static/{name}")
async def static(name: str) -> Response:
    """The browser client (`llmflow-client.js`, its `.d.ts`) and the playground's own files."""
    found = _FILES.get(name)
    if found is None:
        hint = "try /static/llmflow-client.js"
        raise GatewayError(404, f"no static file {name!r}: {hint}", "not_found")
    body, media = found
    return Response(body, media_type=media, headers={"Cache-Control": "no-cache"})
