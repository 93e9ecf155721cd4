"""The documentation: the site builds with `mkdocs build --strict` (every internal link, anchor
and page checked), its generated parts cover every setting and every route of the code, and the
README stays a landing page whose links lead somewhere."""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.routing import APIRoute

from api.http.app import create_app
from api.settings import Settings
from tests.support.app_routes import walk

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
DASHBOARD = REPO_ROOT / "docker" / "grafana" / "dashboards" / "loraserve.json"
MIN_PAGES = 8
README_MAX_LINES = 300
README_MAX_BYTES = 20_000
# Phrases that narrate an earlier state of the code: that belongs in CHANGELOG.md.
HISTORY = ("used to ", "the previous default", "the run before", "before this change", "no longer")
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)],
        cwd=REPO_ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    yield folder


def page_text(site: Path, page: str) -> str:
    """A built page's text, its markup and entities undone."""
    raw = (site / page / "index.html").read_text(encoding="utf-8")
    return html.unescape(re.sub(r"<[^>]+>", "", raw))


def test_the_site_has_its_pages(site: Path) -> None:
    pages = list(DOCS.rglob("*.md"))
    assert len(pages) >= MIN_PAGES
    for page in pages:
        relative = page.relative_to(DOCS).with_suffix("")
        built = site / "index.html" if relative.name == "index" else site / relative / "index.html"
        assert built.is_file(), relative


def test_the_configuration_page_lists_every_setting_as_env_example_does(site: Path) -> None:
    text = page_text(site, "configuration")
    listed = 0
    # .env.example, the file operators copy, is the reference: every NAME=default in it must
    # appear as a row of the page with the same default.
    for line in (REPO_ROOT / ".env.example").read_text(encoding="utf-8").splitlines():
        if line.startswith("# ---"):
            break  # the compose stack's variables follow; they are not the service's settings
        found = re.fullmatch(r"(#\s)?([A-Z0-9_]+)=(.*)", line)
        if found is None or found.group(2) == "EXAONE_ADAPTER_DIR":
            continue
        name, default = found.group(2), found.group(3) or "unset"
        assert re.search(rf"\b{name}\s+{re.escape(default)}(?=\s)", text), (name, default)
        listed += 1
    assert listed == len(Settings.model_fields) - 1  # all but the <MODEL>_ADAPTER_DIR seeds
    assert "<MODEL>_ADAPTER_DIR" in text


def test_the_api_reference_lists_every_route_of_the_app(site: Path) -> None:
    app = create_app(Settings(_env_file=None))  # type: ignore[call-arg]
    routes = {
        (method, route.path)
        for route in walk(app.routes)
        if isinstance(route, APIRoute) and route.include_in_schema
        for method in route.methods
    }
    assert ("POST", "/predict") in routes and ("POST", "/v2/models/{name}/infer") in routes
    text = page_text(site, "reference/api")
    for method, path in routes:
        assert re.search(rf"{method}\s+{re.escape(path)}\s", text), (method, path)
    schema = (site / "reference" / "openapi.json").read_text(encoding="utf-8")
    assert all(f'"{path}"' in schema for _, path in routes)


def test_the_observability_page_shows_every_dashboard_panel(site: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    titles = [panel["title"] for panel in dashboard["panels"]]
    assert len(titles) >= MIN_PAGES
    text = page_text(site, "observability")
    picture = html.unescape((site / "img" / "dashboard-loraserve.svg").read_text(encoding="utf-8"))
    for title in titles:
        assert title in text and f">{title}<" in picture, title


def test_no_page_narrates_an_earlier_state_of_the_code() -> None:
    for page in DOCS.rglob("*.md"):
        text = page.read_text(encoding="utf-8").lower()
        for phrase in HISTORY:
            assert phrase not in text, (page.name, phrase)


def test_the_readme_is_a_landing_page() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    assert len(text.encode("utf-8")) <= README_MAX_BYTES
    assert "make serve" in text and "make test" in text


def test_the_readme_links_lead_somewhere(site: Path) -> None:
    checked = 0
    for target in LINK.findall(README.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        assert (REPO_ROOT / path).exists(), target
        if anchor and path.startswith("docs/"):
            page = Path(path).relative_to("docs").with_suffix("")
            raw = (site / page / "index.html").read_text(encoding="utf-8")
            assert f'id="{anchor}"' in raw, target
        checked += 1
    assert checked >= MIN_PAGES
