"""The HTTP layer of `mtpkit serve`, on the standard library's ThreadingHTTPServer (as
mlx-lm's own server): routes, API-key check, bounded bodies, SSE streaming, JSON errors in each
API's shape, 503 with Retry-After when the queue is full, a client gone noticed each round.
GET routes run beside a generation (one thread per connection); generations run on the thread
that serves (serve/worker.py).

Without an API key (loopback only, check_bind), a web page in the user's browser is the client
to fear: it may POST text/plain across origins without a preflight, and through DNS rebinding
reach the server under its own name. So a keyless server answers only requests whose Host is a
loopback name (localhost, 127.0.0.1, [::1], any port) and whose Origin, if any, is the
server's own (the chat page's calls are same-origin); CORS preflights are refused. With a key,
the key decides: a browser can send it across origins only after a preflight, never granted
here, and clients reach an exposed server under names it cannot know."""

from __future__ import annotations

import errno
import hmac
import ipaddress
import json
import re
import select
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mtpkit.decoder.rounds.interrupt import first_ctrl_c
from mtpkit.loaders.findings import UserError
from mtpkit.serve import anthropic, openai, page
from mtpkit.serve.metrics import CONTENT_TYPE
from mtpkit.serve.protocol import MAX_BODY_BYTES, RequestError, load_json, parse
from mtpkit.serve.service import Service
from mtpkit.serve.worker import Gone, QueueFull, Ticket

SOCKET_TIMEOUT_S = 120
ARRIVAL = "X-Mtpkit-Arrival"  # response header: the request's arrival number
API_NAMES = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
             "/v1/messages": "messages"}  # the `api` label of mtpkit_requests_total
DRAIN_BYTES = 16 * MAX_BODY_BYTES  # oversized bodies up to this are read and dropped
KEY_ENV = "MTPKIT_API_KEY"  # one key
KEYS_ENV = "MTPKIT_API_KEYS"  # several, separated by commas or newlines
PROBE_S = 1.0  # how often a client whose read side ended is asked whether it still reads
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"  # the ask before the answer starts
PING = b": ping\n\n"  # the ask in a stream: an SSE comment, which clients skip
PROBE_WAIT_MS = 20  # how long an ask waits for a closed client's reset (one LAN round trip)
LENGTH = re.compile(r"[0-9]+")  # a Content-Length: int() would also take "+5", "5_0", "٥"
AUTHORITY = re.compile(r"[A-Za-z0-9.\-]+(:\d{1,5})?|\[[0-9A-Fa-f:.]+\](:\d{1,5})?")


def check_bind(host: str, api_keys: Sequence[str] | None) -> None:
    """Refuse to expose the server off loopback without an API key."""
    if not is_loopback(host) and not api_keys:
        raise UserError("serve.exposed", f"refusing to bind {host} without an API key",
                        f"set {KEYS_ENV}, pass --api-key-file PATH or --api-key KEY, or bind "
                        "127.0.0.1")


def _bind_error(host: str, port: int, exc: OSError) -> UserError:
    if exc.errno == errno.EADDRINUSE:
        return UserError("serve.port_in_use", f"{host}:{port} is already in use",
                         "stop the server that holds it, or pass --port N (another port)")
    return UserError("serve.bind", f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                     "pass --host 127.0.0.1 or an address of this machine, and a free --port")


