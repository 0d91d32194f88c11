"""Enqueueing through an app's own database layer (SQLAlchemy sync and async, Django): the job
joins the app's transaction, so it exists if the app commits and not if it rolls back."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from fleetless import Queue
from fleetless.async_queue import asyncpg_dsn
from fleetless.integrations import sqlalchemy as fl_sqlalchemy


def _url(dsn: str, dialect: str) -> str:
    return asyncpg_dsn(dsn).replace("postgresql://", f"postgresql+{dialect}://", 1)


def test_sqlalchemy_session_commit_keeps_the_job_and_rollback_leaves_nothing(queue: Queue, dsn: str,
                                                                              sql: Any) -> None:
    engine = create_engine(_url(dsn, "psycopg"))
    sql("CREATE TABLE invoices (id int PRIMARY KEY)")
    with Session(engine) as session, session.begin():
        session.execute(text("INSERT INTO invoices VALUES (1)"))
        kept = fl_sqlalchemy.enqueue(session, "render-invoice", {"id": 1}, queue="billing")
        fl_sqlalchemy.enqueue_many(session, [("thumb", {"i": 1})], priority=4)
    with Session(engine) as session:
        session.begin()
        session.execute(text("INSERT INTO invoices VALUES (2)"))
        fl_sqlalchemy.enqueue(session, "render-invoice", {"id": 2})
        session.rollback()
    with engine.connect() as conn:  # a Connection works as well as a Session
        fl_sqlalchemy.enqueue(conn, "render-invoice", {"id": 3})
        conn.rollback()
    engine.dispose()
    assert sql("SELECT kind, payload, queue, priority FROM fleetless.jobs ORDER BY id") == [
        ("render-invoice", {"id": 1}, "billing", 0), ("thumb", {"i": 1}, "default", 4)]
    assert sql("SELECT id FROM invoices") == [(1,)]
    assert kept == sql("SELECT min(id) FROM fleetless.jobs")[0][0]


@pytest.mark.parametrize("dialect", ["psycopg", "asyncpg"])
def test_sqlalchemy_async_session_joins_the_apps_transaction(queue: Queue, dsn: str, sql: Any,
                                                             dialect: str) -> None:
    async def main() -> None:
        engine = create_async_engine(_url(dsn, dialect))
        async with AsyncSession(engine) as session, session.begin():
            await fl_sqlalchemy.enqueue_async(session, "report", {"month": "2026-11"}, priority=2)
            await fl_sqlalchemy.enqueue_many_async(session, [("thumb", {}), ("thumb", {})], queue="media")
        async with AsyncSession(engine) as session:
            await session.begin()
            await fl_sqlalchemy.enqueue_async(session, "report", {"month": "lost"})
            await session.rollback()
        await engine.dispose()

    asyncio.run(main())
    assert sql("SELECT kind, payload, queue, priority FROM fleetless.jobs ORDER BY id") == [
        ("report", {"month": "2026-11"}, "default", 2), ("thumb", {}, "media", 0), ("thumb", {}, "media", 0)]


def test_django_atomic_commit_keeps_the_job_and_an_exception_rolls_it_back(queue: Queue, dsn: str,
                                                                             sql: Any) -> None:
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    script = textwrap.dedent(f"""
        import django
        from django.conf import settings
        settings.configure(DATABASES={{"default": {{
            "ENGINE": "django.db.backends.postgresql", "NAME": {info.get("dbname")!r},
            "USER": {info.get("user", "")!r}, "HOST": {info.get("host", "")!r}, "PORT": {str(info.get("port", ""))!r},
        }}}})
        django.setup()
        from django.db import connection, transaction
        from fleetless.integrations.django import enqueue, enqueue_many

        with transaction.atomic():
            print(int(enqueue("render-invoice", {{"id": 1}}, queue="billing")))
            enqueue_many([("thumb", {{}})], priority=3)
        try:
            with transaction.atomic():
                enqueue("render-invoice", {{"id": 2}})
                raise RuntimeError("the view failed")
        except RuntimeError:
            pass
        enqueue("audit", {{"autocommit": True}})   # outside atomic(): committed at once
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert sql("SELECT id, kind, payload, queue, priority FROM fleetless.jobs ORDER BY id") == [
        (int(r.stdout), "render-invoice", {"id": 1}, "billing", 0), (int(r.stdout) + 1, "thumb", {}, "default", 3),
        (int(r.stdout) + 3, "audit", {"autocommit": True}, "default", 0)]


def _brought_by(dist: str, extras: set[str]) -> set[str]:
    """The distributions ``pip install 'dist[extras]'`` installs, read from the installed packages'
    metadata (what a fresh venv would resolve), the test venv's other packages aside."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    brought: set[str] = set()
    todo, seen = [(dist, frozenset(extras))], set()
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        try:
            lines = requires(name) or []
        except PackageNotFoundError:
            continue
        for line in lines:
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (wanted or {""})):
                continue
            brought.add(canonicalize_name(req.name))
            todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    return brought


def test_the_sqlalchemy_extra_brings_greenlet_which_an_async_session_needs() -> None:
    """``pip install 'fleetless[sqlalchemy]'`` alone must let ``enqueue_async`` run: SQLAlchemy's
    asyncio needs greenlet, which only ``sqlalchemy[asyncio]`` brings (the test extra hid its absence:
    playwright depends on greenlet too)."""
    assert "greenlet" in _brought_by("fleetless", {"sqlalchemy"})
