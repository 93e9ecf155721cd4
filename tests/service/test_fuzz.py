"""schemathesis against the service's own OpenAPI schema, on the real server (tiny model).

The `st` CLI in a subprocess, not the pytest plugin: the CLI runs every phase (the schema's
examples, boundary coverage, then random fuzzing, valid and invalid data alike) and writes a
JSON report whose counts this test reads, instead of parsing text meant for people.
Run with `-s` to see the counts: `pytest -s tests/service/test_fuzz.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.server_process import run_server
from tests.support.tiny_models import TinyModel, tiny_models_file

MAX_EXAMPLES = 200  # per operation and phase; the run takes ~10-20 s of fuzzing
SEED = 1  # the same cases on every run: a failure here is reproducible
CHECKS = (
    "not_a_server_error",  # no 5xx, whatever arrives
    "response_schema_conformance",  # every answer matches the schema it documents
    "content_type_conformance",
    "response_headers_conformance",
    "negative_data_rejection",  # data the schema forbids is refused (4xx), not served
)


def run_schemathesis(url: str, report_dir: Path) -> tuple[dict[str, Any], str]:
    """One `st run` against the live schema; its JSON report and its text output."""
    command = [
        str(Path(sys.executable).parent / "st"),
        "run",
        f"{url}/openapi.json",
        "--checks",
        ",".join(CHECKS),
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        str(SEED),
        "--workers",
        "1",
        "--continue-on-failure",
        "--request-timeout",
        "10",
        "--no-color",
        "--report",
        "json",
        "--report-json-path",
        str(report_dir / "schemathesis.json"),
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=240, cwd=report_dir, check=False
    )
    output = done.stdout + done.stderr
    path = report_dir / "schemathesis.json"
    assert path.is_file(), f"no report; st exited {done.returncode}:\n{output[-6000:]}"
    return json.loads(path.read_text(encoding="utf-8")), output


def test_fuzzing_the_openapi_schema_finds_no_server_error_and_no_schema_breach(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    models = tiny_models_file(tmp_path, tiny_bert, adapters=("spam",))
    env = {"MODELS_FILE": str(models), "DISK_CACHE_DIR": str(tmp_path / "cache")}
    with run_server(env, tmp_path) as server:
        server.wait_ready()
        report, output = run_schemathesis(server.url, tmp_path)
        assert server.process.poll() is None, "the server died under fuzzing"

    cases, operations = report["test_cases"], report["operations"]
    figures = {
        "operations_tested": operations["tested"],
        "operations_total": operations["total"],
        "cases": cases["generated"],
        "cases_failed": cases["with_failures"],
        "cases_errored": cases["errored"],
        "failures": {f["code"]: f["count"] for f in report["failures"]},
        "checks": list(CHECKS),
        "max_examples": MAX_EXAMPLES,
        "seed": SEED,
        "seconds": round(report["running_time"], 1),
    }
    print("fuzz:", json.dumps(figures))
    assert operations["tested"] == operations["total"] > 0, output[-6000:]
    assert cases["generated"] > 0, output[-6000:]
    assert cases["with_failures"] == 0 and not report["failures"], output[-6000:]
    assert cases["errored"] == 0 and not report["errors"], output[-6000:]
    assert report["exit_code"] == 0, output[-6000:]