def check_port(host: str, port: int) -> None:
    """Bind (and free) the address as the server will, before the slow load: a port in use is
    one line now, not a traceback minutes later. The server's own bind says the same if the
    port is taken in between."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as HTTPServer binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise _bind_error(host, port, exc) from None


def _keys_of(text: str, source: str, hint: str) -> list[str]:
    keys = [k.strip() for k in text.splitlines() if k.strip() and not k.lstrip().startswith("#")]
    if not keys:
        raise UserError("serve.api_key", f"{source} holds no API key", hint)
    return keys


def api_keys_from(given: Sequence[str], path: Path | None,
                  environ: Mapping[str, str]) -> list[str]:
    """The API keys: each --api-key, else every line of --api-key-file (blank lines and `#`
    comments skipped), else $MTPKIT_API_KEYS (separated by commas or newlines) and
    $MTPKIT_API_KEY; [] (no key) when none is set. Each key is its client's partition of the
    prefix cache. The file and the environment keep keys out of `ps`, where a command line
    shows. An empty key or an unreadable file is refused (UserError serve.api_key): a server
    meant to be keyed must not start open."""
    if given and path is not None:
        raise UserError("usage", "--api-key and --api-key-file both give keys", "give one of them")
    unset = f"give a non-empty key (or unset {KEY_ENV} and {KEYS_ENV} and drop the key " \
        "options to serve loopback without one)"
    if path is not None:
        try:
            text = Path(path).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise UserError("serve.api_key", f"cannot read the API key file {path}: {reason}",
                            "point --api-key-file at a readable file with one key per "
                            "line") from None
        keys = _keys_of(text, f"the API key file {path}", "write one key per line")
    elif given:
        if any(not key.strip() for key in given):
            raise UserError("serve.api_key", "the API key from --api-key is empty", unset)
        keys = list(given)
    else:
        keys = []
        if KEYS_ENV in environ:
            keys += _keys_of(environ[KEYS_ENV].replace(",", "\n"), f"${KEYS_ENV}", unset)
        if KEY_ENV in environ:
            if not environ[KEY_ENV].strip():
                raise UserError("serve.api_key", f"the API key from ${KEY_ENV} is empty", unset)
            keys.append(environ[KEY_ENV])
    return list(dict.fromkeys(keys))


def _poll(sock: socket.socket, events: int, timeout_ms: int) -> int:
    """The events of one socket after up to `timeout_ms` (0: none)."""
    poller = select.poll()
    poller.register(sock, events)
    ready = poller.poll(timeout_ms)
    return ready[0][1] if ready else 0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def authority(value: str) -> tuple[str, int | None] | None:
    """(host name, port) of a Host header or an origin's host part; None when malformed."""
    if not AUTHORITY.fullmatch(value):
        return None
    try:
        parts = urlsplit("//" + value)
        return (parts.hostname or "").rstrip("."), parts.port
    except ValueError:
        return None


def foreign(host: str | None, origin: str | None) -> RequestError | None:
    """For a server without a key: why a request with these Host and Origin headers may
    come from a web page rather than a local client (403), or None. No Host (HTTP/1.0) is
    no browser's; a Host must name loopback; an Origin must be the Host's own http origin."""
    where = authority(host.strip()) if host is not None else None
    if host is not None and (where is None or not is_loopback(where[0])):
        return RequestError(403, f"Host {host[:100]!r} is not a loopback name; a server "
                            "without an API key answers only localhost, 127.0.0.1 and [::1]",
                            kind="permission_error", code="serve.host")
    if origin is None:
        return None
    same = False
    if where is not None:
        parts = urlsplit(origin.strip())
        try:
            same = parts.scheme == "http" and not parts.path and \
                (parts.hostname or "").rstrip(".") == where[0] and \
                (parts.port or 80) == (where[1] or 80)
        except ValueError:  # a port out of range
            same = False
    if not same:
        return RequestError(403, f"cross-origin request from {origin[:100]!r}: a server without "
                            "an API key answers only its own origin (no CORS)",
                            kind="permission_error", code="serve.origin")
    return None


