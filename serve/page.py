"""`mtpkit serve`'s chat page at GET /: one static file (its CSS and script inline) that streams
from this server's own /v1/chat/completions and draws the telemetry of usage.mtp. The page holds
nothing secret, so it is served to anyone who can reach the server; everything it shows comes
from API calls that carry the key typed into it, under the API's own rule (401 without it). Its
Content-Security-Policy admits only its own inline script and style (by hash) and fetches to
this origin: no external asset can load, even if one were added by mistake."""

from __future__ import annotations

import base64
import hashlib
import re
from functools import cache
from http.server import BaseHTTPRequestHandler
from importlib import resources

ROUTES = ("/", "/index.html")


def _hash(body: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"


@cache
def page() -> tuple[bytes, str]:
    """The page's bytes and its Content-Security-Policy."""
    html = resources.files("mtpkit.serve").joinpath("static/chat.html").read_text("utf-8")
    inline = {"script": [], "style": []}
    for tag, body in re.findall(r"<(script|style)>(.*?)</\1>", html, re.S):
        inline[tag].append(_hash(body))
    csp = (f"default-src 'none'; script-src {' '.join(inline['script'])}; "
           f"style-src {' '.join(inline['style'])}; connect-src 'self'; base-uri 'none'; "
           "form-action 'none'; frame-ancestors 'none'")
    return html.encode("utf-8"), csp


def is_page(path: str) -> bool:
    return path.split("?", 1)[0] in ROUTES


def send(handler: BaseHTTPRequestHandler) -> None:
    body, csp = page()
    handler.send_response(200)
    handler.send_header("Content-Type", "text/html; charset=utf-8")
    handler.send_header("Content-Length", str(len(body)))
    handler.send_header("Content-Security-Policy", csp)
    handler.send_header("X-Content-Type-Options", "nosniff")
    handler.send_header("Cache-Control", "no-cache")
    handler.end_headers()
    handler.wfile.write(body)
