"""A fault-injecting S3 endpoint for the tests: an HTTP proxy on 127.0.0.1 in front of a real S3 server
(moto), that answers some requests with 503 SlowDown, resets some connections before forwarding, and
forwards some conditional writes (If-None-Match / If-Match) to the store, then drops their response:
the write is applied, and the client never hears so (a timeout or a reset at scale). Seeded, so a
failing run replays. What it did is counted in `injected`."""

from __future__ import annotations

import http.client
import random
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


class FaultProxy:
    """`with FaultProxy(upstream, seed=1, slow_down=0.05, reset=0.05, lost_conditional=0.35) as proxy:`
    point clients at `proxy.endpoint`. Rates are per request (lost_conditional: per conditional write)."""

    def __init__(self, upstream: str, seed: int = 0, slow_down: float = 0.0, reset: float = 0.0,
                 lost_conditional: float = 0.0):
        self.upstream = urlsplit(upstream)
        self.rng = random.Random(seed)
        self.rates = {"slow_down": slow_down, "reset": reset, "lost_conditional": lost_conditional}
        self.injected = {"slow_down": 0, "reset": 0, "lost_conditional": 0, "conditional_writes": 0, "forwarded": 0}
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def roll(self, what: str) -> bool:
        with self.lock:
            hit = self.rng.random() < self.rates[what]
            if hit:
                self.injected[what] += 1
            return hit

    def count(self, what: str) -> None:
        with self.lock:
            self.injected[what] += 1

    def __enter__(self) -> "FaultProxy":
        threading.Thread(target=self.server.serve_forever, name="fault-proxy", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _drop(self) -> None:
                """Close the connection without a word: the client sees a reset or an early close."""
                self.close_connection = True
                try:
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                conditional = self.command == "PUT" and ("If-None-Match" in self.headers or "If-Match" in self.headers)
                if proxy.roll("slow_down"):
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                if proxy.roll("reset"):  # before the store sees it
                    self._drop()
                    return
                up = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP and k.lower() != "expect"}
                up.request(self.command, self.path, body=body, headers=headers)
                resp = up.getresponse()
                data = resp.read()
                up.close()
                proxy.count("forwarded")
                if conditional:
                    proxy.count("conditional_writes")
                    if resp.status < 300 and proxy.roll("lost_conditional"):  # applied, and never answered
                        self._drop()
                        return
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():  # HEAD keeps the object's length; others send what was read
                    if k.lower() not in HOP_BY_HOP and (k.lower() != "content-length" or self.command == "HEAD"):
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        return Handler
