#!/usr/bin/env bash
# Run the jupyter-gpushare UI tests in a fresh clone, after the Python package is installed
# (pip install ".[test]"): installs the npm dependencies, then runs the Playwright specs
# against a lab started from jupyter_server_test_config.py. Screenshots land in artifacts/.
#
# Environment: CHROMIUM_PATH (default /usr/bin/chromium), GPUSHARE_UI_PORT (default 8895).
# Extra arguments go to `playwright test` (e.g. ./run.sh -g "pin").
set -euo pipefail
cd "$(dirname "$0")"

export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1
if [ ! -x "${CHROMIUM_PATH:-/usr/bin/chromium}" ]; then
  echo "No Chromium at ${CHROMIUM_PATH:-/usr/bin/chromium}; install it (apt-get install chromium) or set CHROMIUM_PATH." >&2
  exit 2
fi
if ! jupyter labextension list 2>&1 | grep -q "jupyter-gpushare"; then
  echo "The jupyter-gpushare lab extension is not installed; pip install the package first." >&2
  exit 2
fi

mkdir -p artifacts
jlpm install
jlpm playwright test "$@"
echo "Screenshots: $(pwd)/artifacts"
