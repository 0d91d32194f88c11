"""Watch mode's wait strategy: wake the drain loop when work arrives, without an always-on fleet.

A :class:`Watcher` has a connection of its own that holds its set of queues' row of the
``watchers`` table (holder, heartbeat, lease) and LISTENs on the channel every enqueue NOTIFYs
inside its transaction. It renews the heartbeat every few seconds, while the drain loop shows it
is turning (:meth:`Watcher.alive`); a cron tick takes the row over once the heartbeat is older
than the lease, so a stopped or hung watcher stalls its queues for at most the lease (issue 26
item 6). A row of fleetless's own table, not an advisory lock: a role that can merely connect
cannot hold it (issue 25 item 7). A thread sets the drain loop's ``wake`` event on every notification for its queues
(a rolled-back enqueue sends none). The drain loop sleeps on that event, at most until the next
pending job is due (``Queue.next_due``) or a schedule's next occurrence comes, so a delayed job
starts at its time without polling. Adding, changing or removing a schedule NOTIFYs the same
channel (payload ``SCHEDULES_CHANGED``): every watcher then runs a scheduler pass at once and
sleeps until the new next occurrence (``on_schedules``).

Working with cron: run ``fleetless drain --watch --idle-exit 60s`` from the cron tick. When a
live watcher holds the row, the new one exits after that one query; when the watcher has been
idle for ``--idle-exit`` it exits and the next tick starts another. Plain drains (no ``--watch``)
take no lock and can run beside a watcher: claims use SKIP LOCKED.

A lost connection is ridden out: the thread reconnects (backing off to 5 s), takes the row
again (it is still the holder), LISTENs again and wakes the loop (notifications sent meanwhile
were missed, so the loop claims once). If another watcher took the row over in the meantime (or
at a heartbeat), this one reports ``lost`` and the drain ends as soon as it holds no job.

A watcher claims only while it holds its row (:meth:`Watcher.holds`): once it has lost it, or its
last heartbeat is older than its lease (it may have been taken over without knowing yet), the
drain claims nothing more; the jobs it runs finish (fenced as always) and it exits, or claims again
once a heartbeat shows the row is still its own.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import sql

from . import db
from .queue import SCHEDULES_CHANGED

__all__ = ["DEFAULT_LEASE", "MIN_LEASE", "Watcher", "beat_interval"]

log = logging.getLogger("fleetless.watch")

#: How long a watcher's heartbeat stays good (drain --watch-lease): a cron tick takes its queues
#: over once the heartbeat is older.
DEFAULT_LEASE = 30.0
MIN_LEASE = 3.0


def beat_interval(lease: float) -> float:
    """How often a watcher renews its heartbeat: a few times per lease, at least every 5 s."""
    return min(5.0, lease / 3)


class Watcher:
    def __init__(self, conninfo: str, *, schema: str, channel: str, queues: Sequence[str] | None,
                 wake: threading.Event, lease: float | None = None,
                 on_schedules: Callable[[], None] | None = None) -> None:
        self.conninfo = conninfo
        self.schema = schema
        self.channel = channel
        self.queues = frozenset(queues) if queues else None
        self.set_name = ",".join(sorted(self.queues)) if self.queues else "*"  # its row in watchers
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lease = lease or DEFAULT_LEASE
        self.beat_every = beat_interval(self.lease)
        self.wake = wake
        #: called (from the listening thread) when a schedule was added, changed or removed, before
        #: the loop is woken: the drain runs a scheduler pass and sleeps until the new next occurrence
        self.on_schedules = on_schedules
        self.lost = False  # another watcher took the row over (this one's heartbeat had expired)
        self.heard: list[str] = []  # payloads of the notifications that woke the loop (the latest 100)
        self._q = db.queries(schema)
        self._conn: psycopg.Connection[Any] | None = None
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_seen = time.monotonic()
        self._next_beat = 0.0
        #: Until when the row is surely this watcher's: the lease from the moment before its last
        #: take or heartbeat was sent (the server's heartbeat is no earlier, so this ends first).
        self._held_until = 0.0

    def holds(self) -> bool:
        """Whether this watcher may claim: it has not lost the row, and its last heartbeat is
        younger than its lease (past it, a cron tick may have taken the queues over without this
        one knowing yet: a stopped process, a heartbeat that could not reach the database). It
        holds again once a heartbeat goes through; ``lost`` once one finds the row taken."""
        return not self.lost and time.monotonic() < self._held_until

    def alive(self) -> None:
        """The drain loop turned: the heartbeat goes on. A loop that stops turning (hung) stops
        it, and after the lease a cron tick takes the queues over."""
        self._loop_seen = time.monotonic()

    def acquire(self) -> bool:
        """Connect, take the set's row and LISTEN. False (and nothing held) when another live
        watcher holds the row. PoolerError when the connection goes through a transaction
        pooler, where LISTEN does not work."""
        db.require_session(self.conninfo, why="watch mode (LISTEN and the watcher lock)")
        conn = self._connect()
        if conn is None:
            return False
        self._conn = conn
        self._thread = threading.Thread(target=self._listen, name="watcher", daemon=True)
        self._thread.start()
        return True

    def _params(self) -> dict[str, Any]:
        return {"queues": self.set_name, "holder": self.holder, "lease": self.lease}

    def _connect(self) -> psycopg.Connection[Any] | None:
        conn = db.connect(self.conninfo, autocommit=True)
        try:
            with db.errors_translated(self.schema):
                conn.execute(self._q["watcher_lock_timeout"])
                sent = time.monotonic()
                try:
                    row = conn.execute(self._q["watcher_take"], self._params()).fetchone()
                except db.LockTimeout:  # someone with rights on the table holds the row: not ours
                    row = None
                if not row or not row[0]:
                    conn.close()
                    return None
                self._held_until = sent + self.lease
                self._next_beat = time.monotonic() + self.beat_every
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
        """Connect when there is no connection, then pass on about a second of notifications and
        renew the heartbeat when it is due. None: another watcher took the row over (this one
        stops)."""
        if conn is None:
            conn = self._connect()
            if conn is None:
                log.warning("another watcher took over queue(s) %s while the database was away", self.set_name)
                self._lose()
                return None
            self._conn = conn
            self.wake.set()  # notifications sent while we were away were missed: look once
        for note in conn.notifies(timeout=1.0):
            if note.payload == SCHEDULES_CHANGED:  # every watcher runs every schedule
                if self.on_schedules is not None:
                    self.on_schedules()
                self.heard = [*self.heard[-99:], note.payload]
                self.wake.set()
            elif self._relevant(note.payload):
                self.heard = [*self.heard[-99:], note.payload]
                self.wake.set()
            if self._closing.is_set():
                break
        now = time.monotonic()
        if now >= self._next_beat and now - self._loop_seen < self.lease:
            try:
                with db.errors_translated(self.schema):
                    row = conn.execute(self._q["watcher_beat"], self._params()).fetchone()
            except db.LockTimeout:
                return conn  # the row is held by someone with rights on it: try again next second
            self._next_beat = now + self.beat_every
            if row:
                self._held_until = now + self.lease
            else:
                log.warning("another watcher took over queue(s) %s: this one's heartbeat was older than its"
                            " lease (%g s)", self.set_name, self.lease)
                self._lose()
                return None
        return conn

    def _lose(self) -> None:
        self.lost = True
        self.wake.set()

    def close(self) -> None:
        """Stop listening and free the row, so the next cron tick need not wait for the lease."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                with db.errors_translated(self.schema):
                    conn.execute(self._q["watcher_release"], self._params())
            except db.DatabaseError as exc:  # the lease frees it anyway
                log.debug("watcher row not released: %s", exc)
            finally:
                conn.close()
