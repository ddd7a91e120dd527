"""API keys (`--api-key`): an ASGI middleware that answers every /v1 request without `Authorization: Bearer KEY`
(KEY one of the server's keys) with 401 in OpenAI's error shape; other paths (/health, /metrics) pass. Plain
ASGI (not Starlette's BaseHTTPMiddleware), so streamed responses and client disconnects reach the app as before."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from jaxddtree.serving.protocol import APIError


def key_ok(header: str, keys: list[bytes]) -> bool:
    """Whether an Authorization header carries one of `keys` as a bearer token; every key is compared in constant
    time, so the answer's timing does not tell which one nearly matched."""
    scheme, _, token = header.partition(" ")
    given = token.strip().encode()
    return scheme.lower() == "bearer" and bool(given) and sum(hmac.compare_digest(given, k) for k in keys) > 0


class APIKeys:
    def __init__(self, app, keys: list[str]):
        self.app = app
        self.keys = [k.encode() for k in keys if k]

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and self.keys and (path == "/v1" or path.startswith("/v1/")):
            header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), "")
            if not key_ok(header, self.keys):
                body = APIError(401, "missing or incorrect API key: send 'Authorization: Bearer KEY' with a key the "
                                "server was started with (--api-key)", code="invalid_api_key").body()
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)
