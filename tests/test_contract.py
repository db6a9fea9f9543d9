"""The REST API keeps its written contract (jupyter_gpushare/openapi.yaml): every endpoint
and every status it lists, answered by a real server with real kernels, validates against it;
the contract itself is valid OpenAPI, lists exactly the server's routes, and catches drift."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from openapi_spec_validator import validate as validate_openapi

from jupyter_gpushare import contract, contract_typescript, states
from jupyter_gpushare.handlers import MAX_BODY_BYTES, handlers

from .helpers import rest, wait_for

MiB = 1 << 20
SMALL_NODE = {"simulated_gpus": [256 * MiB, 256 * MiB]}


def hold(mib: int, name: str = "x") -> str:
    return (
        "from jupyter_gpushare.sim import simgpu\nimport numpy as np\n"
        f"{name} = simgpu.array(np.arange({mib} * 1024 * 256, dtype=np.uint32) % 97, copy=False)\n"
        f"{name}_sum = {name}.checksum()"
    )


def test_the_contract_is_valid_openapi_and_lists_exactly_the_servers_routes():
    validate_openapi(contract.spec())
    served = set()
    for route, handler in handlers():
        template = re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", route.removeprefix("/api/gpushare"))
        for method in ("get", "post", "put", "patch", "delete"):
            if method in vars(handler):
                served.add((method, template))
    assert served == {(op.method, op.path) for op in contract.operations()}
    pin = contract.operation("/kernels/k/pin", "PUT")
    assert pin.request_body_max_bytes() == MAX_BODY_BYTES  # the limit the handler enforces
    for action in ("release", "restore"):  # an optional body: who asks
        op = contract.operation(f"/kernels/k/{action}", "POST")
        assert op.request_body_max_bytes() == MAX_BODY_BYTES and not op.request_body_required()


ROOT = Path(__file__).resolve().parents[1]


def test_the_lab_extensions_types_are_generated_from_the_contract():
    generated = (ROOT / contract_typescript.OUTPUT).read_text(encoding="utf-8")
    assert generated == contract_typescript.render(), (
        "labextension/src/contract.ts is out of date: run "
        "`python -m jupyter_gpushare.contract_typescript`")
    assert "export * from './contract';" in (ROOT / "labextension/src/api.ts").read_text()
    names = [contract_typescript.type_name(n) for n in contract.spec()["components"]["schemas"]]
    for source in (ROOT / "labextension" / "src").glob("*.ts"):
        if source.name != "contract.ts":  # no hand-kept copy of a contract shape elsewhere
            text = source.read_text(encoding="utf-8")
            for name in names:
                assert not re.search(rf"\b(interface|type|class) {name}\b", text), (source, name)


def test_the_state_names_are_the_contracts():
    """Server, agent and magics spell states from one module; the contract (and so the lab
    extension's generated types) lists the same states, in the same order."""
    assert list(states.ALL) == contract.spec()["components"]["schemas"]["KernelState"]["enum"]
    assert set(states.HELD) | set(states.RESIDENT) == set(states.ALL)
    assert not set(states.HELD) & set(states.RESIDENT)
    generated = (ROOT / contract_typescript.OUTPUT).read_text(encoding="utf-8")
    listed = re.search(r"KernelStateValues: readonly KernelState\[\] = \[(.*?)\];", generated, re.S)
    assert listed and re.findall(r"'(\w+)'", listed.group(1)) == list(states.ALL)


def test_typescript_types_follow_the_schemas():
    assert contract_typescript.ts_type({"type": ["integer", "null"]}) == "number | null"
    assert contract_typescript.ts_type(
        {"type": "array", "items": {"type": ["number", "null"]}}) == "(number | null)[]"
    assert contract_typescript.ts_type(
        {"type": "object", "additionalProperties": {"type": "integer"}}) == "{ [key: string]: number }"
    assert contract_typescript.ts_type({"oneOf": [{"$ref": "#/components/schemas/Method"},
                                                  {"type": "null"}]}) == "Method | null"
    assert contract_typescript.ts_type({"$ref": "#/components/schemas/Kernel"}) == "IKernel"
    assert contract_typescript.ts_type({"enum": ["a", "b'c"]}) == "'a' | 'b\\'c'"


def test_the_api_docs_examples_and_field_tables_agree_with_the_contract():
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    rest_part = text[text.index("## REST"):text.index("## Events")]
    shown = []
    for block in re.findall(r"```json\n(.*?)```", rest_part, re.S):
        body = json.loads(block)
        name = "Status" if "backend" in body else "History" if "interval" in body else "Error"
        contract.validator({"$ref": f"#/components/schemas/{name}"}).validate(body)
        shown.append(name)
    assert sorted(shown) == ["Error", "History", "Status"]

    schemas = contract.spec()["components"]["schemas"]
    for heading, name in (("Top level:", "Status"), ("`gpus[]`:", "GPU"), ("`kernels[]`", "Kernel")):
        table = rest_part[rest_part.index("\n" + heading):].split("\n\n")[1]
        documented: dict[str, bool] = {}  # field -> "or null" in its Type column
        for row in table.splitlines()[2:]:
            cells = row.split("|")
            for field in re.findall(r"`(\w+)`", cells[1]):
                documented[field] = "null" in cells[2]
        nullable = {f: "null" in contract_typescript.ts_type(p).split(" | ")
                    for f, p in schemas[name]["properties"].items()}
        assert documented == nullable, name


KERNEL = {
    "id": "k", "name": "python3", "path": "", "pids": [1], "state": "released", "pinned": False,
    "gpu_memory_bytes": 0, "released_bytes": 1, "gpus": [0], "gpu_bytes": {}, "sm_utilization": None,
    "gpu_utilization": {},
    "idle_seconds": 1.0, "release_in_seconds": None, "idle_timeout": 600.0, "method": "simulated",
    "releases": 1, "restores": 0, "last_restore_seconds": None, "last_release_seconds": 0.1,
    "error": None, "waiting": None, "execution_state": "idle", "release_blocked": None,
    "host_room_bytes": None, "restore_need": {},
}


@pytest.mark.parametrize("change, where", [
    ({"extra": 1}, "'extra' was unexpected"),  # a field the contract does not have
    ({"waiting": 3}, "waiting"),  # a wrong type
    ({"state": "asleep"}, "state"),  # a state that does not exist
    ({"gpu_bytes": {"gpu0": 1}}, "gpu_bytes"),  # a key that is not a GPU index
    ({"method": ""}, "method"),
])
def test_the_contract_catches_drift(change, where):
    contract.validate_response("/kernels/k/release", "POST", 200, KERNEL)  # as the server sends it
    with pytest.raises(contract.ContractError, match=re.escape(where)):
        contract.validate_response("/kernels/k/release", "POST", 200, {**KERNEL, **change})
    missing = dict(KERNEL)
    del missing["execution_state"]
    with pytest.raises(contract.ContractError, match="'execution_state' is a required property"):
        contract.validate_response("/kernels/k/release", "POST", 200, missing)


def test_a_server_fault_and_an_unlisted_status_break_the_contract():
    unhandled = {"message": "Unhandled error", "reason": None, "traceback": ""}  # a 500's body
    with pytest.raises(contract.ContractError, match="does not list"):
        contract.validate_response("/kernels/k/pin", "PUT", 500, unhandled)
    with pytest.raises(contract.ContractError, match="does not list"):
        contract.validate_response("/status", "GET", 404, {"message": "x", "reason": None})
    with pytest.raises(contract.ContractError, match="not in the contract"):
        contract.validate_response("/kernels/k/pin", "POST", 200, KERNEL)
    with pytest.raises(contract.ContractError, match="not in the contract"):
        contract.validate_response("/kernels/a.b/pin", "PUT", 200, KERNEL)  # id outside [\w-]+


@pytest.mark.parametrize("gpushare_config", [SMALL_NODE])
async def test_every_endpoint_answers_every_listed_status_as_the_contract_says(
    jp_fetch, kernels, gpushare_app
):
    seen: set[tuple[str, str, int]] = set()

    async def call(method: str, *path: str, expect: int, **kw):
        code, body = await rest(jp_fetch, method, *path, **kw)  # validated against the contract
        assert code == expect, (method, path, code, body)
        op = contract.operation("/" + "/".join(path), method)
        seen.add((op.method, op.path, code))
        return body

    a, b = await kernels.start(), await kernels.start()
    status = await call("GET", "status", expect=200)
    assert {k["id"] for k in status["kernels"]} >= {a.id, b.id}
    assert len(status["gpus"]) == 2 and status["restore_mode"] == "eager"
    await call("GET", "history", expect=200)
    await call("GET", "history", expect=200, params={"seconds": "0.5"})
    await call("GET", "history", expect=400, params={"seconds": "0"})

    await call("POST", "kernels", "no-such-kernel", "release", expect=404)
    await call("POST", "kernels", a.id, "release", expect=400, params={"if_idle_for": "-1"})
    await call("POST", "kernels", "no-such-kernel", "restore", expect=404)
    await call("POST", "kernels", a.id, "restore", expect=400, body={"trigger": "someone"})
    await call("PUT", "kernels", "no-such-kernel", "pin", body={"pinned": True}, expect=404)
    assert "no GPU memory" in (await call("POST", "kernels", a.id, "release", expect=409))["message"]
    assert "not released" in (await call("POST", "kernels", a.id, "restore", expect=409))["message"]
    await call("PUT", "kernels", a.id, "pin", body={"pinned": "yes"}, expect=400)

    wrong = {"headers": {"Authorization": "token wrong"}}
    await call("GET", "status", expect=403, **wrong)
    await call("GET", "history", expect=403, **wrong)
    await call("POST", "kernels", a.id, "release", expect=403, **wrong)
    await call("POST", "kernels", a.id, "restore", expect=403, **wrong)
    await call("PUT", "kernels", a.id, "pin", body={"pinned": True}, expect=403, **wrong)
    assert gpushare_app.controller.get(a.id).pinned is False  # refused: nothing changed

    # a holds 160 MiB and is released; then b takes 160 MiB of the 256 MiB GPU
    await a.run(hold(160, "a"))
    await gpushare_app.poll_once()
    body = await call("POST", "kernels", a.id, "release", expect=200)
    assert body["state"] == "released" and body["released_bytes"] == 160 * MiB
    await b.run(hold(160, "b"))
    await gpushare_app.poll_once()
    history = await call("GET", "history", expect=200, params={"seconds": "60"})
    assert history["kernels"][b.id]["gpu"]["0"][-1] == 160 * MiB
    status = await call("GET", "status", expect=200)
    assert status["gpus"][0]["released_bytes"] == 160 * MiB
    body = await call("PUT", "kernels", b.id, "pin", body={"pinned": True}, expect=200)
    assert body["pinned"] is True  # b is pinned and recent: never taken to make room

    body = await call("POST", "kernels", a.id, "restore", expect=202)  # no room: it waits
    assert body["state"] == "released" and body["waiting"].startswith("waiting for memory")
    await b.run("del b")  # room frees; the restore goes on by itself
    await wait_for(lambda: gpushare_app.controller.get(a.id).state == "active", what="restore")
    await a.run("assert a.checksum() == a_sum")

    await gpushare_app.poll_once()
    body = await call("POST", "kernels", a.id, "release", expect=200, body={"trigger": "panel"})
    body = await call("POST", "kernels", a.id, "restore", expect=200, body={"trigger": "panel"})
    assert body["state"] == "active" and body["restores"] == 2

    listed = {(op.method, op.path, status) for op in contract.operations() for status in op.statuses}
    assert seen == listed, f"not exercised: {sorted(listed - seen)}"
