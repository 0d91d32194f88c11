"""Prometheus metrics in the text exposition format, read from the table through ``insights``.

Every value is computed from the jobs table at scrape time, never kept in a process: drainers are
short-lived and many, so this is right whichever drainer ran the jobs, and any number of
``/metrics`` endpoints (or ``fleetless metrics`` from cron) agree.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .insights import DURATION_BUCKETS, Insights
from .job import Status

__all__ = ["CONTENT_TYPE", "TableCollector", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class TableCollector(Collector):
    """Collects a fresh :class:`fleetless.insights.MetricsSnapshot` on every scrape."""

    def __init__(self, insights: Insights) -> None:
        self.insights = insights

    def collect(self) -> Iterator[Metric]:
        snap = self.insights.metrics()
        jobs = GaugeMetricFamily("fleetless_jobs", "Pending and running jobs by queue, kind and status.",
                                 labels=["queue", "kind", "status"])
        running: dict[str, int] = {}
        for queue, kind, status, n in snap.jobs:
            jobs.add_metric([queue, kind, status], n)
            if status == Status.RUNNING:
                running[kind] = running.get(kind, 0) + n
        yield jobs
        kept = GaugeMetricFamily("fleetless_finished_jobs",
                                 "Finished jobs (done, dead, cancelled) still in the table, by kind and status.",
                                 labels=["kind", "status"])
        for kind, status, n in snap.kept:
            kept.add_metric([kind, status], n)
        yield kept
        oldest = GaugeMetricFamily("fleetless_oldest_due_job_age_seconds",
                                   "How long the oldest due, unclaimed job of each queue has waited.",
                                   labels=["queue"])
        for queue, seconds in sorted(snap.oldest_due_age.items()):
            oldest.add_metric([queue], seconds)
        yield oldest
        run = GaugeMetricFamily("fleetless_running_jobs", "Jobs running now, by kind.", labels=["kind"])
        for kind, n in sorted(running.items()):
            run.add_metric([kind], n)
        yield run
        finished = CounterMetricFamily(
            "fleetless_attempts_finished", "Attempts that ended, by kind and outcome (done, failed, retried, "
            "dead, released, expired, cancelled, discarded, snoozed), from the attempt history; "
            "pruning does not lower it.",
            labels=["kind", "outcome"])
        for kind, outcome, n in snap.finished:
            finished.add_metric([kind, outcome], n)
        yield finished
        hist = HistogramMetricFamily("fleetless_attempt_duration_seconds",
                                     "From claim to outcome, of every attempt that ended, by kind and outcome.",
                                     labels=["kind", "outcome"])
        for (kind, outcome), (cumulative, total, count) in sorted(snap.durations.items()):
            buckets = [(_bound(b), float(c)) for b, c in zip(DURATION_BUCKETS, cumulative, strict=True)]
            buckets.append(("+Inf", float(count)))
            hist.add_metric([kind, outcome], buckets, total)
        yield hist


def _bound(b: float) -> str:
    return str(float(b))


def render(insights: Insights) -> bytes:
    """The whole exposition, as ``/metrics`` serves it and ``fleetless metrics`` prints it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TableCollector(insights))
    return generate_latest(registry)
