#!/usr/bin/env bash
# The README's test command: install everything the suite needs, then run it.
# - Python packages: the project with its test extra (integrations, examples, test tools).
# - Debian's `chromium`, for the web-page test (tests/integrations/server): installed with
#   apt-get when missing and this user may (root, or sudo without a password).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get install -y -q chromium >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
  elif sudo -n true 2>/dev/null; then
    sudo apt-get install -y -q chromium >/dev/null || { sudo apt-get update -q >/dev/null && sudo apt-get install -y -q chromium >/dev/null; }
  else
    echo "tools/test.sh: chromium is missing and apt-get needs root; the web-page test will fail" >&2
  fi
fi
python -m pip install -q -e ".[test]"
python -m pytest -q "$@"
