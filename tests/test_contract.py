"""The REST API keeps its written contract (jupyter_gpushare/server/openapi.yaml): every endpoint
and every status it lists, answered by a real server with real kernels, validates against it;
the contract itself is valid OpenAPI, lists exactly the server's routes, and catches drift."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from openapi_spec_validator import validate as validate_openapi

from jupyter_gpushare import states
from jupyter_gpushare.core import lifecycle
from jupyter_gpushare.events import KERNEL_SCHEMA_ID
from jupyter_gpushare.server import contract, contract_bodies, contract_typescript
from jupyter_gpushare.server.handlers import MAX_BODY_BYTES, handlers

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


def _hand_written_sources() -> list[tuple[Path, str]]:
    """The lab extension's sources other than the generated contract.ts."""
    return [(source, source.read_text(encoding="utf-8"))
            for source in sorted((ROOT / "labextension" / "src").glob("*.ts"))
            if source.name != "contract.ts"]


def _literal_lists(text: str, values: list[str]) -> list[str]:
    """Places where two of ``values`` are listed side by side ('a', 'b' or 'a' | 'b')."""
    one = "|".join(re.escape(v) for v in values)
    return re.findall(rf"'(?:{one})'\s*[,|]\s*'(?:{one})'", text)


def _function_body(text: str, name: str) -> str:
    found = re.search(rf"\nexport function {name}\(.*?\n}}\n", text, re.S)
    assert found, name
    return found.group(0)


def test_the_lab_extensions_types_are_generated_from_the_contract():
    generated = (ROOT / contract_typescript.OUTPUT).read_text(encoding="utf-8")
    assert generated == contract_typescript.render(), (
        "labextension/src/contract.ts is out of date: run "
        "`python -m jupyter_gpushare.server.contract_typescript`")
    assert "export * from './contract';" in (ROOT / "labextension/src/api.ts").read_text()
    # every name contract.ts declares: the contract's shapes, the allowed-actions table, the event
    names = re.findall(r"^export (?:interface|type|const) (\w+)\b", generated, re.M)
    assert {contract_typescript.type_name(n) for n in contract.spec()["components"]["schemas"]} | {
        contract_typescript.ACTION_TYPE, contract_typescript.ALLOWED_IN,
        contract_typescript.EVENT_INTERFACE, contract_typescript.EVENT_SCHEMA_ID} <= set(names)
    for source, text in _hand_written_sources():  # no hand-kept copy of any of it elsewhere
        for name in names:
            assert not re.search(rf"\b(interface|type|class|const|let|var|enum) {name}\b", text), (
                source, name)


def test_the_lab_extension_keeps_no_hand_copy_of_the_allowed_actions_or_the_event():
    """The buttons follow the generated table, toasts read the generated event type: a table,
    state list or event interface written by hand in labextension/src fails here."""
    event = contract_typescript.event_schema()
    event_actions = event["properties"]["action"]["enum"]
    for source, text in _hand_written_sources():
        # a hand-kept table of states (['active', 'idle'], 'released' | 'failed') or of actions
        assert not _literal_lists(text, list(states.ALL)), source
        assert not _literal_lists(text, event_actions), source
        assert KERNEL_SCHEMA_ID not in text, source  # the schema id comes from contract.ts
        for name, body in re.findall(r"\binterface (\w+)[^{]*\{(.*?)\n\}", text, re.S):
            fields = set(re.findall(r"^\s*(\w+)\??:", body, re.M))
            assert not set(event["required"]) <= fields, (source, name, "a copy of IKernelEvent")
    rules = (ROOT / "labextension" / "src" / "rules.ts").read_text(encoding="utf-8")
    for function in ("allowedActions", "displayedState"):
        body = _function_body(rules, function)
        # the states come from the table, none is named in the rules (but what is displayed)
        named = set(re.findall(r"'(\w+)'", body)) & set(states.ALL)
        assert named <= ({"releasing", "restoring"} if function == "displayedState" else set()), (
            function, named)
    body = _function_body(rules, "allowedActions")
    for action in lifecycle.ACTIONS:
        assert f"{action}: {contract_typescript.ALLOWED_IN}.{action}.includes(state)" in body
    notifications = (ROOT / "labextension" / "src" / "notifications.ts").read_text(encoding="utf-8")
    assert re.search(r"import \{[^}]*\bIKernelEvent\b[^}]*\} from './contract';", notifications)


def _generated() -> str:
    return (ROOT / contract_typescript.OUTPUT).read_text(encoding="utf-8")


