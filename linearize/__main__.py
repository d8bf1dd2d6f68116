"""`python -m linearize ...`: the same command as `linearize ...`."""

import sys

from .cli import main

sys.exit(main())
