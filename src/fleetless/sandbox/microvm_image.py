"""The old name of :mod:`fleetless.sandbox.microvm.image` (the guest image builder), kept so that
``import fleetless.sandbox.microvm_image`` and ``python -m fleetless.sandbox.microvm_image`` still
work: importing it gives that very module (one module object: patching either name patches both).
"""

from __future__ import annotations

import sys

from fleetless.sandbox.microvm import image as _image

if __name__ == "__main__":
    sys.exit(_image.main())
else:
    sys.modules[__name__] = _image
