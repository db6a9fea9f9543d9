#!/usr/bin/env bash
# The GPU proof of issue 24 in one command (benchmarks/gpu/README.md says how to run it on the
# device machine). Installs the wheelhouse (.gpu-wheels/, made by wheelhouse.sh) into
# /tmp/gpushare-site when this Python lacks the Jupyter packages, puts the repository first on
# PYTHONPATH (its code, not the wheel's, is what runs), then runs prove.py with the arguments.
#
#   bash benchmarks/gpu/prove.sh [--out DIR] [--part all|1|2|NAME,...] [--simulated] [--quick]
set -u
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
py=${PYTHON:-python3}
wheels="$repo/.gpu-wheels"
site=${GPUSHARE_SITE:-/tmp/gpushare-site}

if ! "$py" -c "import jupyter_server, ipykernel, pytest_jupyter" 2>/dev/null; then
  tag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  if ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "prove.sh: installing the wheelhouse ($wheels, $tag) into $site"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$wheels"/*.whl $(ls "$wheels/$tag"/*.whl 2>/dev/null) \
      || echo "prove.sh: installing the wheelhouse failed; the env part will say what is missing" >&2
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$site/bin:$PATH"
    export JUPYTER_PATH="$site/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
  else
    echo "prove.sh: no Jupyter packages here and no wheelhouse in $wheels (run wheelhouse.sh)" >&2
  fi
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
cd "$repo" && exec "$py" "$here/prove.py" "$@"
