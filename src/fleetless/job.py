"""The vocabulary: a claimed ``Job``, its ``Status``, and validation of what reaches the table."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

__all__ = [
    "MAX_PAYLOAD_BYTES",
    "MAX_PAYLOAD_DEPTH",
    "Claim",
    "Job",
    "Outcome",
    "Run",
    "Status",
    "claim_of",
    "encode_payload",
    "validate_kind",
    "validate_queue_name",
]

#: Default cap on an encoded payload. Payloads are arguments, not data: put blobs elsewhere.
MAX_PAYLOAD_BYTES = 1024 * 1024
#: Deepest nesting of arrays and objects a payload may have (checked without recursion, so the
#: answer does not depend on the caller's stack).
MAX_PAYLOAD_DEPTH = 100

# Used with fullmatch: a "$" would also match before a trailing newline ("abc\n").
_KIND_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
_QUEUE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
# A JSON \u0000 escape, i.e. a NUL character: preceded by an even number of backslashes (the text
# \\u0000, a backslash then "u0000", is not one).
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


class Status(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    DEAD = "dead"
    CANCELLED = "cancelled"
    WAITING = "waiting"  # a workflow's job whose parents have not all ended yet (never claimed)


#: Every this-many-th release of a job in a row is charged as a failed attempt (Queue.release,
#: finish_many).
MAX_RELEASES = 5


@dataclass(frozen=True)
class Job:
    """A job as a drainer holds it after a claim."""

    id: int
    kind: str
    payload_json: str  # as the table stores it; handed to the sandbox as it is
    attempts: int
    max_attempts: int
    claim_token: uuid.UUID
    timeout_seconds: int | None = None
    queue: str = "default"
    priority: int = 0
    lease_seconds: float | None = None  # the lease left when the claim returned, by the database's clock
    snoozes: int = 0  # how many times its handler snoozed it so far (FLEETLESS_SNOOZES)
    releases: int = 0  # its give-backs in a row so far (the MAX_RELEASES-th is charged)

    @property
    def payload(self) -> Any:
        """The payload, parsed (the drainer itself never needs to)."""
        return json.loads(self.payload_json)

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> Job:
        """A claimed row (its values in the field order) as a Job, the same as ``Job(*row)``,
        built without the frozen ``__init__``'s one ``object.__setattr__`` per field: a batch
        claim builds thousands of them and that was a visible share of a drain's time."""
        job = _new(cls)
        _setattr(job, "__dict__", dict(zip(_JOB_FIELDS, row, strict=True)))
        return job


#: One claim of a job, as every fenced write names it: (job id, claim token). A job claimed again
#: (a snooze or retry due at once) is another claim; outcomes are told apart by it, not by the id.
Claim = tuple[int, uuid.UUID]


def claim_of(job: Job) -> Claim:
    return job.id, job.claim_token


@dataclass(frozen=True)
class Run:
    """How one attempt ran, for its row in the attempt history: the sandbox tier, and how the
    handler ended (an exit status, or the signal that killed it, and the reason if the sandbox or
    the drainer did the killing). All None: it never ran (no handler)."""

    tier: str | None = None
    exit_code: int | None = None
    signal: str | None = None
    kill_reason: str | None = None


@dataclass(frozen=True)
class Outcome:
    """How one run of a claimed job ended, as the completer writes it.

    ``done``: with the script's stdout (``result``) or handle()'s value as JSON text
    (``result_json``). ``fail``: ``error`` is the job's last_error; back to pending after ``delay``
    seconds while attempts are left, unless ``permanent``, else dead. ``release``: not the job's
    fault (the drainer stopped, a sandbox broke): pending again with the attempt given back.
    ``snooze``: the handler asked to come back after ``delay`` seconds (fleetless.outcomes):
    pending again with the attempt given back, at most MAX_SNOOZES times per job.

    ``decided``: the handler's own decision (:mod:`fleetless.decisions`): ``discard`` (a permanent
    fail, recorded as ``discarded``), ``snooze`` (recorded as ``snoozed``), or ``retry`` (a fail,
    recorded as ``retried``; its ``delay`` is the handler's when ``own_delay``, else the retry
    policy's); None otherwise (a plain failure is recorded as ``failed``)."""

    action: Literal["done", "fail", "release", "snooze"]
    error: str | None = None
    result: str | None = None
    result_cut: bool = False  # the sandbox dropped stdout past its cap: the stored result says so
    result_json: str | None = None
    permanent: bool = False
    delay: float = 0.0
    run: Run | None = None  # for the attempt history; None: nothing known of how it ran
    decided: Literal["discard", "snooze", "retry"] | None = None
    own_delay: bool = False  # a fail's ``delay`` is the handler's own (Retry(after=...)), not the policy's


