"""Enqueue inside a SQLAlchemy ``Session``/``Connection`` (dialect ``postgresql+psycopg``) or an
``AsyncSession``/``AsyncConnection`` (``postgresql+psycopg`` or ``postgresql+asyncpg``)::

    with Session(engine) as session, session.begin():
        session.add(invoice)
        enqueue(session, "render-invoice", {"id": invoice.id})   # commits with the invoice

    async with AsyncSession(engine) as session, session.begin():
        await enqueue_async(session, "render-invoice", {"id": 7})
"""

from __future__ import annotations

from typing import Any

import psycopg

from ..async_queue import AsyncQueue
from ..queue import Enqueued, Queue

__all__ = ["enqueue", "enqueue_async", "enqueue_many", "enqueue_many_async"]


def _driver_connection(bind: Any) -> psycopg.Connection[Any]:
    connection = bind.connection() if hasattr(bind, "get_bind") else bind  # a Session: its connection
    raw = connection.connection.driver_connection
    if not isinstance(raw, psycopg.Connection):
        raise ValueError(f"fleetless needs SQLAlchemy's psycopg (3) dialect (postgresql+psycopg://), "
                         f"not {connection.dialect.name}+{connection.dialect.driver}")
    return raw


async def _async_driver_connection(bind: Any) -> Any:
    connection = await bind.connection() if hasattr(bind, "get_bind") else bind
    raw = await connection.get_raw_connection()
    driver = raw.driver_connection
    if type(driver).__module__.startswith("asyncpg"):
        # SQLAlchemy opens its asyncpg transaction at its own first statement: until then a
        # statement on the driver would commit on its own, outside the app's transaction.
        if connection.in_transaction() and not driver.is_in_transaction():
            await connection.exec_driver_sql("SELECT 1")
    elif not isinstance(driver, psycopg.AsyncConnection):
        raise ValueError(f"fleetless needs the postgresql+psycopg or postgresql+asyncpg dialect, "
                         f"not {connection.dialect.name}+{connection.dialect.driver}")
    return driver


def enqueue(bind: Any, kind: str, payload: Any, *, schema: str | None = None, **options: Any) -> Enqueued:
    """:meth:`fleetless.Queue.enqueue` in the transaction of ``bind`` (a Session or Connection)."""
    raw = _driver_connection(bind)
    return Queue(raw, schema=schema).enqueue(kind, payload, conn=raw, **options)


def enqueue_many(bind: Any, jobs: Any, *, schema: str | None = None, **defaults: Any) -> list[int]:
    """:meth:`fleetless.Queue.enqueue_many` in the transaction of ``bind``."""
    raw = _driver_connection(bind)
    return Queue(raw, schema=schema).enqueue_many(jobs, conn=raw, **defaults)


async def enqueue_async(bind: Any, kind: str, payload: Any, *, schema: str | None = None,
                        **options: Any) -> Enqueued:
    """:meth:`fleetless.AsyncQueue.enqueue` in the transaction of ``bind`` (an AsyncSession or
    AsyncConnection)."""
    raw = await _async_driver_connection(bind)
    return await AsyncQueue(raw, schema=schema).enqueue(kind, payload, conn=raw, **options)


async def enqueue_many_async(bind: Any, jobs: Any, *, schema: str | None = None, **defaults: Any) -> list[int]:
    """:meth:`fleetless.AsyncQueue.enqueue_many` in the transaction of ``bind``."""
    raw = await _async_driver_connection(bind)
    return await AsyncQueue(raw, schema=schema).enqueue_many(jobs, conn=raw, **defaults)
