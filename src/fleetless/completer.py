"""The completer: writes the outcomes of claimed jobs, inline or batched, always fenced per row.

Every outcome goes through :meth:`Queue.finish_claims` (finish_many): one ``UPDATE … FROM
jsonb_array_elements(…)`` per flush, each row matched on ``(id, claim_token, status = 'running')``,
so a drainer whose claim was reaped and taken over can never overwrite the new owner's outcome (it
learns it from the rows missing in the answer: ``fenced_out``). Outcomes are told apart by claim
(job id and claim token), never by job id alone: a flush retried after its reply was lost finds
its own earlier write by the claim's token in the attempt history, also when the drain has
claimed the same job again meanwhile (a snooze or a retry due at once), and counts it as written.

Two ways to use it:

- **inline** (per-job mode): ``add`` then ``flush`` before the slot claims its next job, so an
  outcome is durable before anything else happens; a crash loses at most the job that was
  running, which the reaper gives back.
- **batched** (``start``): a background thread flushes when ``flush_size`` outcomes are waiting
  or ``flush_interval`` seconds after the first of them arrived, at most ``STATEMENT_ROWS`` of
  them per statement (or ``flush_size``, when larger); ``close`` flushes what is left, on two
  connections at once when given a second one (the drain's own). A flush that loses the database
  keeps its outcomes and is tried again (backing off to 5 s). A
  drainer SIGKILLed between a job's end and the flush has written nothing for that job: its claim
  is reaped and the job runs again (at-least-once, as documented in docs/guarantees.md).

One bad row never fails the others: when the database refuses a flush for any reason but a lost
connection, its outcomes are written one by one; an outcome the database cannot store (a value
out of range, a constraint, text it cannot encode) fails that job alone, permanently, with a
one-line reason. Any other error stops the background thread (:attr:`Completer.failure`) and
leaves the outcomes buffered: the drainer then gives back what it holds (:meth:`settle`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from . import db
from .events import finished_as
from .job import Claim, Job, Outcome, Run, Status, claim_of
from .queue import Queue
from .retry import RetryPolicy

__all__ = ["NOT_STORABLE", "Completer", "Counts"]

log = logging.getLogger("fleetless.completer")
#: Heads last_error when the database refused a job's outcome (the job fails alone, permanently).
NOT_STORABLE = "its outcome cannot be stored: "
T = TypeVar("T")
#: Most outcomes the background thread writes in one statement: a larger one (a backlog of many
#: batches) runs long on one core while the next outcomes wait; much smaller ones pay a commit each.
STATEMENT_ROWS = 2000


@dataclass
class Counts:
    """What the completer has written so far."""

    done: int = 0
    failed: int = 0  # failed with attempts left
    retried: int = 0  # the same, asked by the handler (Retry)
    dead: int = 0
    discarded: int = 0  # of the dead: their handler raised Discard
    released: int = 0  # claims given back without charging an attempt
    snoozed: int = 0  # jobs whose handler asked to come back later (not charged)
    cancelled: int = 0  # jobs an operator cancelled while they ran
    fenced_out: int = 0  # outcomes not written: the claim had been reaped (and maybe taken over)


class Completer:
    def __init__(
        self,
        queue: Queue,
        retry: RetryPolicy | None = None,
        *,
        flush_size: int = 500,
        flush_interval: float = 0.05,
        on_written: Callable[[Job, Outcome, Status | None], None] | None = None,
        retry_of: Callable[[Job], RetryPolicy] | None = None,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        if flush_size < 1 or flush_interval <= 0:
            raise ValueError("flush_size must be at least 1 and flush_interval positive")
        self.queue = queue
        self.retry = retry or RetryPolicy()
        self.flush_size = flush_size
        self.flush_interval = flush_interval
        #: called for each outcome once written (status: its new status; None: fenced out)
        self.on_written = on_written
        self.retry_of = retry_of  # a kind's own policy (fleetless.toml); None: ``retry`` for all
        self.counts = Counts()
        #: outcomes written (or fenced out) so far: a batch drain whose claim came back short claims
        #: again when this grew since (a finish may have released a workflow's children)
        self.written = 0
        self._buffer: list[tuple[Job, Outcome]] = []
        self._first_at: float | None = None  # monotonic time the oldest buffered outcome arrived
        self._cond = threading.Condition()
        self._flushing = threading.Lock()  # one flush at a time (close's second connection aside)
        self._thread: threading.Thread | None = None
        self._closing = False
        self.last_error: str | None = None  # the latest failed flush's reason (batched mode)
        #: batched mode: the error (not a lost connection) that stopped the background thread
        self.failure: BaseException | None = None
        self.on_failure = on_failure  # called once when ``failure`` is set

    # -- adding -------------------------------------------------------------------------------

    def add(self, job: Job, outcome: Outcome) -> None:
        """Buffer one job's outcome. A failure gets its retry delay from the policy here (unless
        its handler chose one: fleetless.outcomes' Retry(after=...))."""
        if outcome.action == "fail" and not outcome.permanent and not outcome.own_delay:
            policy = self.retry if self.retry_of is None else self.retry_of(job)
            outcome = replace(outcome, delay=policy.delay(job.attempts))
        with self._cond:
            first = not self._buffer
            if first:
                self._first_at = time.monotonic()
            self._buffer.append((job, outcome))
            if first or len(self._buffer) >= self.flush_size:  # start the timer, or flush now
                self._cond.notify_all()

    def holding(self) -> list[Job]:
        """Jobs whose outcome is buffered, not yet written (their leases must stay alive)."""
        with self._cond:
            return [job for job, _ in self._buffer]

    @property
    def buffered(self) -> int:
        with self._cond:
            return len(self._buffer)

    @property
    def unwritten(self) -> bool:
        """Outcomes are buffered, or being written now (the background thread took them out of the
        buffer and has not committed them yet)."""
        return bool(self.buffered) or self._flushing.locked()

    # -- writing ------------------------------------------------------------------------------

    def flush(self) -> None:
        """Write everything buffered, in one statement. When the database refuses it (anything but
        a lost connection), row by row: an outcome it cannot store fails its job alone. On any
        other error the outcomes not written stay buffered (nothing is lost) and it propagates."""
        self._write(self._finish_many, with_claim=False)

    def _finish_many(self, items: list[tuple[Job, Outcome]]) -> tuple[dict[Claim, Status], None]:
        return self.queue.finish_claims(items), None

    def flush_then_claim(
        self, claim: Callable[[list[tuple[Job, Outcome]]], tuple[dict[Claim, Status], list[Job]]]
    ) -> list[Job] | None:
        """As :meth:`flush`, with the caller's next claim in the same transaction: ``claim`` takes
        the outcomes, writes them and claims (:meth:`Queue.finish_then_claim`) and returns what was
        written and what was claimed. Returns the claimed jobs; None when nothing was claimed with
        them: nothing was buffered, or the database refused the two (the outcomes are then written
        one by one, as by :meth:`flush`), and the caller claims on its own."""
        return self._write(claim, with_claim=True)

    def _write(self, write: Callable[[list[tuple[Job, Outcome]]], tuple[dict[Claim, Status], T]], *,
               with_claim: bool, limit: int | None = None) -> T | None:
        """Take what is buffered and write it with ``write`` (which returns the statuses written and
        whatever else its statement gave: the claim's jobs). A lost connection, or any error but a
        refusal, puts the outcomes back and propagates. A refusal writes them one by one and
        returns None; a lone outcome's own refusal is final then, but with a claim the refusal may
        have been the claim's, so each outcome is tried again alone. ``limit``: at most this many
        of the oldest outcomes (the background thread's statements stay short)."""
        with self._flushing:
            items = self._take(limit)
            if not items:
                return None
            try:
                written, also = write(items)
            except ConnectionError:
                self._put_back(items)
                raise
            except db.DatabaseError as exc:  # one row (or more) it refuses: the others are written
                if with_claim:
                    log.debug("writing outcomes with the next claim failed (%s); writing them alone", _first_line(exc))
                elif len(items) > 1:
                    log.warning("writing %d outcomes in one statement failed (%s); writing them one by one",
                                len(items), _first_line(exc))
                self._one_by_one(items, refused=exc if len(items) == 1 and not with_claim else None)
                return None
            except BaseException:
                self._put_back(items)
                raise
            self._count(items, written)
            return also

    def settle(self, reason: str) -> tuple[int, int]:
        """After the drain failed: write each buffered outcome once; give back (release, fenced,
        uncharged) each one whose write fails. Stops at a lost connection, leaving the rest
        buffered. Returns (outcomes written, claims released)."""
        written = released = 0
        with self._flushing:
            items = self._take()
            for i, (job, outcome) in enumerate(items):
                try:
                    self._count([(job, outcome)], self._write_one(job, outcome))
                    written += 1
                    continue
                except ConnectionError:
                    self._put_back(items[i:])
                    break
                except Exception as exc:
                    log.warning("job %d: its outcome could not be written (%s); giving its claim back",
                                job.id, _first_line(exc))
                back = Outcome("release", error=reason, run=outcome.run)
                try:
                    self._count([(job, back)], self.queue.finish_claims([(job, back)]))
                    released += 1
                except ConnectionError:
                    self._put_back(items[i:])
                    break
                except Exception as exc:
                    log.warning("job %d: could not give its claim back (%s); it runs again after its lease",
                                job.id, _first_line(exc))
        return written, released

    def _take(self, limit: int | None = None) -> list[tuple[Job, Outcome]]:
        """The buffered outcomes, or the ``limit`` oldest of them (the rest keep their wait: the
        oldest of them arrived no earlier than the first taken, so they are due at once)."""
        with self._cond:
            if limit is None or len(self._buffer) <= limit:
                items, self._buffer = self._buffer, []
                self._first_at = None
            else:
                items, self._buffer = self._buffer[:limit], self._buffer[limit:]
        return items

    def _put_back(self, items: list[tuple[Job, Outcome]]) -> None:
        with self._cond:
            self._buffer[:0] = items
            self._first_at = time.monotonic()

    def _one_by_one(self, items: list[tuple[Job, Outcome]], refused: db.DatabaseError | None = None) -> None:
        """``refused``: the error the one item's own write met already (not tried again)."""
        for i, (job, outcome) in enumerate(items):
            try:
                written = self._write_one(job, outcome, refused)
            except BaseException:
                self._put_back(items[i:])
                raise
            self._count([(job, outcome)], written)

    def _write_one(self, job: Job, outcome: Outcome, refused: db.DatabaseError | None = None) -> dict[Claim, Status]:
        """One outcome; one the database cannot store becomes a permanent failure of its job."""
        try:
            if refused is not None:
                raise refused
            return self.queue.finish_claims([(job, outcome)])
        except db.ValueNotStorable as exc:
            if outcome.action == "release":  # its text is the drainer's own: nothing to drop
                raise
            run = outcome.run or Run()
            stored = Outcome("fail", error=NOT_STORABLE + _first_line(exc), permanent=True,
                             run=Run(tier=run.tier, exit_code=run.exit_code, signal=run.signal))
            log.warning("job %d: %s%s; failed", job.id, NOT_STORABLE, _first_line(exc))
            return self.queue.finish_claims([(job, stored)])

    def _count(self, items: list[tuple[Job, Outcome]], written: dict[Claim, Status]) -> None:
        c = self.counts
        self.written += len(items)
        for job, outcome in items:
            status = written.get(claim_of(job))
            if self.on_written is not None:
                self.on_written(job, outcome, status)
            what = finished_as(job, outcome, status)
            if what == "fenced_out":
                c.fenced_out += 1
                log.warning("job %d: finished, but its claim had expired and was taken over", job.id)
            elif what in ("dead", "discarded"):
                c.dead += 1  # the drain's reporter says so (fleetless -v drain)
                c.discarded += what == "discarded"
            else:
                setattr(c, what, getattr(c, what) + 1)

    # -- batched mode -------------------------------------------------------------------------

    def start(self) -> None:
        """Flush in the background on size or timer until :meth:`close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="completer", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        backoff = self.flush_interval
        while True:
            with self._cond:
                while not self._closing:
                    if self._buffer:
                        assert self._first_at is not None
                        due = self._first_at + max(self.flush_interval, backoff)
                        if len(self._buffer) >= self.flush_size and backoff <= self.flush_interval:
                            break
                        left = due - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                    else:
                        self._cond.wait()
                if self._closing:
                    return
            try:
                self._write(self._finish_many, with_claim=False, limit=max(self.flush_size, STATEMENT_ROWS))
                backoff = self.flush_interval
                self.last_error = None
            except ConnectionError as exc:  # the database is away: keep the outcomes and try again
                self.last_error = _first_line(exc)
                log.warning("writing %d outcome(s) failed (%s); retrying", self.buffered, self.last_error)
                backoff = min(max(backoff * 2, 0.2), 5.0)
            except Exception as exc:  # no rule for it: the outcomes stay buffered, the drainer decides
                self.last_error = _first_line(exc)
                self.failure = exc
                if self.on_failure is not None:
                    self.on_failure()
                return

    def stop(self) -> None:
        """Stop the background thread (after its flush in progress); nothing more is written."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self, flush: Callable[[Callable[[], None]], None] | None = None, beside: Queue | None = None) -> None:
        """Stop the background thread, then write what is left: ``flush(self.flush)`` lets the
        caller wrap the last write in its own retry (the drainer's database ride-out). The error
        that stopped the background thread, if one did, is raised here.

        ``beside``: a second connection (the drain's own, idle by then) that writes half of what
        is left at the same time, each half one statement: the drain's tail is its last outcomes,
        which one connection would write on one core. What it could not write is put back and
        written by the closing flush."""
        self.stop()
        if self.failure is not None:
            raise self.failure
        run = flush if flush is not None else _call
        helper = None
        beside_written: list[tuple[list[tuple[Job, Outcome]], dict[Claim, Status]]] = []
        if beside is not None and self.buffered > self.flush_size:
            half = self._take(self.buffered // 2)
            helper = threading.Thread(target=self._write_beside, args=(beside, half, beside_written),
                                      name="completer-beside")
            helper.start()
        try:
            run(self.flush)
        finally:
            if helper is not None:
                helper.join()
            for items, written in beside_written:  # counted (and reported) here, by one thread
                self._count(items, written)
        if self.buffered:  # put back by the second connection
            run(self.flush)

    def _write_beside(self, queue: Queue, items: list[tuple[Job, Outcome]],
                      written: list[tuple[list[tuple[Job, Outcome]], dict[Claim, Status]]]) -> None:
        """close()'s second writer: one statement on ``queue``'s connection. Whatever stops it (a
        lost connection, a refusal) puts the outcomes back, for the closing flush (one by one
        there, if refused); what it wrote is counted by close() itself."""
        try:
            written.append((items, queue.finish_claims(items)))
        except BaseException as exc:
            log.debug("writing outcomes on the second connection failed (%s)", _first_line(exc))
            self._put_back(items)


def _call(f: Callable[[], None]) -> None:
    f()


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
