"""Watch mode's wait strategy: wake the drain loop when work arrives, without an always-on fleet.

A :class:`Watcher` has a connection of its own that holds the watcher lock of its schema and
queues (a session advisory lock) and LISTENs on the channel every enqueue NOTIFYs inside its
transaction. A thread sets the drain loop's ``wake`` event on every notification for its queues
(a rolled-back enqueue sends none). The drain loop sleeps on that event, at most until the next
pending job is due (``Queue.next_due``), so a delayed job starts at its time without polling.

Working with cron: run ``fleetless drain --watch --idle-exit 60s`` from the cron tick. When a
watcher already holds the lock, the new one exits after that one query; when the watcher has been
idle for ``--idle-exit`` it exits and the next tick starts another. Plain drains (no ``--watch``)
take no lock and can run beside a watcher: claims use SKIP LOCKED.

A lost connection is ridden out: the thread reconnects (backing off to 5 s), takes the lock
again, LISTENs again and wakes the loop (notifications sent meanwhile were missed, so the loop
claims once). If another watcher took the lock in the meantime, this one reports ``lost`` and
the drain ends as soon as it holds no job.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from . import db

__all__ = ["Watcher"]

log = logging.getLogger("fleetless.watch")


class Watcher:
    def __init__(self, conninfo: str, *, schema: str, channel: str, queues: Sequence[str] | None,
                 wake: threading.Event) -> None:
        self.conninfo = conninfo
        self.schema = schema
        self.channel = channel
        self.queues = frozenset(queues) if queues else None
        self.key = f"fleetless:{schema}:{','.join(sorted(self.queues)) if self.queues else '*'}"
        self.wake = wake
        self.lost = False  # another watcher took the lock while our connection was away
        self.heard: list[str] = []  # payloads of the notifications that woke the loop (the latest 100)
        self._q = db.queries(schema)
        self._conn: psycopg.Connection[Any] | None = None
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> bool:
        """Connect, take the watcher lock and LISTEN. False (and nothing held) when another
        watcher holds the lock. PoolerError when the connection goes through a transaction
        pooler, where neither LISTEN nor a session lock works."""
        db.require_session(self.conninfo, why="watch mode (LISTEN and the watcher lock)")
        conn = self._connect()
        if conn is None:
            return False
        self._conn = conn
        self._thread = threading.Thread(target=self._listen, name="watcher", daemon=True)
        self._thread.start()
        return True

    def _connect(self) -> psycopg.Connection[Any] | None:
        conn = db.connect(self.conninfo, autocommit=True)
        try:
            row = conn.execute(self._q["watcher_lock"], {"key": self.key}).fetchone()
            if not row or not row[0]:
                conn.close()
                return None
            listen = self._q["listen"].replace("{channel}", sql.Identifier(self.channel).as_string(conn))
            conn.execute(listen.encode())
        except BaseException:
            conn.close()
            raise
        return conn

    def _relevant(self, payload: str) -> bool:
        return self.queues is None or not payload or bool(self.queues & set(payload.split(",")))

    def _listen(self) -> None:
        delay = 0.2
        while not self._closing.is_set():
            conn = self._conn
            try:
                with db.errors_translated():  # the driver's errors become fleetless's here too
                    conn = self._watch_once(conn)
                    if conn is None:
                        return
            except db.DatabaseError as exc:  # DatabaseUnavailable, when the connection is lost
                if self._closing.is_set():
                    return
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                log.warning("watch connection lost (%s); reconnecting", first)
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
                self._closing.wait(delay)
                delay = min(delay * 2, 5.0)
                continue
            delay = 0.2

    def _watch_once(self, conn: psycopg.Connection[Any] | None) -> psycopg.Connection[Any] | None:
        """Connect when there is no connection, then pass on about a second of notifications.
        None: another watcher took the lock while the database was away (this one stops)."""
        if conn is None:
            conn = self._connect()
            if conn is None:
                log.warning("another watcher took over queue(s) %s while the database was away",
                            self.key.rsplit(":", 1)[1])
                self.lost = True
                self.wake.set()
                return None
            self._conn = conn
            self.wake.set()  # notifications sent while we were away were missed: look once
        for note in conn.notifies(timeout=1.0):
            if self._relevant(note.payload):
                self.heard = [*self.heard[-99:], note.payload]
                self.wake.set()
            if self._closing.is_set():
                break
        return conn

    def close(self) -> None:
        """Stop listening and free the lock (it ends with the session)."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
