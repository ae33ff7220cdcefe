#!/usr/bin/env bash
# Tools the test suite drives besides Python packages: Debian's Chromium for the browser tests
# (Playwright's own browser download is not available on these machines).
set -euo pipefail
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    echo "Installing Debian's chromium for the browser tests…"
    apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq chromium >/dev/null
  else
    echo "WARNING: chromium is not installed and cannot be installed here; browser tests will fail." >&2
  fi
fi
