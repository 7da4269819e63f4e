"""``python -m gridcomm``: the command line."""

from __future__ import annotations

import sys

from gridcomm._cli.main import main

if __name__ == "__main__":
    sys.exit(main())
