#!/usr/bin/env bash
# The system packages the tests use, on Debian or Ubuntu: Chromium (the plots test renders
# `dvc plots show` in it) with fonts for the chart labels, PostgreSQL (the tuning tests share a
# study through a server they start), tcmalloc (tests/test_students.py runs the pipeline under it, LD_PRELOAD
# through dvc), and python3-venv where Debian leaves it out. Everything else, the SSH and S3 test servers included, comes from PyPI
# (requirements-dev.txt). Installs only what is missing, as root or through sudo; a second run
# installs nothing. scripts/test.sh runs it.
set -euo pipefail

missing=()
python3 -c "import ensurepip" 2>/dev/null || missing+=(python3-venv)
fc-list 2>/dev/null | grep -qi liberation || missing+=(fonts-liberation)
. /etc/os-release
browser=(chromium)
if [ "${ID:-}" = ubuntu ]; then
  # Ubuntu's chromium package is a snap, which containers and CI machines cannot run: there the
  # tests use Playwright's own Chromium (scripts/test.sh installs it once the virtualenv exists)
  browser=()
fi
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql)
/sbin/ldconfig -p | grep -q 'libtcmalloc_minimal\.so\.4 ' || missing+=(libtcmalloc-minimal4)
if [ ${#browser[@]} -gt 0 ] && ! command -v chromium >/dev/null; then
  missing+=("${browser[@]}")
fi

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
as_root=()
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null; then
    echo "error: the tests need ${missing[*]}: run this as root, or install them (apt-get install ${missing[*]})" >&2
    exit 1
  fi
  as_root=(sudo)
fi
echo "installing ${missing[*]} (apt-get)"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
# tcmalloc's package is libtcmalloc-minimal4t64 from Ubuntu 24.04 and Debian 13 on, as apt's lists tell
if apt-cache show libtcmalloc-minimal4t64 >/dev/null 2>&1; then
  missing=("${missing[@]/#libtcmalloc-minimal4/libtcmalloc-minimal4t64}")
fi
# --no-install-recommends: chromium's recommends (upower, printer setup, ...) are not needed
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
