#!/usr/bin/env bash
# The tests, set up from nothing on a fresh Debian or Ubuntu machine with Python 3.10+ and git:
# the system packages (scripts/install-system-packages.sh: Chromium, as root or through sudo),
# a virtualenv in .venv with requirements-dev.txt, another in .venv-sky with SkyPilot (for its
# parser), then pytest. A second run installs nothing new. Arguments go to pytest:
#   bash scripts/test.sh -k cv -x
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
  echo "error: the tests need Python 3.10 or newer; python3 is $(python3 --version 2>&1)" >&2; exit 1; }
bash scripts/install-system-packages.sh
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null && ! [ -e /proc/driver/nvidia/version ]; then
  # No GPU: a CPU-only build of PyTorch (about 200 MB) instead of the CUDA build pip picks by default
  # (several GB). The newest one pip's own sources offer (a mirror or wheel folder in its config),
  # else PyTorch's CPU index; else pip takes torch with the rest, whatever build its index has.
  cpu_build=$(python -m pip index versions torch 2>/dev/null | sed -n 's/^Available versions: //p' \
              | tr ',' '\n' | tr -d ' ' | grep '+cpu$' | head -n 1 || true)
  if [ -n "$cpu_build" ]; then
    python -m pip install -q "torch==$cpu_build"
  else
    python -m pip install -q --retries 1 --timeout 20 torch --index-url https://download.pytorch.org/whl/cpu \
      || echo "download.pytorch.org/whl/cpu cannot be reached: installing torch from your package index"
  fi
fi
python -m pip install -q -r requirements-dev.txt
. /etc/os-release
if [ "${ID:-}" = ubuntu ] && ! command -v chromium >/dev/null; then
  python -m playwright install --with-deps chromium  # Ubuntu's own chromium is a snap
fi
# SkyPilot's own parser reads scripts/skypilot/*.yaml (tests/test_sky.py), from a virtualenv of its own:
# installed in .venv, skypilot's pins would replace click, httpx and paramiko under dvc
[ -x .venv-sky/bin/python ] || python3 -m venv .venv-sky
.venv-sky/bin/python -m pip install -q skypilot==0.14.1
exec python -m pytest "$@"
