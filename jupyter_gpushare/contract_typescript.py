"""TypeScript declarations of the REST contract's schemas, for the lab extension.

``labextension/src/contract.ts`` is this module's output, committed; a test fails when it
differs from what the contract gives now. After changing ``openapi.yaml``, run
``python -m jupyter_gpushare.contract_typescript`` from the repository root.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from . import contract

OUTPUT = Path("labextension") / "src" / "contract.ts"
HEADER = """\
/**
 * The REST API's JSON shapes, generated from jupyter_gpushare/openapi.yaml (the contract).
 * Do not edit: change the contract, then run `python -m jupyter_gpushare.contract_typescript`.
 */
"""


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
    return HEADER + "\n" + "\n\n".join(blocks) + "\n"


def main() -> int:
    OUTPUT.write_text(render(), encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
