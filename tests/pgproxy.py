"""A TCP proxy on loopback in front of PostgreSQL that a test controls: armed with a marker, it
lets the next statement whose text contains the marker reach the server, waits until the server
has answered it completely (ReadyForQuery: the statement has committed), and then drops the
client's connection instead of passing the reply on. The client sees exactly what a network
failure at the worst moment looks like: its write happened, and it never learns so.

psycopg sends a statement's text until it prepares it (after 5 runs on one connection), so arm
the proxy for statements a connection has run fewer times than that."""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

_READY = b"Z\x00\x00\x00\x05"  # ReadyForQuery, followed by the transaction status byte


class PgProxy:
    def __init__(self, upstream_dsn: str) -> None:
        info = psycopg.conninfo.conninfo_to_dict(upstream_dsn)
        self._upstream = (str(info.get("host", "127.0.0.1")), int(info.get("port", 5432)))
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        info["host"], info["port"] = "127.0.0.1", str(self._listener.getsockname()[1])
        info["sslmode"] = "disable"
        self.dsn = psycopg.conninfo.make_conninfo(**info)  # type: ignore[arg-type]
        self._lock = threading.Lock()
        self._armed: list[bytes] = []
        self.dropped: list[bytes] = []  # the markers whose replies were dropped, in order
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_reply_to(self, marker: bytes, times: int = 1) -> None:
        """Drop the reply to the next ``times`` statements containing ``marker``."""
        with self._lock:
            self._armed.extend([marker] * times)

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._upstream)
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _take(self, data: bytes) -> bytes | None:
        with self._lock:
            for marker in self._armed:
                if marker in data:
                    self._armed.remove(marker)
                    return marker
        return None

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        dropping: bytes | None = None
        held = b""
        try:
            while True:
                readable, _, _ = select.select([client, server], [], [])
                if client in readable:
                    data = client.recv(65536)
                    if not data:
                        return
                    if dropping is None:
                        dropping = self._take(data)
                    server.sendall(data)
                if server in readable:
                    data = server.recv(65536)
                    if not data:
                        return
                    if dropping is None:
                        client.sendall(data)
                        continue
                    held += data
                    if _READY in held:  # the server is done with it (committed): drop the reply
                        self.dropped.append(dropping)
                        return
        except OSError:
            return
        finally:
            client.close()
            server.close()


@contextmanager
def pg_proxy(dsn: str) -> Iterator[PgProxy]:
    proxy = PgProxy(dsn)
    try:
        yield proxy
    finally:
        proxy.close()
