"""The documentation's generated parts: the settings table (from the settings class, as
`.env.example` is written) and the HTTP reference (from the OpenAPI schema the app serves), so
neither can drift from the code."""

from __future__ import annotations

import json
from typing import Any

from api.settings import Settings
from scripts.env_example import shown_default

# The seed names `<MODEL>_ADAPTER_DIR` are not one variable; the table names their pattern.
ADAPTER_DIRS_ROW = "`<MODEL>_ADAPTER_DIR`"


def _cell(text: str) -> str:
    """Text safe inside one markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def settings_table() -> str:
    """Every setting: its environment name, its default, and what it does."""
    rows = ["| setting | default | what it does |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        description = _cell(field.description or "")
        if name == "adapter_dirs":
            rows.append(f"| {ADAPTER_DIRS_ROW} | unset | {description} |")
            continue
        shown = shown_default(field)
        default = "unset" if shown is None else f"`{shown}`" if shown else "empty"
        rows.append(f"| `{name.upper()}` | {default} | {description} |")
    return "\n".join(rows)


def openapi_schema() -> dict[str, Any]:
    """The schema the service serves at /openapi.json (no model is loaded to build it)."""
    from api.http.app import create_app  # imports torch and transformers: only when asked

    schema: dict[str, Any] = create_app(Settings(_env_file=None)).openapi()  # type: ignore[call-arg]
    return schema


def openapi_json(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def _body(schema: dict[str, Any], operation: dict[str, Any]) -> dict[str, Any] | None:
    """An operation's JSON request body schema, its reference resolved."""
    content = operation.get("requestBody", {}).get("content", {})
    body = content.get("application/json", {}).get("schema")
    if body is None:
        return None
    ref = body.get("$ref", "")
    if ref:
        resolved: dict[str, Any] = schema["components"]["schemas"][ref.rsplit("/", 1)[-1]]
        return resolved
    return dict(body)


def _type(prop: dict[str, Any]) -> str:
    if "anyOf" in prop:
        return " or ".join(_type(p) for p in prop["anyOf"] if p.get("type") != "null")
    if prop.get("type") == "array":
        return f"list of {_type(prop.get('items', {}))}"
    if "$ref" in prop:
        return str(prop["$ref"]).rsplit("/", 1)[-1]
    return str(prop.get("type", "object"))


def routes_table(schema: dict[str, Any]) -> str:
    """One row per operation: method, path, what it does, its statuses."""
    rows = ["| method | path | what it does | statuses |", "|---|---|---|---|"]
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            summary = _cell(operation.get("description") or operation.get("summary") or "")
            statuses = ", ".join(sorted(operation.get("responses", {})))
            rows.append(f"| {method.upper()} | `{path}` | {summary} | {statuses} |")
    return "\n".join(rows)


def request_bodies(schema: dict[str, Any]) -> str:
    """Each JSON request body's fields: name, type, default, what it means."""
    sections: list[str] = []
    seen: set[str] = set()
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            body = _body(schema, operation)
            if body is None or json.dumps(body, sort_keys=True) in seen:
                continue
            seen.add(json.dumps(body, sort_keys=True))
            rows = [
                f"### {method.upper()} `{path}`",
                "",
                "| field | type | default | meaning |",
                "|---|---|---|---|",
            ]
            required = set(body.get("required", []))
            for name, prop in body.get("properties", {}).items():
                default = "required" if name in required else f"`{json.dumps(prop.get('default'))}`"
                meaning = _cell(prop.get("description", ""))
                rows.append(f"| `{name}` | {_cell(_type(prop))} | {default} | {meaning} |")
            sections.append("\n".join(rows))
    return "\n\n".join(sections)
