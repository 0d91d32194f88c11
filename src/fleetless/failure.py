"""How a failed attempt is put in one line: what happened (``exit code 1``, a kill reason) with
what the program said about why. The drain writes it (``last_error``'s first line, an attempt's
``error_head``); every front end shows it (re-exported by :mod:`fleetless.insights`)."""

from __future__ import annotations

import re

__all__ = ["HEAD_CHARS", "RESULT_JSON_BYTES", "error_head", "exception_line", "result_not_json", "result_too_large",
           "summarize_failure"]

#: Longest error head shown in a list (the full error is on the job's own page / `show`).
HEAD_CHARS = 200

#: The largest JSON result a handle() may return (the batch runner's RESULT_BYTES; a script's stdout
#: is cut at the same size instead, and kept).
RESULT_JSON_BYTES = 64 * 1024

_TRACEBACK = "Traceback (most recent call last):"


def exception_line(stderr: str) -> str | None:
    """What a failed program said last about why: for a Python traceback the exception's own line
    (``ValueError: invoice 42 has no lines``), else the last non-empty line of stderr."""
    lines = stderr.rstrip().splitlines()
    start = None
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].strip() == _TRACEBACK:
            start = i
            break
    if start is not None:
        for line in lines[start + 1:]:
            if line and not line[0].isspace():
                return line.strip()[:HEAD_CHARS]
    for line in reversed(lines):
        if line.strip():
            return line.strip()[:HEAD_CHARS]
    return None


def summarize_failure(head: str, stderr: str) -> str:
    """The first line of a failed attempt's error: what happened (``exit code 1``, a kill reason),
    with what the program said about why when it exited by itself."""
    said = exception_line(stderr)
    return f"{head}: {said}" if said else head


_BARE_EXIT = re.compile(r"exit code -?\d+")


def error_head(last_error: str | None) -> str | None:
    """One line naming what happened, from a whole ``last_error``: its first line (errors are
    written that way), or, for rows written before that was so (``exit code 1`` then a
    traceback), the exit code with the exception's line."""
    if not last_error:
        return None
    first, _, rest = last_error.partition("\n")
    if _BARE_EXIT.fullmatch(first.strip()) and rest.strip():
        first = summarize_failure(first.strip(), rest)
    return first.strip()[:HEAD_CHARS]


def result_too_large(size: int) -> str:
    """The one-line error of a handle() whose result is past RESULT_JSON_BYTES: the job is dead at
    once, as the same payload would return as much again."""
    return (f"handle() returned {size} bytes of JSON, past the {RESULT_JSON_BYTES}-byte (64 KiB) cap on a result;"
            " dead without retries (store a large result elsewhere and return where it is)")


def result_not_json(why: str) -> str:
    """The one-line error of a handle() whose returned value JSON cannot hold (``why``: its type and
    json's complaint): the job is dead at once, as the same payload would return the same again."""
    line = " ".join(why.split())[:300]
    return (f"handle() returned a value JSON cannot hold ({line}); dead without retries"
            " (return None, a bool, a number, a string, or lists and dicts of them)")
