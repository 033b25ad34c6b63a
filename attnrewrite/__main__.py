"""``python -m attnrewrite``: the command line."""

import sys

from attnrewrite.cli import main

sys.exit(main())
