"""Enqueue from Django (its ``postgresql`` backend on psycopg 3) in the request's transaction::

    with transaction.atomic():
        invoice.save()
        enqueue("render-invoice", {"id": invoice.pk})   # exists only if the block commits

Outside ``atomic()`` (Django's autocommit) the job is committed at once, as a save would be.
"""

from __future__ import annotations

from typing import Any

import psycopg

from ..queue import Enqueued, Queue

__all__ = ["enqueue", "enqueue_many"]


def _raw(using: str) -> psycopg.Connection[Any]:
    from django.db import connections

    connection = connections[using]
    connection.ensure_connection()
    raw = connection.connection
    if not isinstance(raw, psycopg.Connection):
        raise ValueError(f"fleetless needs Django's postgresql backend on psycopg 3 for database {using!r}, "
                         f"not {connection.vendor} on {type(raw).__module__}")
    return raw


def enqueue(kind: str, payload: Any, *, using: str = "default", schema: str | None = None,
            **options: Any) -> Enqueued:
    """:meth:`fleetless.Queue.enqueue` on Django's connection ``using``, in its transaction."""
    raw = _raw(using)
    return Queue(raw, schema=schema).enqueue(kind, payload, conn=raw, **options)


def enqueue_many(jobs: Any, *, using: str = "default", schema: str | None = None, **defaults: Any) -> list[int]:
    """:meth:`fleetless.Queue.enqueue_many` on Django's connection ``using``, in its transaction."""
    raw = _raw(using)
    return Queue(raw, schema=schema).enqueue_many(jobs, conn=raw, **defaults)
