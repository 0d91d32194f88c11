"""fleetless: a PostgreSQL job queue with no worker fleet."""

from . import _driver  # noqa: F401  (first: it imports psycopg without its version lookups)
from .job import Job, Status
from .queue import Enqueued, JobNotFound, Queue
from .retry import RetryPolicy

__all__ = ["Enqueued", "Job", "JobNotFound", "Queue", "RetryPolicy", "Status"]
__version__ = "0.1.0"
