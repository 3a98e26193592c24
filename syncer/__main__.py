"""`python -m syncer`: run the yeto syncer."""

import sys

from syncer.cli import main

sys.exit(main())
