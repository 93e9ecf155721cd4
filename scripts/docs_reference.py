"""The documentation's generated parts: the settings table (from the settings class, as
`.env.example` is written) and the HTTP reference (from the OpenAPI schema the app serves), so
neither can drift from the code."""

from __future__ import annotations

import json
from typing import Any
from xml.sax.saxutils import escape as xml_escape

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


# The dashboard's picture: Grafana's grid is 24 columns wide, its rows 30 px high.
GRID_COLUMNS = 24
CELL_WIDTH = 40
ROW_HEIGHT = 30
PANEL_GAP = 4
PANEL_FILL = {"stat": "#e8f3ec", "table": "#eef0f7", "bargauge": "#fbf1e3"}
TIMESERIES_FILL = "#f2f5fa"


def dashboard_panels_table(dashboard: dict[str, Any]) -> str:
    """Each panel of a Grafana dashboard: its title and its description, in grid order."""
    rows = ["| panel | what it tells |", "|---|---|"]
    for panel in _panels_in_order(dashboard):
        title = _cell(panel["title"])
        title = f"**{title}**" if panel.get("type") == "row" else title  # heads the panels below
        rows.append(f"| {title} | {_cell(panel.get('description', ''))} |")
    return "\n".join(rows)


def _panels_in_order(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = dashboard["panels"]
    return sorted(panels, key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))


def dashboard_svg(dashboard: dict[str, Any]) -> str:
    """A picture of the dashboard's layout: every panel where Grafana puts it, with its title
    and kind (Grafana itself cannot run where the site is built)."""
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    width, height = GRID_COLUMNS * CELL_WIDTH, bottom * ROW_HEIGHT + 40
    shapes = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="8" y="26" font-size="18" font-weight="bold">'
        f"{xml_escape(dashboard.get('title', ''))}</text>",
    ]
    for panel in _panels_in_order(dashboard):
        grid = panel["gridPos"]
        x, y = grid["x"] * CELL_WIDTH + PANEL_GAP, grid["y"] * ROW_HEIGHT + 40 + PANEL_GAP
        w, h = grid["w"] * CELL_WIDTH - 2 * PANEL_GAP, grid["h"] * ROW_HEIGHT - 2 * PANEL_GAP
        if panel.get("type") == "row":  # a heading across the grid, as Grafana draws it
            shapes += [
                f'<text x="{x}" y="{y + 16}" font-size="15" font-weight="bold">'
                f"{xml_escape(panel['title'])}</text>",
                f'<line x1="{x}" y1="{y + h}" x2="{x + w}" y2="{y + h}" stroke="#9aa5b8"/>',
            ]
            continue
        fill = PANEL_FILL.get(panel.get("type", ""), TIMESERIES_FILL)
        shapes += [
            f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="4" fill="{fill}" '
            'stroke="#9aa5b8"/>',
            f'<text x="{x + 8}" y="{y + 20}" font-size="13" font-weight="bold">'
            f"{xml_escape(panel['title'])}</text>",
            f'<text x="{x + 8}" y="{y + 38}" font-size="11" fill="#5b6577">'
            f"{xml_escape(panel.get('type', ''))}</text>",
        ]
    shapes.append("</svg>")
    return "\n".join(shapes) + "\n"
