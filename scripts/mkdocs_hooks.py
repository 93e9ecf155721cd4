"""mkdocs hooks (mkdocs.yml `hooks:`): fill the documentation's generated parts at build time.

A page holds a marker comment where a generated part goes; the settings table and the HTTP
reference come from the code, the dashboard's panels and its picture from its JSON
(scripts/docs_reference.py), and the OpenAPI schema is written into the site as
`reference/openapi.json`.
"""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

# mkdocs loads this file by path: the project root is not on sys.path by itself.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts import docs_reference  # noqa: E402

OPENAPI_FILE = "reference/openapi.json"
# Files kept beside the code they describe, published in the site at the same paths, so the
# pages link to them and the strict build checks those links.
REPOSITORY_FILES = (
    "bench/reports/*.md",
    "bench/reports/*.png",
    "bench/reports/*.txt",
    "artifacts/*/MODEL_CARD.md",
    "data/README.md",
)
CHANGELOG = "CHANGELOG.md"
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "loraserve.json"
DASHBOARD_PICTURE = "img/dashboard-loraserve.svg"


@cache
def _schema() -> dict[str, Any]:
    return docs_reference.openapi_schema()


@cache
def _dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return dashboard


def _generated() -> dict[str, Any]:
    return {
        "<!-- generated: settings -->": docs_reference.settings_table,
        "<!-- generated: routes -->": lambda: docs_reference.routes_table(_schema()),
        "<!-- generated: request bodies -->": lambda: docs_reference.request_bodies(_schema()),
        "<!-- generated: dashboard panels -->": lambda: docs_reference.dashboard_panels_table(
            _dashboard()
        ),
    }


def on_files(files: Files, config: MkDocsConfig) -> Files:
    schema = docs_reference.openapi_json(_schema())
    files.append(File.generated(config, OPENAPI_FILE, content=schema))
    picture = docs_reference.dashboard_svg(_dashboard())
    files.append(File.generated(config, DASHBOARD_PICTURE, content=picture))
    for pattern in REPOSITORY_FILES:
        for path in sorted(ROOT.glob(pattern)):
            published = path.relative_to(ROOT).as_posix()
            files.append(File.generated(config, published, abs_src_path=str(path)))
    files.append(File.generated(config, "changelog.md", abs_src_path=str(ROOT / CHANGELOG)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    for marker, render in _generated().items():
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    return markdown
