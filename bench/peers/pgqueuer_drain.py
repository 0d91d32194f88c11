"""PgQueuer as a whole process.  python pgqueuer_drain.py fill DSN JOBS | drain DSN BATCH"""

import logging
import sys

import asyncpg
import uvloop
from pgqueuer import PgQueuer
from pgqueuer.db import AsyncpgDriver
from pgqueuer.models import Job
from pgqueuer.queries import Queries
from pgqueuer.types import QueueExecutionMode


async def fill(dsn: str, n: int) -> None:
    conn = await asyncpg.connect(dsn=dsn)
    q = Queries(AsyncpgDriver(conn))
    if not await conn.fetchval("SELECT to_regclass('pgqueuer') IS NOT NULL"):
        await q.install()
    await conn.execute("TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics RESTART IDENTITY")
    await q.enqueue(["noop"] * n, [b'{"i": %d}' % i for i in range(n)], [0] * n)
    await conn.execute("ANALYZE pgqueuer")
    await conn.close()


async def drain(dsn: str, batch: int) -> None:
    conn = await asyncpg.connect(dsn=dsn)
    pgq = PgQueuer(AsyncpgDriver(conn))

    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        return None

    await pgq.run(batch_size=batch, mode=QueueExecutionMode.drain)
    left = await conn.fetchval("SELECT count(*) FROM pgqueuer")
    await conn.close()
    print(left)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    what, dsn, arg = sys.argv[1], sys.argv[2], int(sys.argv[3])
    uvloop.run(fill(dsn, arg) if what == "fill" else drain(dsn, arg))
