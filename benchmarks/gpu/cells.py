"""The code the proof runs inside kernels, per kind of kernel.

Each kind ("torch", "jax", "cupy" on a real GPU; "sim" on the simulated node) defines
``STATE`` (formatted with ``n`` = bytes): build a state of about ``n`` bytes on GPU 0 (PyTorch:
a model with its gradients and Adam's state) and print ``{checksum, bytes, info}`` as JSON,
with a ``checksum()`` function left in the namespace (``CHECKSUM`` prints it again); ``ALLOC``
(``n``): hold ``n`` more bytes in ``hold``; ``FREE``: drop ``hold`` and give it back to the
driver; ``SPIN`` (``s``): keep the GPU busy for ``s`` seconds and return; ``SPIN_BACKGROUND``
(``s``): start one long GPU kernel (or GPU work in a thread) and return at once.
Checksums are computed on the GPU, so they touch every byte without copying it out.
"""

from __future__ import annotations

TORCH_STATE = """
import json, math, time, torch
torch.manual_seed(0)
def _ck(t):
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = b.numel() // 8 * 8
    w = b[:n].view(torch.int64)
    s = 0
    for i in range(0, w.numel(), 1 << 25):
        c = w[i:i + (1 << 25)]
        s = (s + int((c ^ (c >> 17)).sum())) % (1 << 64)
    tail = int(b[n:].to(torch.int64).sum()) if n < b.numel() else 0
    return f"{{s:016x}}.{{tail}}"
# four square layers: parameters, gradients and Adam's two moments are 16 bytes a weight,
# so a width of sqrt(n / 64) makes about n bytes of state
_w = max(256, int(math.sqrt({n} / 64)) // 256 * 256)
model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(_w, _w), torch.nn.ReLU())]).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
data = torch.randn(256, _w, device="cuda")
def step():
    opt.zero_grad(set_to_none=False)
    model(data).square().mean().backward()
    opt.step()
step()
torch.cuda.synchronize()
_t_alloc = time.time()  # the whole state is on the GPU from here
def tensors():
    out = [*model.state_dict().values(), *(p.grad for p in model.parameters()), data]
    for st in opt.state.values():
        out += [v for v in st.values() if torch.is_tensor(v)]
    return out
def checksum():
    torch.cuda.synchronize()
    return ":".join(_ck(t) for t in tensors())
_ck0 = checksum()
torch.cuda.empty_cache()  # the checksum's temporaries are no part of the state
print(json.dumps({{"checksum": _ck0, "bytes": sum(t.numel() * t.element_size() for t in tensors()),
                  "t_alloc": _t_alloc, "reserved": torch.cuda.memory_reserved(),
                  "info": {{"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                           "device": torch.cuda.get_device_name(0)}}}}))
"""

JAX_STATE = """
import json, jax, jax.numpy as jnp
x = jax.random.normal(jax.random.PRNGKey(0), (max({n} // 4, 1),), dtype=jnp.float32)
def checksum():
    b = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return f"{{int(jnp.sum(b ^ (b >> 7), dtype=jnp.uint32))}}:{{int(jnp.sum(b[::4099], dtype=jnp.uint32))}}"
print(json.dumps({{"checksum": checksum(), "bytes": x.nbytes,
                  "info": {{"jax": jax.__version__, "device": str(jax.devices()[0])}}}}))
"""

CUPY_STATE = """
import json, cupy
cupy.random.seed(0)
x = cupy.random.randint(0, 2**31 - 1, size=max({n} // 8, 1), dtype=cupy.int64)
def checksum():
    return f"{{int((x ^ (x >> 17)).sum())}}:{{int(x[::4099].sum())}}"
print(json.dumps({{"checksum": checksum(), "bytes": x.nbytes, "info": {{"cupy": cupy.__version__}}}}))
"""

SIM_STATE = """
import json, time, numpy as np
from jupyter_gpushare.sim import simgpu
x = simgpu.array(np.random.default_rng(0).integers(0, 2**32, max({n} // 4, 1), dtype=np.uint32),
                 device=0, copy=False)
_t_alloc = time.time()
def checksum():
    return x.checksum()
print(json.dumps({{"checksum": checksum(), "bytes": x.nbytes, "t_alloc": _t_alloc,
                  "info": {{"simulated": True}}}}))
"""

CHECKSUM = "print(json.dumps(checksum()))"

