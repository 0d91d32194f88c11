"""The dashboard and ``/metrics`` (the optional extra: ``pip install 'fleetless[web]'``)."""

from __future__ import annotations

from .app import create_app

__all__ = ["create_app"]
