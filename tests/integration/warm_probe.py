"""Started by test_warm_start.py: reports what a warm-started child sees, then exits with argv[1]."""

from __future__ import annotations

import json
import os
import random
import sys

print(json.dumps({"random": random.getrandbits(64), "env": os.environ.get("YETO_PROBE"), "argv": sys.argv,
                  "main": __name__, "cwd": os.getcwd()}), flush=True)
sys.exit(int(sys.argv[1]))
