#!/usr/bin/env bash
# Creates .venv (if missing) and installs yeto with the HF, LoRA, Megatron, DeepSpeed, plot and dev extras;
# it runs again when the files that shape the install change (the start-up .pth line comes from autoattach.py).
# torch is pinned first: 2.13.0 is the CPU build; the project's torch range accepts it,
# so pip does not pull another torch afterwards. Users on GPU machines keep their own torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.yeto-setup
want="$(cat pyproject.toml setup.py scripts/setup.sh yeto_plugins/autoattach.py | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[hf,lora,megatron,deepspeed,plot,dev]"
echo "$want" >"$stamp"
