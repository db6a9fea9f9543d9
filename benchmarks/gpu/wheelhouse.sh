#!/usr/bin/env bash
# Build the wheelhouse the GPU machine needs for the proof (benchmarks/gpu/README.md):
# this package's wheel (with the built lab extension) and the Jupyter packages the GPU image
# lacks (jupyter_server, ipykernel, pytest-jupyter and their dependencies), into .gpu-wheels/
# (ignored by git; name it in the device tool's `carry`). Pure-Python wheels go in the top
# folder, compiled ones in cpXY/ per Python version (default: the image's 3.12). Packages the
# image already has are left out, so what travels stays small; prints the sizes and fails if
# the repository plus the wheelhouse would not fit in the 64 MiB that travel.
#
#   bash benchmarks/gpu/wheelhouse.sh [PYTHON_VERSION ...]     e.g. 3.12 (default) or 3.11 3.12
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out="$repo/.gpu-wheels"
py=${PYTHON:-python3}
versions=("$@")
[ ${#versions[@]} -eq 0 ] && versions=(3.12)
limit=$((64 * 1024 * 1024))

# what the GPU image ('cuda') already holds (KINDS.md of the device tool, 2026-11-17);
# normalized names (PEP 503)
image_has="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rm -rf "$out"
mkdir -p "$out"

echo "== this package's wheel (lab extension included: $( [ -f "$repo/jupyter_gpushare/labextension/package.json" ] && echo built || echo 'NOT built: jlpm build:prod in labextension/' ))"
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$tmp/own" "$repo"
own=$(ls "$tmp"/own/jupyter_gpushare-*.whl)
cp "$own" "$out/"

for v in "${versions[@]}"; do
  tag="cp${v/./}"
  echo "== dependencies for Python $v ($tag, manylinux x86_64)"
  "$py" -m pip download -q --only-binary=:all: --python-version "$v" --implementation cp \
    --abi "$tag" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$tmp/$tag" "$own" "pytest-jupyter[server]>=0.10" nbclient nbformat
  mkdir -p "$out/$tag"
  for w in "$tmp/$tag"/*.whl; do
    f=$(basename "$w")
    name=$(echo "${f%%-*}" | tr 'A-Z_.' 'a-z--')
    case " $(echo $image_has) " in *" $name "*) continue ;; esac
    case "$f" in
      jupyter_gpushare-*) ;;
      *-py3-none-any.whl|*-py2.py3-none-any.whl) cp -n "$w" "$out/" ;;
      *) cp "$w" "$out/$tag/" ;;
    esac
  done
done

hash=$(cd "$here" && "$py" -c "import prove; print(prove.source_hash())")
cat >"$out/MANIFEST.json" <<EOF
{"built": "$(date -u +%Y-%m-%dT%H:%M:%SZ)", "source_hash": "$hash", "pythons": "$(echo "${versions[@]}")",
 "own_wheel": "$(basename "$own")", "left_out_as_in_image": true}
EOF

wheels=$(find "$out" -name '*.whl' | wc -l)
whl_bytes=$(du -sb "$out" | cut -f1)
repo_bytes=$(cd "$repo" && git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
total=$((whl_bytes + repo_bytes))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "wheelhouse: $out: $wheels wheels, $(mib "$whl_bytes")"
echo "with the repository's tracked and untracked files ($(mib "$repo_bytes")): $(mib "$total") of the 64 MiB that travel"
if [ "$total" -ge "$limit" ]; then
  echo "too big to carry: leave out more (see image_has above)" >&2
  exit 1
fi
