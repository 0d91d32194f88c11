"""The old name of :mod:`fleetless.sandbox.microvm.snapshot`, kept so that
``import fleetless.sandbox.microvm_snapshot`` still works: importing it gives that very module
(one module object: patching either name patches both)."""

from __future__ import annotations

import sys

from fleetless.sandbox.microvm import snapshot as _snapshot

sys.modules[__name__] = _snapshot
