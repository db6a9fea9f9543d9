"""Emulated bodies (the fakes' statuses, the benchmarks' servers) are built from the REST
contract, so a field the contract makes required later breaks none of them."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from jupyter_gpushare.server import contract, contract_bodies

from . import fake_server

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCHEMAS = contract.spec()["components"]["schemas"]
CLOSED = sorted(n for n, s in SCHEMAS.items() if s.get("additionalProperties") is False)

#: fields a later contract might add, one of each kind of schema
ADDED = {
    "added_count": {"type": "integer", "minimum": 3},
    "added_note": {"type": ["string", "null"]},
    "added_name": {"type": "string", "minLength": 2},
    "added_mode": {"$ref": "#/components/schemas/RestoreMode"},
    "added_method": {"oneOf": [{"$ref": "#/components/schemas/Method"}, {"type": "null"}]},
    "added_map": {"type": "object", "additionalProperties": {"type": "integer"}},
    "added_list": {"type": "array", "items": {"type": "integer"}},
    "added_flag": {"type": "boolean"},
    "added_usage": {"type": "object", "additionalProperties": False, "required": ["index"],
                    "properties": {"index": {"type": "integer", "minimum": 0}}},
}


def grown_spec() -> dict:
    """The shipped contract with the fields of ADDED required in every closed object."""
    doc = copy.deepcopy(contract.spec())
    for name in CLOSED:
        schema = doc["components"]["schemas"][name]
        schema["properties"].update(copy.deepcopy(ADDED))
        schema["required"] = [*schema.get("required", []), *ADDED]
    return doc


def validate(doc: dict, name: str, body: dict) -> None:
    registry = Registry().with_resource(
        contract.SPEC_URI, Resource.from_contents(doc, default_specification=DRAFT202012))
    ref = {"$ref": contract.SPEC_URI + "#/components/schemas/" + name}
    Draft202012Validator(ref, registry=registry).validate(body)


def benchmark(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", CLOSED)
def test_every_closed_schema_has_a_neutral_body(name):
    body = contract_bodies.build(name)
    assert set(body) == set(SCHEMAS[name].get("required", []))
    validate(contract.spec(), name, body)


def test_a_field_the_contract_lacks_or_a_wrong_value_is_refused_where_it_is_written():
    with pytest.raises(contract.ContractError, match="Kernel has no field renamed"):
        contract_bodies.kernel(id="k", renamed=1)
    with pytest.raises(contract.ContractError, match="state"):
        contract_bodies.kernel(id="k", state="asleep")


def test_an_event_is_built_from_its_schema():
    assert contract_bodies.event(kernel_id="k", action="released", bytes=5) == {
        "kernel_id": "k", "action": "released", "bytes": 5}
    with pytest.raises(Exception, match="not one of"):
        contract_bodies.event(kernel_id="k", action="slept")


def test_a_new_required_field_breaks_no_emulated_status(monkeypatch):
    """Every closed object of the contract gains required fields: the fakes' and the hub
    benchmark's statuses still validate (against the grown contract), each with the new
    fields at their neutral values."""
    shipped, grown = contract.spec(), grown_spec()
    monkeypatch.setattr(contract, "spec", lambda: grown)
    built = {
        "fake_server": fake_server.status({"uuid": "GPU-x", "kernels": [
            {"kid": "a", "pids": [5], "need": 7, "waiting": "waiting for memory"},
            {"kid": "b", "pids": ["self"], "state": "active", "gpu_bytes": 9}]}),
        "hub_service_cpu": benchmark("hub_service_cpu").bodies(3)["u0000"],
        "builder": contract_bodies.status(kernels=[contract_bodies.kernel(id="k")],
                                          gpus=[contract_bodies.gpu(index=0)]),
    }
    for where, body in built.items():
        validate(grown, "Status", body)
        for part in (body, *body["kernels"], *body["gpus"]):
            assert part["added_count"] == 3 and part["added_name"] == "xx", where
            assert part["added_mode"] == "eager" and part["added_usage"]["index"] == 0, where
            assert part["added_note"] is None and part["added_method"] is None, where
    assert built["hub_service_cpu"]["kernels"][0]["restore_need"] == {"0": 4 << 30}
    with pytest.raises(Exception, match="'added_count' is a required property"):
        validate(grown, "Status", contract_bodies.status(shipped))  # built for the shipped one
