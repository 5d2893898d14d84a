"""``python -m kvoffload``: the same as the ``kvoffload`` command."""

import sys

from kvoffload.cli import main

sys.exit(main())
