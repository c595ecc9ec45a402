"""The reward server's socket: uvicorn serving ``RewardApp`` on a socket bound at construction, with a deadline on
request headers (``_HeaderDeadline``) and a one-line error for a port that cannot be bound (``PortUnavailable``).
"""
from __future__ import annotations

import json
import socket
import threading

import h11

from rlhf.rm_server.app import RewardApp


class _HeaderDeadline:
    """Mixed into uvicorn's h11 protocol (``RewardServer``): a deadline on request headers: a connection that has
    not sent a whole request head within ``timeout`` of connecting (or of its previous response) gets 408 and is
    closed.  uvicorn times out only idle keep-alive connections, so without this a client that connects and
    trickles a header byte now and then holds its connection forever.  (uvicorn is imported only when a server is
    built: the scorer and the app import without it, as on a GPU image that lacks it.)"""

    header_timeout_s = 30.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def connection_lost(self, exc) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        if not self.transport.is_closing():
            self._header_task = self.loop.call_later(self.header_timeout_s, self._header_deadline_passed)

    def _cancel_header_deadline(self) -> None:
        task = getattr(self, "_header_task", None)
        if task is not None:
            task.cancel()
            self._header_task = None

    def _header_deadline_passed(self) -> None:
        self._header_task = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return  # a request is in (its body has its own deadline in the app)
        body = json.dumps({"error": f"request headers not received within {self.header_timeout_s:g}s "
                                    f"(--request_timeout_s)"}).encode()
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()


class PortUnavailable(OSError):
    """The server's --host / --port cannot be bound: in use (EADDRINUSE) or not allowed / not an address here."""

    def __init__(self, host: str, port: int, err: OSError):
        import errno

        if err.errno == errno.EADDRINUSE:
            why = (f"--port {port} on {host} is in use (another serve_rm, or another program: see `ss -ltnp "
                   f"'sport = :{port}'`); stop it, or pick a free --port (--port 0 picks one and prints it)")
        elif err.errno == errno.EACCES:
            why = f"--port {port} needs privileges on {host}; use a --port of 1024 or above"
        else:
            why = (f"cannot listen on --host {host} --port {port}: {err.strerror or err}; give an address of this "
                   f"machine (127.0.0.1, 0.0.0.0) and a free --port")
        super().__init__(err.errno, why)
        self.message = why

    def __str__(self) -> str:
        return self.message


class RewardServer:
    """uvicorn serving ``RewardApp`` on a socket bound at construction (port 0 picks a free one).
    ``serve_forever()`` blocks (run it in a thread in tests); ``shutdown()`` stops it from another thread."""

    def __init__(self, app: RewardApp, host: str = "127.0.0.1", port: int = 5000):
        try:
            import uvicorn
            from uvicorn.protocols.http.h11_impl import H11Protocol
        except ImportError as e:
            raise ImportError(f"rlhf.serve_rm needs uvicorn to serve ({e}): pip install 'uvicorn>=0.30'") from None
        limits = app.limits
        self.app = app
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise PortUnavailable(host, port, e) from None
        self.sock.listen(limits.backlog)
        self.server_address = self.sock.getsockname()[:2]
        protocol = type("RewardServerProtocol", (_HeaderDeadline, H11Protocol),
                        {"header_timeout_s": limits.request_timeout_s})
        config = uvicorn.Config(app, http=protocol, lifespan="off", log_level="warning", access_log=False,
                                backlog=limits.backlog, limit_concurrency=limits.max_connections,
                                timeout_keep_alive=max(1, int(limits.request_timeout_s)),
                                timeout_graceful_shutdown=5)  # Ctrl-C / TERM: in-flight requests get 5 s
        self.server = uvicorn.Server(config)
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self._stopped.set()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self._stopped.wait(timeout_s)
        self.app.pool.shutdown(wait=False, cancel_futures=True)
        self.sock.close()

