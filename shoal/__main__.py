"""`python -m shoal ...` runs the `shoal` command (see shoal/cli.py)."""

from __future__ import annotations

import sys

from shoal.cli import main

if __name__ == "__main__":
    sys.exit(main())
