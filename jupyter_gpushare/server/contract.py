"""The REST contract: ``openapi.yaml`` parsed, and responses checked against it.

The OpenAPI description shipped beside this module is the one written form of the REST API.
Tests validate every response they get with :func:`validate_response` and fuzz every
operation that :func:`operations` lists; the lab extension's TypeScript types are generated
from the same schemas (``jupyter_gpushare.server.contract_typescript``). Nothing here runs in the server.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_PATH = Path(__file__).with_name("openapi.yaml")
API_ROOT = "api/gpushare"  # after the server's base_url
SPEC_URI = "urn:jupyter-gpushare:openapi"


class ContractError(AssertionError):
    """A response (or request) that the contract does not describe."""


@dataclass(frozen=True)
class Operation:
    path: str  # template, e.g. "/kernels/{kernel_id}/pin"
    method: str  # lower case, as in the spec
    spec: dict[str, Any]
    parameters: tuple[dict[str, Any], ...]  # path-level and operation-level, $refs resolved

    @property
    def statuses(self) -> set[int]:
        return {int(code) for code in self.spec["responses"]}

    def request_body_max_bytes(self) -> int | None:
        """The body's size limit (the spec's ``x-max-bytes``), if it has one."""
        body = self.spec.get("requestBody")
        return None if body is None else resolve(body).get("x-max-bytes")

    def request_body_required(self) -> bool:
        """Whether a request must have a body (OpenAPI's default: no)."""
        body = self.spec.get("requestBody")
        return body is not None and bool(resolve(body).get("required", False))

    def request_body_schema(self) -> dict[str, Any] | None:
        body = self.spec.get("requestBody")
        if body is None:
            return None
        return resolve(body)["content"]["application/json"]["schema"]


@functools.cache
def spec() -> dict[str, Any]:
    """The parsed OpenAPI document (cached; treat it as read-only)."""
    with SPEC_PATH.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


def resolve(node: dict[str, Any]) -> dict[str, Any]:
    """Follow a local ``$ref`` (``#/components/...``) to what it names."""
    while "$ref" in node:
        ref = node["$ref"]
        if not ref.startswith("#/"):
            raise ContractError(f"only local references are supported, got {ref!r}")
        target: Any = spec()
        for part in ref[2:].split("/"):
            target = target[part]
        node = target
    return node


@functools.cache
def operations() -> tuple[Operation, ...]:
    """Every operation the spec describes, in the spec's order."""
    found = []
    for path, item in spec()["paths"].items():
        shared = [resolve(p) for p in item.get("parameters", [])]
        for method, op in item.items():
            if method in ("get", "put", "post", "delete", "patch", "head", "options"):
                own = [resolve(p) for p in op.get("parameters", [])]
                found.append(Operation(path, method, op, tuple(shared + own)))
    return tuple(found)


@functools.cache
def _path_patterns() -> tuple[tuple[re.Pattern[str], str], ...]:
    patterns = []
    for path in spec()["paths"]:
        regex = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(path))
        patterns.append((re.compile(regex + r"\Z"), path))
    return tuple(patterns)


def find_operation(path: str, method: str | None) -> Operation | None:
    """The operation for a concrete path under the API root (``/kernels/abc/pin``), or None
    when no path of the contract matches it, its path parameters included; ``method`` None
    takes any operation on that path."""
    path = "/" + path.strip("/").split("?", 1)[0]
    for regex, template in _path_patterns():
        match = regex.match(path)
        if not match:
            continue
        for op in operations():
            if op.path != template or (method is not None and op.method != method.lower()):
                continue
            if all(_param_ok(op, name, value) for name, value in match.groupdict().items()):
                return op
    return None


def _param_ok(op: Operation, name: str, value: str) -> bool:
    for param in op.parameters:
        if param["in"] == "path" and param["name"] == name:
            return validator(param["schema"]).is_valid(value)
    raise ContractError(f"{op.path}: path parameter {name!r} is not described")


def operation(path: str, method: str) -> Operation:
    """Like :func:`find_operation`, but a path or method outside the contract is an error."""
    op = find_operation(path, method)
    if op is None:
        raise ContractError(f"{method.upper()} {path} is not in the contract")
    return op


@functools.cache
def _registry() -> Registry:
    return Registry().with_resource(
        SPEC_URI, Resource.from_contents(spec(), default_specification=DRAFT202012)
    )


def validator(schema: dict[str, Any]) -> Draft202012Validator:
    """A validator for a schema taken from the spec; its ``$ref``s resolve in the spec."""
    return Draft202012Validator(_rebase_refs(schema), registry=_registry())


def _rebase_refs(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: (SPEC_URI + v if k == "$ref" and v.startswith("#") else _rebase_refs(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_rebase_refs(v) for v in node]
    return node


def response_schema(op: Operation, status: int) -> dict[str, Any]:
    responses = op.spec["responses"]
    if str(status) not in responses:
        raise ContractError(
            f"{op.method.upper()} {op.path} answered {status}, which the contract does not "
            f"list (it lists {sorted(op.statuses)})"
        )
    return resolve(responses[str(status)])["content"]["application/json"]["schema"]


def validate_response(path: str, method: str, status: int, body: Any) -> None:
    """Raise :class:`ContractError` unless ``body`` is what the contract says ``method path``
    answers with ``status``. ``path`` is relative to the API root (``/status``,
    ``/kernels/ID/release``); ``body`` is the parsed JSON."""
    op = operation(path, method)
    errors = sorted(validator(response_schema(op, status)).iter_errors(body),
                    key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"- at {'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
                 for e in errors[:10]]
        raise ContractError(
            f"{method.upper()} {op.path} {status}: the body breaks the contract:\n"
            + "\n".join(lines)
        )
