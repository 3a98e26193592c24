#!/usr/bin/env bash
# Creates .venv (if missing) and installs yeto with the HF, LoRA, Megatron, DeepSpeed, plot and dev extras;
# it runs again when the files that shape the install change (the start-up .pth line comes from autoattach.py).
# torch is pinned first: 2.13.0 is the CPU build; the project's torch range accepts it,
# so pip does not pull another torch afterwards. Users on GPU machines keep their own torch.
# verl pins transformers below the version the hf extra installs, so it gets a venv of its own,
# .venv-verl, where the verl tests run (tests/rl/verl, started by tests/test_trainer_venvs.py), and so does
# ms-swift (.venv-swift, tests/ms_swift); .venv-core has the core dependencies alone (tests/test_core_venv.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.yeto-setup
want="$(cat pyproject.toml setup.py scripts/setup.sh yeto_plugins/autoattach.py | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[hf,lora,megatron,deepspeed,plot,fast,dev]"
  echo "$want" >"$stamp"
fi

# The status page's browser test (tests/integration/test_status_page.py) drives Debian's chromium
# through its chromedriver; browsers that download themselves cannot run here.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    sudo=""
    if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then sudo="sudo -n"; fi
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get install -y -q chromium chromium-driver >/dev/null ||
      { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q chromium chromium-driver >/dev/null; } ||
      echo "setup.sh: could not install chromium and chromium-driver; the status page's browser test will fail" >&2
  else
    echo "setup.sh: no apt-get to install chromium and chromium-driver; the status page's browser test will fail" >&2
  fi
fi

# .venv-core: torch and yeto with its core dependencies only, no extra. tests/test_core_venv.py imports
# every module there: `pip install yeto` plus a trainer must be enough.
if [ ! -x .venv-core/bin/python ]; then
  "$PY" -m venv .venv-core
fi
core_stamp=.venv-core/.yeto-setup
if [ ! -f "$core_stamp" ] || [ "$(cat "$core_stamp")" != "$want" ]; then
  .venv-core/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
  .venv-core/bin/python -m pip install --quiet --disable-pip-version-check -e .
  echo "$want" >"$core_stamp"
fi

if [ ! -x .venv-verl/bin/python ]; then
  "$PY" -m venv .venv-verl
fi
verl_stamp=.venv-verl/.yeto-setup
if [ ! -f "$verl_stamp" ] || [ "$(cat "$verl_stamp")" != "$want" ]; then
  echo "torch==2.13.0" >.venv-verl/constraints.txt  # whatever asks for torch gets this one
  .venv-verl/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
  # Never verl with an extra: every extra, even cpu, pins another torch. What verl's workers and
  # main_ppo import but its base requirements miss comes by name: uvicorn, fastapi, cachetools, and
  # TransferQueue with pyzmq and msgspec (verl's v1 trainer, the default).
  .venv-verl/bin/python -m pip install --quiet --disable-pip-version-check -c .venv-verl/constraints.txt \
    "verl==0.9.1" uvicorn fastapi cachetools "TransferQueue>=0.1.10" pyzmq msgspec
  .venv-verl/bin/python -m pip install --quiet --disable-pip-version-check -c .venv-verl/constraints.txt -e ".[dev]"
  echo "$want" >"$verl_stamp"
fi

# .venv-swift: ms-swift 4.6.0 pins transformers below 5.20, under the hf extra's, so its tests (tests/ms_swift,
# started by tests/test_trainer_venvs.py) run here. This is the README's ms-swift recipe: torch first, then
# ms-swift with its megatron extra (megatron-core and mcore-bridge: swift's Megatron callback files), then yeto.
if [ ! -x .venv-swift/bin/python ]; then
  "$PY" -m venv .venv-swift
fi
swift_stamp=.venv-swift/.yeto-setup
if [ ! -f "$swift_stamp" ] || [ "$(cat "$swift_stamp")" != "$want" ]; then
  echo "torch==2.13.0" >.venv-swift/constraints.txt
  .venv-swift/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
  .venv-swift/bin/python -m pip install --quiet --disable-pip-version-check -c .venv-swift/constraints.txt \
    "ms-swift[megatron]==4.6.0"
  .venv-swift/bin/python -m pip install --quiet --disable-pip-version-check -c .venv-swift/constraints.txt -e ".[dev]"
  echo "$want" >"$swift_stamp"
fi
