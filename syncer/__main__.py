"""`python -m syncer`: run the yeto syncer."""

import sys

from syncer.service.cli import main

sys.exit(main())