# GPU memory no framework counts (cuMemAlloc through cuda-bindings, in the context PyTorch made
# current): release_method "auto" must pick the driver method while the kernel holds it
RAW_ALLOC = """
import torch
torch.cuda.synchronize()  # a runtime call: PyTorch's context is current on this thread
from cuda.bindings import driver as _cu
_err, _raw = _cu.cuMemAlloc({n})
assert int(_err) == 0, _err
_cu.cuMemsetD8(_raw, 7, {n})
_cu.cuCtxSynchronize()
"""
RAW_FREE = """
_cu.cuMemFree(_raw)
del _raw
"""

TORCH_ALLOC = """
import torch
hold = torch.ones({n}, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
"""
CUPY_ALLOC = """
import cupy
hold = cupy.ones({n}, dtype=cupy.uint8)
cupy.cuda.Device(0).synchronize()
"""
SIM_ALLOC = """
from jupyter_gpushare.sim import simgpu
hold = simgpu.zeros(({n},), dtype="uint8", device=0)
"""

TORCH_FREE = "del hold\nimport torch\ntorch.cuda.empty_cache()"
CUPY_FREE = "del hold\nimport cupy\ncupy.get_default_memory_pool().free_all_blocks()"
SIM_FREE = "del hold\nimport gc\ngc.collect()"

TORCH_SPIN = """
import time, torch
_a = torch.rand(4096, 4096, device="cuda")
_end = time.time() + {s}
while time.time() < _end:
    _a = _a @ _a
    _a = _a / _a.norm()
torch.cuda.synchronize()
del _a
"""
SIM_SPIN = """
from jupyter_gpushare.sim import simgpu
simgpu.burn({s})
"""

# one GPU kernel that runs about s seconds (torch.cuda._sleep spins for a number of clocks)
TORCH_SPIN_BACKGROUND = """
import torch
torch.cuda._sleep(int({s} * 2e9))  # clocks: about {s} s at 2 GHz (longer at lower clocks)
"""
SIM_SPIN_BACKGROUND = """
import threading
from jupyter_gpushare.sim import simgpu
threading.Thread(target=simgpu.burn, args=({s},), daemon=True).start()
"""
TORCH_SYNC = "import torch\ntorch.cuda.synchronize()"
SIM_SYNC = "import time\ntime.sleep({s})"

KINDS = {
    "torch": {"STATE": TORCH_STATE, "ALLOC": TORCH_ALLOC, "FREE": TORCH_FREE,
              "SPIN": TORCH_SPIN, "SPIN_BACKGROUND": TORCH_SPIN_BACKGROUND, "SYNC": TORCH_SYNC},
    "jax": {"STATE": JAX_STATE},
    "cupy": {"STATE": CUPY_STATE, "ALLOC": CUPY_ALLOC, "FREE": CUPY_FREE},
    "sim": {"STATE": SIM_STATE, "ALLOC": SIM_ALLOC, "FREE": SIM_FREE, "SPIN": SIM_SPIN,
            "SPIN_BACKGROUND": SIM_SPIN_BACKGROUND, "SYNC": SIM_SYNC},
}

# framework method (PyTorch): identities, and one optimizer step after the round trip against
# the same step taken on a copy before the release (kept on the host)
TORCH_REFERENCE_STEP = """
import copy, json
_ref_model = copy.deepcopy(model)
_ref_opt = torch.optim.Adam(_ref_model.parameters(), lr=1e-3)
_ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # step tensors too
_ref_opt.zero_grad(set_to_none=False)
_ref_model(data).square().mean().backward()
_ref_opt.step()
ref_after_step = {{k: v.detach().cpu().clone() for k, v in _ref_model.state_dict().items()}}
del _ref_model, _ref_opt
torch.cuda.empty_cache()
ids_before = [id(model), id(opt), id(data), *[id(p) for p in model.parameters()]]
print(json.dumps(len(ref_after_step)))
"""
TORCH_AFTER_ROUND_TRIP = """
import json
_ids = [id(model), id(opt), id(data), *[id(p) for p in model.parameters()]]
_ck_now = checksum()
step()
_same = all(torch.equal(v.detach().cpu(), ref_after_step[k]) for k, v in model.state_dict().items())
_on_cuda = all(p.is_cuda for p in model.parameters()) and data.is_cuda
print(json.dumps({{"checksum": _ck_now, "ids_kept": _ids == ids_before, "step_equal": _same,
                  "on_cuda": _on_cuda}}))
"""
CUPY_IDS = """
import json
view = x[1000:2000]
ids_before = [id(x), id(view)]
print(json.dumps(ids_before))
"""
CUPY_AFTER_ROUND_TRIP = """
import json
_ck_now = checksum()
view[0] = -1
print(json.dumps({{"checksum": _ck_now, "ids_kept": [id(x), id(view)] == ids_before,
                  "view_aliases": int(x[1000]) == -1}}))
"""
