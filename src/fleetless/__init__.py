"""fleetless: a PostgreSQL job queue with no worker fleet."""

from typing import Any

from . import _driver  # noqa: F401  (first: it imports psycopg without its version lookups)
from .job import Job, Status
from .queue import Enqueued, Finished, JobNotFound, Queue, WaitTimeout
from .retry import RetryPolicy

__all__ = ["AsyncQueue", "Enqueued", "Finished", "Job", "JobNotFound", "Queue", "RetryPolicy", "Status",
           "WaitTimeout"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``fleetless.AsyncQueue`` on first use: a cron tick's drain does not import asyncio."""
    if name == "AsyncQueue":
        from .async_queue import AsyncQueue

        return AsyncQueue
    raise AttributeError(f"module 'fleetless' has no attribute {name!r}")
