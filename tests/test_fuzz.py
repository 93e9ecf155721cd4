"""schemathesis against the service's own OpenAPI schema: no server errors, schema-true answers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.server_process import run_server
from tests.tiny_models import TinyModel, tiny_models_file

MAX_EXAMPLES = 150


def test_fuzzing_the_openapi_schema_finds_no_server_error(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    models = tiny_models_file(tmp_path, tiny_bert, adapters=("spam",))
    env = {"MODELS_FILE": str(models), "DISK_CACHE_DIR": str(tmp_path / "cache")}
    with run_server(env, tmp_path) as server:
        server.wait_ready()
        result = subprocess.run(
            [
                str(Path(sys.executable).parent / "st"),
                "run",
                f"{server.url}/openapi.json",
                "--checks",
                "not_a_server_error,response_schema_conformance,content_type_conformance",
                "--max-examples",
                str(MAX_EXAMPLES),
                "--workers",
                "1",
                "--seed",
                "1",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=tmp_path,
        )
    output = result.stdout + result.stderr
    cases = re.search(r"(\d+) generated", output)
    print("fuzz:", cases.group(0) if cases else "?", "| exit", result.returncode)
    print(output[-3000:])
    assert result.returncode == 0, output[-6000:]
    assert cases is not None and int(cases.group(1)) > 0
