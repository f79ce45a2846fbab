"""``python -m kvtier.cli``: the ``kvtier`` command."""

import sys

from kvtier.cli import main

sys.exit(main())
