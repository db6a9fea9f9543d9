"""TypeScript declarations of what the server defines, for the lab extension: the REST
contract's schemas (``openapi.yaml``), which actions each kernel state allows
(:data:`jupyter_gpushare.core.lifecycle.ACTIONS`) and the kernel event (``events/kernel-v1.yaml``).

``labextension/src/contract.ts`` is this module's output, committed; a test fails when it
differs from what those give now. After changing any of them, run
``python -m jupyter_gpushare.server.contract_typescript`` from the repository root.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from ..core import lifecycle
from ..events import KERNEL_SCHEMA_PATH
from . import contract

OUTPUT = Path("labextension") / "src" / "contract.ts"
HEADER = """\
/**
 * Generated from the server's own definitions: the REST API's JSON shapes from
 * jupyter_gpushare/server/openapi.yaml (the contract), which actions each state allows from
 * jupyter_gpushare/core/lifecycle.py (`ACTIONS`), and the kernel event from
 * jupyter_gpushare/events/kernel-v1.yaml. Do not edit: change those, then run
 * `python -m jupyter_gpushare.server.contract_typescript`.
 */
"""
#: the TypeScript names of what :func:`render` declares besides the contract's schemas
ACTION_TYPE = "KernelAction"
ALLOWED_IN = "ALLOWED_IN"
EVENT_INTERFACE = "IKernelEvent"
EVENT_SCHEMA_ID = "KERNEL_EVENT_SCHEMA_ID"


def _is_interface(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "object" and "properties" in schema


def type_name(name: str) -> str:
    """The TypeScript name of a component schema (interfaces take the ``I`` prefix)."""
    return "I" + name if _is_interface(contract.spec()["components"]["schemas"][name]) else name


def ts_type(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return type_name(schema["$ref"].rsplit("/", 1)[-1])
    for key in ("oneOf", "anyOf"):
        if key in schema:
            return " | ".join(ts_type(member) for member in schema[key])
    if "enum" in schema:
        return " | ".join(_literal(v) for v in schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(ts_type({**schema, "type": k}) for k in kind)
    if kind == "null":
        return "null"
    if kind in ("integer", "number"):
        return "number"
    if kind in ("string", "boolean"):
        return kind
    if kind == "array":
        item = ts_type(schema.get("items", {}))
        return f"({item})[]" if " | " in item else f"{item}[]"
    if kind == "object":
        if "properties" in schema:
            raise ValueError("give inline objects a name in components/schemas")
        values = schema.get("additionalProperties", {})
        return f"{{ [key: string]: {ts_type(values) if values else 'unknown'} }}"
    return "unknown"


def _literal(value: Any) -> str:
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    raise ValueError(f"only string enums are supported, got {value!r}")


def _doc(text: str | None, indent: str) -> list[str]:
    if not text:
        return []
    words = " ".join(text.split())
    line = f"{indent}/** {words} */"
    if len(line) <= 100:
        return [line]
    out, current = [f"{indent}/**"], f"{indent} *"
    for word in words.split(" "):
        if len(current) + 1 + len(word) > 100:
            out.append(current)
            current = f"{indent} *"
        current += " " + word
    return [*out, current, f"{indent} */"]


def _type_alias(name: str, value: str) -> list[str]:
    """As prettier lays it out: one line, else the value on the next, else one member a line."""
    line = f"export type {name} = {value};"
    if len(line) <= 100:
        return [line]
    if len(f"  {value};") <= 100:
        return [f"export type {name} =", f"  {value};"]
    members = value.split(" | ")
    return [f"export type {name} =", *(f"  | {m}" for m in members[:-1]), f"  | {members[-1]};"]


def _value_list(name: str, values: list[Any]) -> list[str]:
    """Every value of a string enum, as a constant (code can iterate over the states)."""
    head = f"export const {name}Values: readonly {name}[] = ["
    items = [_literal(v) for v in values]
    line = head + ", ".join(items) + "];"
    if len(line) <= 100:
        return [line]
    return [head, *(f"  {item}," for item in items[:-1]), f"  {items[-1]}", "];"]


def _string_array(items: list[str], indent: str, head: str, tail: str) -> list[str]:
    """``head[...]tail`` on one line, else one item a line (as prettier lays out strings)."""
    quoted = [_literal(v) for v in items]
    line = f"{indent}{head}[{', '.join(quoted)}]{tail}"
    if len(line) <= 100:
        return [line]
    inner = indent + "  "
    return [f"{indent}{head}[", *(f"{inner}{q}," for q in quoted[:-1]),
            f"{inner}{quoted[-1]}", f"{indent}]{tail}"]


def _allowed_actions() -> list[str]:
    """:data:`lifecycle.ACTIONS` as a typed constant: which states allow each action."""
    states = contract.spec()["components"]["schemas"]["KernelState"]["enum"]
    for action, allowed in lifecycle.ACTIONS.items():
        unknown = [s for s in allowed if s not in states]
        if unknown:
            raise ValueError(f"lifecycle.ACTIONS[{action!r}] names unknown states {unknown}")
    lines = ["/** What a person may ask for a kernel (REST, the panel, `%gpushare`). */"]
    lines += _type_alias(ACTION_TYPE, " | ".join(_literal(a) for a in lifecycle.ACTIONS))
    lines += [
        "",
        *_doc("The states in which the server takes each action (it answers 409 in the others), "
              "from jupyter_gpushare/core/lifecycle.py `ACTIONS`. A restore asked while a release is "
              "in flight waits for the release, then restores; one asked while a restore runs "
              "joins it.", ""),
        f"export const {ALLOWED_IN}: {{ readonly [action in {ACTION_TYPE}]: readonly KernelState[] }}"
        " = {",
    ]
    items = list(lifecycle.ACTIONS.items())
    for i, (action, allowed) in enumerate(items):
        lines += _string_array(list(allowed), "  ", f"{action}: ", "," if i < len(items) - 1 else "")
    return [*lines, "};"]


def event_schema() -> dict[str, Any]:
    """The kernel event's JSON schema (jupyter_events), as the server registers it."""
    schema: dict[str, Any] = yaml.safe_load(KERNEL_SCHEMA_PATH.read_text(encoding="utf-8"))
    return schema


