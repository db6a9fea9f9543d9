"""Set-ups many server tests share: kernels holding simulated GPU data with checksums,
released over REST, or crowded onto one small GPU."""

from __future__ import annotations

import json
from typing import Any

from jupyter_gpushare.sim.node import GiB

MiB = 1 << 20
#: a node of two 2 GiB GPUs, where two kernels of 1.25 GiB do not fit on one GPU together
SMALL_NODE = {"simulated_gpus": [2 * GiB, 2 * GiB]}


def hold(mib: int, device: int = 0, name: str = "x", chunk: int = 256) -> str:
    """A cell that holds ``mib`` MiB in arrays of distinct data, with their checksums."""
    n, size = max(1, mib // chunk), min(mib, chunk) * MiB // 4
    return (
        "from jupyter_gpushare.sim import simgpu\nimport numpy as np\n"
        f"{name} = [simgpu.array(np.arange({size}, dtype=np.uint32) * (2 * i + 1), device={device},"
        f" copy=False) for i in range({n})]\n"
        f"{name}_sum = [a.checksum() for a in {name}]"
    )


def intact(name: str = "x") -> str:
    """A cell that fails unless the arrays ``hold`` made have the same bytes as before."""
    return f"assert [a.checksum() for a in {name}] == {name}_sum, 'data changed'\nprint('intact')"


async def rest(jp_fetch: Any, kernel_id: str, action: str, method: str = "POST",
               body: bytes = b"", params: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a gpushare REST action, 4xx included."""
    from tornado.httpclient import HTTPClientError

    try:
        r = await jp_fetch("api", "gpushare", "kernels", kernel_id, action, method=method, body=body,
                           params=params or {})
        return r.code, json.loads(r.body)
    except HTTPClientError as e:
        assert e.response is not None
        return e.code, json.loads(e.response.body)


async def released(jp_fetch: Any, kernels: Any, app: Any, mib: int = 256, name: str = "x",
                   device: int = 0, extra: str = "") -> Any:
    """A kernel holding ``mib`` MiB (see ``hold``), released over REST; ``extra``: code the
    same cell runs after (a stall for the restore, say)."""
    k = await kernels.start()
    await k.run(hold(mib, device=device, name=name) + ("\n" + extra if extra else ""))
    await app.poll_once()
    code, body = await rest(jp_fetch, k.id, "release")
    assert code == 200 and body["state"] == "released", body
    return k


async def crowded(jp_fetch: Any, kernels: Any, app: Any, mib: int = 1280) -> tuple[Any, Any]:
    """On a GPU of under twice ``mib`` MiB (SMALL_NODE for the default 1.25 GiB): kernel a
    released with ``mib``, then kernel b holding ``mib``, so a's restore does not fit unless
    b goes."""
    a = await released(jp_fetch, kernels, app, mib, name="a")
    b = await kernels.start()
    await b.run(hold(mib, name="b"))
    await app.poll_once()
    return a, b