def test_the_lab_extensions_allowed_actions_are_the_servers():
    """The panel's buttons allow what the server allows (its 409 rules, lifecycle.ACTIONS)."""
    generated = _generated()
    name = contract_typescript.ALLOWED_IN
    block = re.search(rf"^export const {name}: (.*?) = \{{\n(.*?)\n\}};$", generated, re.S | re.M)
    assert block, name
    action_type = contract_typescript.ACTION_TYPE
    assert block.group(1) == f"{{ readonly [action in {action_type}]: readonly KernelState[] }}"
    table = {action: re.findall(r"'(\w+)'", listed)
             for action, listed in re.findall(r"^  (\w+): \[(.*?)\]", block.group(2), re.S | re.M)}
    assert table == {action: list(allowed) for action, allowed in lifecycle.ACTIONS.items()}
    union = re.search(rf"^export type {action_type} =(.*?);$", generated, re.S | re.M)
    assert union and re.findall(r"'(\w+)'", union.group(1)) == list(lifecycle.ACTIONS)


def test_the_allowed_actions_name_only_the_contracts_states(monkeypatch):
    monkeypatch.setitem(lifecycle.ACTIONS, "restore", ("released", "asleep"))
    with pytest.raises(ValueError, match="asleep"):
        contract_typescript.render()


def test_the_kernel_event_type_is_generated_from_its_schema():
    """IKernelEvent is the schema the server registers with jupyter_events: its fields, which
    are optional, their types, and the action names as a union."""
    generated = _generated()
    schema = contract_typescript.event_schema()
    assert schema["$id"] == KERNEL_SCHEMA_ID
    assert f"export const {contract_typescript.EVENT_SCHEMA_ID} = '{KERNEL_SCHEMA_ID}';" in generated
    body = re.search(rf"^export interface {contract_typescript.EVENT_INTERFACE} \{{\n(.*?)\n\}}$",
                     generated, re.S | re.M)
    assert body
    fields = dict(re.findall(r"^  (\w+\??): (.+);$", body.group(1), re.M))
    required = set(schema["required"])
    expected = {
        field + ("" if field in required else "?"):
            "KernelEventAction" if field == "action" else contract_typescript.ts_type(prop)
        for field, prop in schema["properties"].items()
    }
    assert fields == expected
    assert fields["kernel_id"] == "string" and fields["bytes?"] == "number"
    union = re.search(r"^export type KernelEventAction =(.*?);$", generated, re.S | re.M)
    assert union and re.findall(r"'(\w+)'", union.group(1)) == schema["properties"]["action"]["enum"]


def test_the_state_names_are_the_contracts():
    """Server, agent and magics spell states from one module; the contract (and so the lab
    extension's generated types) lists the same states, in the same order."""
    assert list(states.ALL) == contract.spec()["components"]["schemas"]["KernelState"]["enum"]
    assert set(states.HELD) | set(states.NOT_HELD) == set(states.ALL)
    assert not set(states.HELD) & set(states.NOT_HELD)
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


# as the server sends it: built from the contract, so a new required field does not break it
KERNEL = contract_bodies.kernel(
    id="k", name="python3", pids=[1], state="released", released_bytes=1, gpus=[0],
    idle_seconds=1.0, idle_timeout=600.0, method="simulated", releases=1,
    last_release_seconds=0.1, execution_state="idle")


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


@pytest.mark.parametrize("gpushare_config", [{**SMALL_NODE, "memory_limit": "1TiB"}])
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
    await call("PUT", "kernels", "no-such-kernel", "cap", body={"memory_cap": 1}, expect=404)
    await call("PUT", "kernels", a.id, "cap", body={"memory_cap": -2}, expect=400)
    await call("PUT", "kernels", a.id, "cap", body={"memory_cap": 2 << 40}, expect=409)  # > 1TiB
    assert (await call("PUT", "kernels", a.id, "cap", body={"memory_cap": None},
                       expect=200))["memory_cap"] == 1 << 40

    wrong = {"headers": {"Authorization": "token wrong"}}
    await call("GET", "status", expect=403, **wrong)
    await call("GET", "history", expect=403, **wrong)
    await call("POST", "kernels", a.id, "release", expect=403, **wrong)
    await call("POST", "kernels", a.id, "restore", expect=403, **wrong)
    await call("PUT", "kernels", a.id, "pin", body={"pinned": True}, expect=403, **wrong)
    await call("PUT", "kernels", a.id, "cap", body={"memory_cap": 1}, expect=403, **wrong)
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