def _event_enum_name(field: str) -> str:
    return "KernelEvent" + "".join(part.title() for part in field.split("_"))


def _kernel_event() -> list[str]:
    """The kernel event's fields as an interface, its enums as named unions."""
    schema = event_schema()
    lines = [
        "/** The id of the kernel event's schema (jupyter_events), from its `$id`. */",
        f"export const {EVENT_SCHEMA_ID} = {_literal(schema['$id'])};",
    ]
    for field, prop in schema["properties"].items():
        if "enum" in prop:
            what = prop.get("description", "")
            what = what[:1].lower() + what[1:]
            lines += ["", *_doc(f"The kernel event's `{field}` field: {what}", "")]
            lines += _type_alias(_event_enum_name(field), ts_type(prop))
    lines += ["", *_doc(schema.get("description"), "")]
    lines.append(f"export interface {EVENT_INTERFACE} {{")
    required = set(schema.get("required", []))
    for field, prop in schema["properties"].items():
        lines += _doc(prop.get("description"), "  ")
        optional = "" if field in required else "?"
        kind = _event_enum_name(field) if "enum" in prop else ts_type(prop)
        lines.append(f"  {field}{optional}: {kind};")
    return [*lines, "}"]


def render() -> str:
    blocks = []
    for name, schema in contract.spec()["components"]["schemas"].items():
        lines = _doc(schema.get("description"), "")
        if _is_interface(schema):
            required = set(schema.get("required", []))
            lines.append(f"export interface I{name} {{")
            for field, prop in schema["properties"].items():
                lines += _doc(prop.get("description"), "  ")
                optional = "" if field in required else "?"
                lines.append(f"  {field}{optional}: {ts_type(prop)};")
            lines.append("}")
        else:
            lines += _type_alias(name, ts_type(schema))
            if "enum" in schema:
                lines += ["", f"/** Every `{name}`, in the contract's order. */"]
                lines += _value_list(name, schema["enum"])
        blocks.append("\n".join(lines))
    blocks.append("\n".join(_allowed_actions()))
    blocks.append("\n".join(_kernel_event()))
    return HEADER + "\n" + "\n\n".join(blocks) + "\n"


def main() -> int:
    OUTPUT.write_text(render(), encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
