#!/usr/bin/env bash
# The GPU proof, one stage a command (benchmarks/gpu/README.md says how to run it on the device
# machine). With a GPU (or --simulated): installs the wheelhouse (.gpu-wheels/, made by
# wheelhouse.sh) offline into /tmp/gpushare-site when this Python lacks the Jupyter packages,
# puts the repository first on PYTHONPATH (its code, not the wheel's, is what runs), then runs
# prove.py. Without a GPU, prove.py says so and exits 0 at once (nothing is installed).
#
#   bash benchmarks/gpu/prove.sh --stage 1|2|3 [--out DIR] [--scenes A,B] [--simulated] [--jobs N]
set -u
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
py=${PYTHON:-python3}
wheels="$repo/.gpu-wheels"
site=${GPUSHARE_SITE:-/tmp/gpushare-site}
export PYTHONUNBUFFERED=1

case " $* " in
  *" --simulated "*|*" --summary "*) wanted=yes ;;
  *) "$py" -c "import sys; sys.path.insert(0, '$here'); import prove; sys.exit(0 if prove.find_gpu()[0] else 1)" \
       && wanted=yes || wanted=no ;;
esac

if [ "$wanted" = yes ] && ! "$py" -c "import jupyter_server, ipykernel" 2>/dev/null; then
  tag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  if PYTHONPATH="$site" "$py" -c "import jupyter_server, ipykernel" 2>/dev/null; then
    echo "prove.sh: the wheelhouse is installed in $site already (a rerun on a warm machine)"
  elif ls "$wheels"/*.whl >/dev/null 2>&1; then
    t0=$(date +%s)
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$wheels"/*.whl $(ls "$wheels/$tag"/*.whl 2>/dev/null) \
      || echo "prove.sh: installing the wheelhouse failed; the env step will say what is missing" >&2
    echo "prove.sh: installed the wheelhouse ($wheels, $tag) into $site in $(( $(date +%s) - t0 )) s"
  else
    echo "prove.sh: no Jupyter packages here and no wheelhouse in $wheels (run wheelhouse.sh)" >&2
  fi
  if [ -d "$site" ]; then
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$site/bin:$PATH"
    export JUPYTER_PATH="$site/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
  fi
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
cd "$repo" && exec "$py" "$here/prove.py" "$@"
