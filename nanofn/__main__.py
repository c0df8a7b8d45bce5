"""``python -m nanofn ...``: the ``nanofn`` command."""

import sys

from nanofn.cli import main

sys.exit(main())
