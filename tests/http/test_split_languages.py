"""Languages across the front-end/model split: the model side's core decides, the front end
carries its refusal in each protocol's shape and the flagged positions in its header."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.support.split import split
from tests.support.tiny_models import TinyModel, spam_entry, write_models_file


def entry(tiny: TinyModel, name: str, policy: str) -> dict[str, object]:
    return spam_entry(tiny, name, languages=["en"], on_other_language=policy)


def test_the_split_refuses_and_flags_as_the_model_side_decides(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    models = write_models_file(
        tmp_path / "models.yaml",
        [entry(tiny_bert, "strict", "refuse"), entry(tiny_bert, "flagged", "answer")],
    )
    env = {"MODELS_FILE": str(models), "DISK_CACHE_MAX_BYTES": "0", "ADMISSION_CONTROL": "false"}
    texts = ["see you later", "안녕하세요, 내일 봐요."]
    with split(tmp_path, env) as (_, front_end), httpx.Client(base_url=front_end.url) as client:
        refused = client.post("/predict", json={"inputs": texts, "model": "strict"})
        assert refused.status_code == 422
        error = refused.json()["error"]
        assert error["code"] == "other_language"
        expected = "inputs[1] is in ko (told by its script); model 'strict' reads en"
        assert error["message"] == expected
        tensor = {"name": "input-0", "datatype": "BYTES", "shape": [2], "data": texts}
        oip = client.post("/v2/models/strict/infer", json={"inputs": [tensor]})
        assert oip.status_code == 422 and oip.json()["error"] == error["message"]
        flagged = client.post("/predict", json={"inputs": texts, "model": "flagged"})
        assert flagged.status_code == 200 and flagged.headers["x-outside-languages"] == "1"