_new = object.__new__
_setattr = object.__setattr__
_JOB_FIELDS = tuple(Job.__dataclass_fields__)
_DONE = dict(Outcome("done").__dict__)


def done_with_json(result_json: str, run: Run | None) -> Outcome:
    """``Outcome("done", result_json=..., run=...)``, built as :meth:`Job.from_row` is (one per
    job of a batch of small jobs)."""
    outcome = _new(Outcome)
    _setattr(outcome, "__dict__", {**_DONE, "result_json": result_json, "run": run})
    return outcome


def validate_kind(kind: object) -> str:
    """A kind becomes a file name in the handlers directory, so it is held to a strict pattern."""
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind) or ".." in kind:
        raise ValueError(
            f"invalid job kind {kind!r}: use 1-64 of a-z 0-9 _ . - starting with a letter or digit,"
            " without '..'"
        )
    return kind


def validate_queue_name(queue: object) -> str:
    if not isinstance(queue, str) or not _QUEUE_RE.fullmatch(queue):
        raise ValueError(
            f"invalid queue name {queue!r}: use 1-64 of A-Z a-z 0-9 _ . : - starting with a letter or digit"
        )
    return queue


def encode_payload(payload: Any, max_bytes: int = MAX_PAYLOAD_BYTES) -> str:
    """JSON text PostgreSQL's jsonb will store exactly, or a one-line ValueError saying why not."""
    try:
        text = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"payload is not JSON-serialisable: {exc}") from None
    except RecursionError:
        raise ValueError(f"payload is nested deeper than {MAX_PAYLOAD_DEPTH} levels") from None
    _check_structure(payload)  # after json.dumps, which refuses cycles
    if "\x00" in text or _NUL_ESCAPE.search(text):
        raise ValueError("payload contains a NUL character (\\u0000), which jsonb cannot store")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"payload contains an unpaired surrogate at position {exc.start}, which is not valid UTF-8"
        ) from None
    if size > max_bytes:
        raise ValueError(f"payload is {size} bytes, over the limit of {max_bytes} bytes")
    return text


def _check_structure(payload: Any) -> None:
    """What json.dumps would accept but the payload would not read back as written.

    - keys 1, None and True become "1", "null" and "true" without a word, and {1: "a", "1": "b"}
      would silently lose a value;
    - jsonb keeps a number as numeric without its exponent, so a float written with one (1e16,
      1.5e300) reads back as an integer; refused here so that payloads are stored exactly;
    - nesting deeper than MAX_PAYLOAD_DEPTH."""
    stack: list[tuple[Any, int]] = [(payload, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, float):
            if "e+" in repr(value):
                raise ValueError(
                    f"payload number {value!r} would read back as an integer (jsonb keeps no exponent):"
                    " pass it as an int or a string"
                )
            continue
        if not isinstance(value, dict | list | tuple):
            continue
        if depth >= MAX_PAYLOAD_DEPTH:
            raise ValueError(f"payload is nested deeper than {MAX_PAYLOAD_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ValueError(f"payload keys must be strings, not {type(key).__name__} {key!r}")
                stack.append((item, depth + 1))
        else:
            stack.extend((item, depth + 1) for item in value)


def parse_payload_json(text: str) -> Any:
    """Parse JSON from the command line; errors carry the parser's message and position."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON payload: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise ValueError("invalid JSON payload: nested too deeply") from None