class Handler(BaseHTTPRequestHandler):
    """GET_ROUTES and POST_ROUTES map a path to the method answering it (the one place an API
    route is registered; the chat page, serve/page.py, answers its own paths)."""

    server: Server
    protocol_version = "HTTP/1.1"
    timeout = SOCKET_TIMEOUT_S
    GET_ROUTES = {"/v1/models": "_models", "/health": "_health", "/metrics": "_metrics"}
    POST_ROUTES = {"/v1/chat/completions": "_openai", "/v1/completions": "_openai",
                   "/v1/messages": "_anthropic"}

    streaming = False  # the SSE headers are out: an error can no longer change the status
    api = "openai"  # whose error shape this request gets
    job: Ticket | None = None  # the request's generation, once admitted
    tenant: str | None = None  # the key's partition of the prefix cache ("": no keys)
    answering = False  # the answer's status line is out: no 100 Continue may follow
    asked = -PROBE_S  # when a client whose read side ended was last asked (_ask)
    left = False  # the client is gone (_gone)

    def setup(self) -> None:
        super().setup()
        self.writing = threading.Lock()  # the serving thread's asks and this thread's writes

    def send_response(self, code: int, message: str | None = None) -> None:
        with self.writing:
            self.answering = True
            super().send_response(code, message)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        if self.server.verbose:
            super().log_message(format, *args)

    def log_error(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        """Errors are logged even when requests are not."""
        super().log_message(format, *args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's own refusals (unknown method, malformed request line,
        oversized headers) in the same JSON shape as ours."""
        reason = message or self.responses.get(code, ("error",))[0]
        self._json(code, RequestError(code, reason).body(), close=True)

    # -- plumbing ---------------------------------------------------------------------------

    def _send(self, status: int, body: bytes, content_type: str, close: bool = False,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, doc: dict[str, Any], close: bool = False,
              headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(doc, allow_nan=False).encode(), "application/json", close,
                   headers)

    def _error(self, err: RequestError, headers: dict[str, str] | None = None) -> None:
        """JSON in the request's API shape with the status; on a stream already started, a
        last event instead."""
        if self.api == "anthropic":
            doc = anthropic.error_body(err)
            if self.streaming:
                self._event("error", doc)
                return
        else:
            doc = err.body()
            if self.streaming:
                self._sse(doc)
                return
        self._json(err.status, doc, close=self.close_connection, headers=headers)

    def _key(self) -> str | None:
        """Which key the request carries, as `Authorization: Bearer KEY` (OpenAI clients) or
        `x-api-key: KEY` (Anthropic's): its partition of the prefix cache ("" on a server
        without keys), or None (a 401). Every key is compared, in constant time, as the bytes
        the client sent (headers arrive as latin-1)."""
        keys = self.server.api_keys
        if not keys:
            return ""
        bearer = self.headers.get("Authorization", "").encode("latin-1", "replace")
        given = self.headers.get("x-api-key", "").encode("latin-1", "replace")
        found = None
        for i, key in enumerate(keys):
            want = key.encode()
            if hmac.compare_digest(bearer, b"Bearer " + want) | hmac.compare_digest(given, want):
                found = f"key {i}" if found is None else found
        return found

    def _foreign(self) -> RequestError | None:
        """Without a key: a request a web page may have sent (see the module's docstring)."""
        if self.server.api_keys:
            return None
        return foreign(self.headers.get("Host"), self.headers.get("Origin"))

    def _gone(self) -> bool:
        """The client can no longer take its answer: its connection was reset, or it closed
        its socket (poll: any descriptor, where select refuses those past 1,023). A read side
        at EOF alone may be a half-close, a client that shut its writing side after the
        request and still reads the answer: that is asked (_ask). Once gone, always gone."""
        if not self.left:
            self.left = self._closed()
        return self.left

    def _closed(self) -> bool:
        try:
            mask = _poll(self.connection, select.POLLIN, 0)
        except (OSError, ValueError):  # closed under us
            return True
        if mask & (select.POLLERR | select.POLLNVAL):
            return True
        if not mask & (select.POLLIN | select.POLLHUP):
            return False
        try:
            if self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                return False  # the next request, pipelined: still there
        except BlockingIOError:
            return False
        except OSError:  # reset
            return True
        return self._ask()

    def _ask(self) -> bool:
        """After EOF on the read side: does the client still read? A closed socket answers
        anything sent with a reset, a half-closed one takes it. So the client is sent what it
        must skip: an interim `100 Continue` before the answer starts (RFC 9110 15.2: a client
        accepts an unexpected 1xx; HTTP/1.0 has none, so there EOF is taken as gone), or an
        SSE comment inside a stream; at most every PROBE_S, and the reset is awaited one
        round trip (PROBE_WAIT_MS; a slower one shows at a later ask, as a failed send)."""
        with self.writing:
            if self.streaming:
                probe = PING
            elif self.request_version != "HTTP/1.1":
                return True
            elif self.answering:
                return False  # a whole answer is being written: its own bytes ask
            else:
                probe = CONTINUE
            if time.monotonic() - self.asked < PROBE_S:
                return False
            self.asked = time.monotonic()
            try:
                self.connection.sendall(probe)
            except OSError:
                return True
        try:
            mask = _poll(self.connection, 0, PROBE_WAIT_MS)  # POLLHUP and POLLERR: always
            error = self.connection.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        except (OSError, ValueError):
            return True
        return bool(mask & select.POLLERR) or error != 0

    def _body(self) -> bytes:
        """The whole body, read before anything is answered, so that a kept-alive connection
        never takes an unread body for the next request."""
        lengths = self.headers.get_all("Content-Length") or []
        if "Transfer-Encoding" in self.headers and lengths or len(set(lengths)) > 1:
            self.close_connection = True  # where this body ends is ambiguous: so is the next
            raise RequestError(400, "the body's length is ambiguous (Content-Length with "
                               "Transfer-Encoding, or two lengths): send one Content-Length",
                               code="request.framing")
        if not lengths or not LENGTH.fullmatch(lengths[0].strip()):
            self.close_connection = True  # a body of unknown length may follow: cannot skip it
            raise RequestError(411, "Content-Length is required")
        length = int(lengths[0])
        if not 0 <= length <= MAX_BODY_BYTES:
            self.close_connection = True
            if 0 < length <= DRAIN_BYTES:  # read it away so the client sees the 413, not EPIPE
                while length > 0:
                    length -= len(self.rfile.read(min(length, 1 << 16)) or b"x" * length)
            raise RequestError(413, f"request body over {MAX_BODY_BYTES} bytes")
        return self.rfile.read(length)

    def _admit(self, req: Any) -> Ticket:
        """Admit `req` to the queue; request errors and a full queue surface here, before any
        status is sent. Its generation runs on the server's worker (serve/worker.py)."""
        ticket = self.server.service.deltas(req, self._gone, self.tenant)
        self.job = self.server.worker.submit(ticket)
        return self.job

    def _write(self, data: bytes) -> None:
        """Part of a stream, never in the middle of an ask (_ask)."""
        with self.writing:
            self.wfile.write(data)
            self.wfile.flush()

    def _sse(self, doc: dict[str, Any] | str) -> None:
        data = doc if isinstance(doc, str) else json.dumps(doc, allow_nan=False)
        self._write(f"data: {data}\n\n".encode())

    def _event(self, name: str, doc: dict[str, Any]) -> None:
        """An SSE event with its name (Anthropic's streams)."""
        self._write(f"event: {name}\ndata: {json.dumps(doc, allow_nan=False)}\n\n".encode())

    def _arrival(self) -> dict[str, str]:
        """The request's arrival number (its place in the first-in first-out order)."""
        return {ARRIVAL: str(self.job.number)} if self.job is not None else {}

    def _start_stream(self) -> None:
        self.send_response(200)
        for name, value in self._arrival().items():
            self.send_header(name, value)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = self.streaming = True

    # -- routes -----------------------------------------------------------------------------

    def do_OPTIONS(self) -> None:  # noqa: N802 (stdlib name)
        """A CORS preflight (an OPTIONS with an Origin) is never granted, so no cross-origin
        page reaches the API, keyed or not; other clients learn the methods."""
        refusal = self._foreign()
        if refusal is None and (origin := self.headers.get("Origin")) is not None:
            refusal = RequestError(403, f"cross-origin request from {origin[:100]!r}: this "
                                   "server grants no CORS", kind="permission_error",
                                   code="serve.origin")
        if refusal is not None:  # closed after: any body it had is never read
            self._json(refusal.status, refusal.body(), close=True)
        else:
            self._send(204, b"", "text/plain", close=True, headers={"Allow": "GET, POST, OPTIONS"})

    def do_GET(self) -> None:  # noqa: N802 (stdlib name)
        path = urlsplit(self.path).path.rstrip("/") or "/"
        route = self.GET_ROUTES.get(path)
        if "Transfer-Encoding" in self.headers or \
                self.headers.get("Content-Length", "0").strip() != "0":
            self.close_connection = True  # a body is never read here: it must not be next
        if (refusal := self._foreign()) is not None:  # the page too: under a rebound name, nothing
            self._json(refusal.status, refusal.body())
        elif page.is_page(self.path):  # the chat page holds nothing; its API calls carry the key
            page.send(self)
        elif self._key() is None:
            self._json(401, RequestError(401, "invalid API key", kind="authentication_error").body())
        elif route is None:
            self._json(404, RequestError(404, f"no route {self.path}", kind="not_found").body())
        else:
            getattr(self, route)()

    def _models(self) -> None:
        self._json(200, openai.models(self.server.service.model_id))

    def _health(self) -> None:
        self._json(200, {"status": "ok"})

    def _metrics(self) -> None:
        self._send(200, self.server.service.metrics.text(), CONTENT_TYPE)

    def do_POST(self) -> None:  # noqa: N802 (stdlib name)
        path = urlsplit(self.path).path.rstrip("/")
        route = self.POST_ROUTES.get(path)
        self.api = "anthropic" if route == "_anthropic" else "openai"
        name = API_NAMES.get(path, "unknown")
        outcome = "error"
        self.answering, self.asked = False, -PROBE_S
        try:
            raw = self._body()
            if (refusal := self._foreign()) is not None:
                raise refusal
            self.tenant = self._key()
            if self.tenant is None:
                raise RequestError(401, "invalid API key", kind="authentication_error")
            if route is None:
                raise RequestError(404, f"no route {self.path}", kind="not_found")
            body = load_json(raw)
            self.job = None
            getattr(self, route)(body, path.endswith("/chat/completions"))
            outcome = "cancelled" if self.job is not None and self.job.cancelled else "ok"
        except RequestError as err:
            self._error(err)
        except QueueFull as full:
            outcome = "rejected"
            self.close_connection = True
            self._error(RequestError(503, str(full), kind="server_error"),
                        {"Retry-After": str(full.retry_after)})
        except UserError as err:
            self._error(RequestError(400, f"{err.code}: {err}"))
        except (Gone, TimeoutError, BrokenPipeError, ConnectionResetError):
            outcome = "cancelled"
            self.close_connection = True
        except Exception as exc:  # a bug of ours: answer it, and log the traceback
            self.log_error("%s", traceback.format_exc())
            detail = " ".join(str(exc).split())[:200]
            self._error(RequestError(500, f"internal error: {type(exc).__name__}: {detail}",
                                     kind="server_error"))
        finally:
            self.server.service.metrics.requests.labels(name, outcome).inc()

    def _openai(self, body: Any, chat: bool) -> None:
        service = self.server.service
        req = parse(body, chat, service.max_tokens)
        job = self._admit(req)
        try:
            if req.stream:
                self._start_stream()
                for data in openai.chunks(req, service.model_id, job):
                    self._sse(data)
                return
            doc = openai.completion(req, service.model_id, job)
        finally:
            job.close()
        self._json(200, doc, headers=self._arrival())

    def _anthropic(self, body: Any, _chat: bool) -> None:
        service = self.server.service
        req = anthropic.parse(body, service.max_tokens)
        mid = anthropic.message_id()
        job = self._admit(req)
        try:
            if req.stream:
                self._start_stream()
                events = anthropic.Events(self._event, mid, service.model_id, req)
                for d in job:
                    events.feed(d.reasoning, d.content)
                    if d.result is not None:
                        events.finish(d)
                return
            reasoning = content = ""
            for d in job:
                reasoning, content = reasoning + d.reasoning, content + d.content
                if d.result is not None:
                    self._json(200, anthropic.message(mid, service.model_id, req, reasoning,
                                                      content, d), headers=self._arrival())
        finally:
            job.close()


class Server(ThreadingHTTPServer):
    """serve_forever answers HTTP on a helper thread and runs every generation on its own
    thread (serve/worker.py), until shutdown() or Ctrl-C (on the main thread: the worker's
    stop, so the running generation ends between rounds). Request threads are daemons (an idle
    keep-alive client cannot hold the exit), but closing waits up to CLOSE_WAIT_S for them, so
    that the answers they hold (a 503 for a turn that will not come) are written."""

    daemon_threads = True
    CLOSE_WAIT_S = 5.0

    def __init__(self, service: Service, host: str, port: int,
                 api_keys: Sequence[str] | str | None, verbose: bool = False) -> None:
        """api_keys: every key a client may send (api_keys_from), each its own partition of
        the prefix cache; one key may be given as a string; None or none: no key."""
        keys = [api_keys] if isinstance(api_keys, str) else list(api_keys or ())
        check_bind(host, keys)
        self.service, self.api_keys, self.verbose = service, keys, verbose
        self.worker = service.queue  # its line, and the worker that serves it
        self._served = threading.Event()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.address_family = family
        self._requests: set[threading.Thread] = set()
        self._requests_lock = threading.Lock()
        try:
            super().__init__((host, port), Handler)
        except OSError as exc:
            raise _bind_error(host, port, exc) from None

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        http = threading.Thread(target=super().serve_forever, args=(poll_interval,),
                                name="mtpkit-http", daemon=True)
        http.start()
        try:
            with first_ctrl_c(self.worker.stop):
                self.worker.run()
        finally:
            super().shutdown()
            self._served.set()

    def shutdown(self) -> None:
        """From another thread: the running generation ends at its next round, waiting turns
        get 503, and serve_forever returns; this waits for it."""
        self.worker.stop()
        self._served.wait()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that resets or drops its connection (between keep-alive requests, say) is
        not an error of the server's: nothing is printed. Anything else is a bug of ours and
        keeps the standard library's traceback, as the handler's own 500s do."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._requests_lock:
            self._requests = {t for t in self._requests if t.is_alive()}
            self._requests.add(threading.current_thread())
        super().process_request_thread(request, client_address)

    def server_close(self) -> None:
        super().server_close()
        deadline = time.monotonic() + self.CLOSE_WAIT_S
        with self._requests_lock:
            running = list(self._requests)
        for thread in running:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
