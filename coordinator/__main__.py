"""``python -m paramplane.coordinator``: the same as ``paramplane coordinator``."""

from __future__ import annotations

import sys

from paramplane.coordinator.cli import main

if __name__ == "__main__":
    sys.exit(main())
