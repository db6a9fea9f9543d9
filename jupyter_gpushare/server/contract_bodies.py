"""Bodies the contract describes, built from its schemas: for tests and benchmarks that stand
in for a server (a status the hub service polls, a kernel a fake answers with) and for
exports and events they write.

A caller names the fields it cares about; every other required field gets a neutral value
its schema allows (null where it may be null, the first of an enum, a number's minimum, an
empty string, list or map). A field the contract makes required later is filled the same
way, so no emulated body breaks on it, and a field the contract does not have (renamed,
removed) is an error here, where it is written. Every body is validated before it is
returned. Nothing here runs in the server.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from ..events import KERNEL_SCHEMA_PATH
from . import contract

SCHEMAS = "#/components/schemas/"


def build(name: str, spec: dict[str, Any] | None = None, /, **fields: Any) -> dict[str, Any]:
    """A body of the contract's schema ``name`` (``Status``, ``Kernel``, ``GPU``,
    ``History``, ...) with ``fields``, every other required field neutral; ``spec`` is the
    OpenAPI document (the shipped one by default)."""
    doc = contract.spec() if spec is None else spec
    body = _object(doc, _resolve(doc, {"$ref": SCHEMAS + name}), fields, name)
    errors = sorted(_validator(doc, name).iter_errors(body), key=lambda e: list(e.absolute_path))
    if errors:
        raise contract.ContractError(f"{name}: " + "; ".join(
            f"at {'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errors[:5]))
    return body


def status(spec: dict[str, Any] | None = None, /, **fields: Any) -> dict[str, Any]:
    """``GET /api/gpushare/status``'s body (``gpus`` and ``kernels``: bodies of
    :func:`gpu` and :func:`kernel`)."""
    return build("Status", spec, **fields)


def kernel(spec: dict[str, Any] | None = None, /, **fields: Any) -> dict[str, Any]:
    """One kernel as the status and the release/restore answers show it."""
    return build("Kernel", spec, **fields)


def gpu(spec: dict[str, Any] | None = None, /, **fields: Any) -> dict[str, Any]:
    """One GPU as the status shows it."""
    return build("GPU", spec, **fields)


def event(**fields: Any) -> dict[str, Any]:
    """A kernel action event (the ``kernel/v1`` jupyter_events schema), without the envelope
    (``__timestamp__``, ``__schema__``, ...) that jupyter_events adds."""
    schema = _event_schema()
    body = _object(schema, schema, fields, "kernel/v1 event")
    Draft202012Validator(schema).validate(body)
    return body


def event_actions() -> tuple[str, ...]:
    """The actions a kernel action event may name."""
    return tuple(_event_schema()["properties"]["action"]["enum"])


@functools.cache
def _event_schema() -> dict[str, Any]:
    with KERNEL_SCHEMA_PATH.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


def neutral(doc: dict[str, Any], schema: dict[str, Any], where: str = "") -> Any:
    """The plainest value ``schema`` (of ``doc``) allows: what a field nobody named gets."""
    schema = _resolve(doc, schema)
    if "default" in schema:
        return copy.deepcopy(schema["default"])
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    for key in ("oneOf", "anyOf"):
        if key in schema:
            options = [_resolve(doc, s) for s in schema[key]]
            if any(o.get("type") == "null" for o in options):
                return None
            return neutral(doc, options[0], where)
    kind = schema.get("type")
    if isinstance(kind, list):
        if "null" in kind:
            return None
        kind = kind[0]
    if kind == "object":
        return _object(doc, schema, {}, where)
    if kind == "array":
        return [neutral(doc, schema.get("items", {}), where)
                for _ in range(schema.get("minItems", 0))]
    if kind == "string":
        return "x" * schema.get("minLength", 0)
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", 0))
        low += 1 if "exclusiveMinimum" in schema and "minimum" not in schema else 0
        return int(low) if kind == "integer" else float(low)
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    raise contract.ContractError(f"{where}: no neutral value for the schema {schema}")


def _object(doc: dict[str, Any], schema: dict[str, Any], fields: dict[str, Any],
            where: str) -> dict[str, Any]:
    props = schema.get("properties", {})
    if schema.get("additionalProperties") is False:
        unknown = sorted(set(fields) - set(props))
        if unknown:
            raise contract.ContractError(f"{where} has no field {', '.join(unknown)}")
    body = {k: fields[k] if k in fields else neutral(doc, props.get(k, {}), f"{where}.{k}")
            for k in schema.get("required", [])}
    body.update(fields)
    return body


def _resolve(doc: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        target: Any = doc
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


_VALIDATORS: dict[tuple[int, str], tuple[dict[str, Any], Draft202012Validator]] = {}


def _validator(doc: dict[str, Any], name: str) -> Draft202012Validator:
    key = (id(doc), name)
    if key not in _VALIDATORS or _VALIDATORS[key][0] is not doc:
        registry = Registry().with_resource(
            contract.SPEC_URI, Resource.from_contents(doc, default_specification=DRAFT202012))
        _VALIDATORS[key] = (doc, Draft202012Validator(
            {"$ref": contract.SPEC_URI + SCHEMAS + name}, registry=registry))
    return _VALIDATORS[key][1]
