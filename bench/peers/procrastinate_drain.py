"""Procrastinate's one-shot worker as a whole process.
python procrastinate_drain.py fill DSN JOBS | drain DSN CONCURRENCY"""

import asyncio
import logging
import sys

import procrastinate


def make_app(dsn: str) -> procrastinate.App:
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn, min_size=2, max_size=12))

    @app.task(name="noop", queue="default")
    async def noop(i: int) -> None:
        return None

    app.noop = noop  # type: ignore[attr-defined]
    return app


async def fill(dsn: str, n: int) -> None:
    app = make_app(dsn)
    async with app.open_async():
        try:
            await app.schema_manager.apply_schema_async()
        except Exception:
            pass  # already there
        async with app.connector.pool.connection() as c:  # type: ignore[attr-defined]
            await c.execute("TRUNCATE procrastinate_events, procrastinate_periodic_defers, "
                            "procrastinate_jobs, procrastinate_workers RESTART IDENTITY CASCADE")
        await app.noop.batch_defer_async(*({"i": i} for i in range(n)))  # type: ignore[attr-defined]


async def drain(dsn: str, concurrency: int) -> None:
    app = make_app(dsn)
    async with app.open_async():
        await app.run_worker_async(concurrency=concurrency, wait=False, install_signal_handlers=False,
                                   delete_jobs="never")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    what, dsn, arg = sys.argv[1], sys.argv[2], int(sys.argv[3])
    asyncio.run(fill(dsn, arg) if what == "fill" else drain(dsn, arg))
