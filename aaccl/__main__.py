"""`python -m aaccl ...` is the `aaccl` command."""

import sys

from .cli import main

sys.exit(main())
