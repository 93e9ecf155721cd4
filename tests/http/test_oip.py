"""The Open Inference Protocol (KServe v2) with Triton's own client, `tritonclient.http`,
unmodified, against the real server process on loopback: health, metadata, infer (binary
and JSON tensors), the cascade, adapters, limits, and the protocol's error shape."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
import yaml
from tritonclient.utils import InferenceServerException

from tests.support.server_process import ServerProcess, run_server
from tests.support.tiny_models import embedded_encoder_file, write_models_file

# The documentation's example texts (docs/api.md).
SPAM = "WINNER!! Claim your £900 prize now"
HAM = "Lunch tomorrow?"
MODEL = "spam-minilm"
SECOND = "spam-minilm-b"  # the same encoder under a second name: a cascade without the LLM
API_PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("oip")
    (encoder,) = yaml.safe_load(embedded_encoder_file(folder).read_text(encoding="utf-8"))["models"]
    models = write_models_file(folder / "two.yaml", [encoder, {**encoder, "name": SECOND}])
    env = {"MODELS_FILE": str(models), "DISK_CACHE_MAX_BYTES": "0", "MAX_TEXTS_PER_REQUEST": "4"}
    with run_server(env, folder) as process:
        process.wait_ready()
        yield process


@pytest.fixture
def client(server: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(url=server.url.removeprefix("http://"))


def texts_input(texts: list[str], binary: bool = True) -> httpclient.InferInput:
    tensor = httpclient.InferInput("input-0", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array(texts, dtype=object), binary_data=binary)
    return tensor


def outputs(binary: bool = True) -> list[httpclient.InferRequestedOutput]:
    return [
        httpclient.InferRequestedOutput("output-0", binary_data=binary),
        httpclient.InferRequestedOutput("probabilities", binary_data=binary),
    ]


def predicted(server: ServerProcess, texts: list[str], model: str = MODEL) -> list[list[float]]:
    """The probabilities /predict gives, in class-index order (ham=0, spam=1)."""
    answer = httpx.post(
        f"{server.url}/predict", json={"inputs": texts, "model": model, "cache": False}
    ).json()
    return [
        [next(i["score"] for i in row if i["label"] == k) for k in ("ham", "spam")]
        for row in answer
    ]


def refusal(call: object) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()  # type: ignore[operator]
    return caught.value


def test_the_documented_example_runs_word_for_word(server: ServerProcess) -> None:
    page = API_PAGE.read_text(encoding="utf-8")
    part = page[page.index("## Open Inference Protocol (KServe v2)") :]
    code = re.search(r"```python\n(.*?)```", part, re.DOTALL)
    assert code is not None
    source = code.group(1).replace("127.0.0.1:8000", server.url.removeprefix("http://"))
    assert SPAM in source and HAM in source
    scope: dict[str, object] = {}
    exec(compile(source, "docs/api.md", "exec"), scope)  # our own documentation's example
    assert scope["classes"].tolist() == [1, 0]  # type: ignore[attr-defined]
    assert scope["probabilities"].shape == (2, 2)  # type: ignore[attr-defined]


def test_health_and_metadata(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready("cascade")
    assert not client.is_model_ready("nope")
    server = client.get_server_metadata()
    assert server["name"] == "loraserve" and server["version"] and server["extensions"] == []
    model = client.get_model_metadata(MODEL)
    assert model["name"] == MODEL and model["platform"] == "pytorch"
    assert model["inputs"] == [{"name": "input-0", "datatype": "BYTES", "shape": [-1]}]
    assert model["outputs"] == [
        {"name": "output-0", "datatype": "INT64", "shape": [-1]},
        {"name": "probabilities", "datatype": "FP32", "shape": [-1, 2]},
    ]
    assert client.get_model_metadata("cascade")["platform"] == "ensemble"


@pytest.mark.parametrize("binary", [True, False], ids=["binary-tensors", "json-tensors"])
def test_infer_answers_class_indices_and_the_probabilities_of_predict(
    server: ServerProcess, client: httpclient.InferenceServerClient, binary: bool
) -> None:
    result = client.infer(
        MODEL, [texts_input([SPAM, HAM], binary)], outputs=outputs(binary), request_id="req-7"
    )
    classes = result.as_numpy("output-0")
    probabilities = result.as_numpy("probabilities")
    assert classes.dtype == np.int64 and classes.tolist() == [1, 0]
    assert probabilities.dtype == np.float32 and probabilities.shape == (2, 2)
    response = result.get_response()
    assert response["id"] == "req-7" and response["model_name"] == MODEL
    expected = predicted(server, [SPAM, HAM])
    for got, want in zip(probabilities.tolist(), expected, strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7)
        assert math.isclose(sum(got), 1.0, rel_tol=1e-5)
    again = httpx.post(
        f"{server.url}/v2/models/{MODEL}/infer",
        json={
            "inputs": [{"name": "input-0", "shape": [2], "datatype": "BYTES", "data": [SPAM, HAM]}]
        },
    )
    assert again.headers["X-Cache"] == "lru=2,disk=0,model=0"  # the cache is /predict's


def test_one_output_asked_for_is_the_only_one_answered(
    client: httpclient.InferenceServerClient,
) -> None:
    asked = [httpclient.InferRequestedOutput("output-0")]
    result = client.infer(MODEL, [texts_input([HAM])], outputs=asked)
    assert [o["name"] for o in result.get_response()["outputs"]] == ["output-0"]
    assert result.as_numpy("probabilities") is None


def test_the_cascade_and_the_second_model_are_reachable(
    server: ServerProcess, client: httpclient.InferenceServerClient
) -> None:
    for name in ("cascade", SECOND):
        result = client.infer(name, [texts_input([SPAM, HAM])], outputs=outputs())
        assert result.as_numpy("output-0").tolist() == [1, 0], name
        assert result.get_response()["model_name"] == name
    raw = httpx.post(
        f"{server.url}/v2/models/cascade/infer",
        json={"inputs": [{"name": "input-0", "shape": [1], "datatype": "BYTES", "data": [SPAM]}]},
    )
    assert raw.status_code == 200 and raw.headers["X-Model"] == "cascade"
    assert raw.headers["X-Answered-By"] in (MODEL, SECOND)


def test_adapter_in_parameters(
    server: ServerProcess, client: httpclient.InferenceServerClient
) -> None:
    named = client.infer(MODEL, [texts_input([SPAM])], parameters={"adapter": "spam"})
    assert named.as_numpy("output-0").tolist() == [1]
    missing = refusal(
        lambda: client.infer(MODEL, [texts_input([SPAM])], parameters={"adapter": "nope"})
    )
    assert missing.status() == "404" and "nope" in missing.message()


def test_unknown_model_is_404_in_the_protocols_error_shape(
    server: ServerProcess, client: httpclient.InferenceServerClient
) -> None:
    for path in ("/v2/models/nope", "/v2/models/nope/ready"):
        response = httpx.get(f"{server.url}{path}")
        assert response.status_code == 404, path
        assert isinstance(response.json()["error"], str) and "nope" in response.json()["error"]
    error = refusal(lambda: client.infer("nope", [texts_input([HAM])]))
    assert error.status() == "404" and "'nope' is not served" in error.message()
    # The rest of the service keeps its own shape.
    predict = httpx.post(f"{server.url}/predict", json={"inputs": HAM, "model": "nope"})
    assert predict.status_code == 404 and predict.json()["error"]["code"] == "not_found"


def test_limits_and_bad_input_are_4xx_in_the_protocols_error_shape(
    server: ServerProcess, client: httpclient.InferenceServerClient
) -> None:
    too_many = refusal(lambda: client.infer(MODEL, [texts_input([HAM] * 5)]))
    assert too_many.status() == "422" and "at most 4" in too_many.message()
    too_long = refusal(lambda: client.infer(MODEL, [texts_input(["x" * 1_000_000])]))
    assert too_long.status() == "422" and "characters" in too_long.message()
    url = f"{server.url}/v2/models/{MODEL}/infer"
    for body in (
        {"inputs": [{"name": "input-0", "shape": [1], "datatype": "INT64", "data": [1]}]},
        {"inputs": [{"name": "input-0", "shape": [2], "datatype": "BYTES", "data": [HAM]}]},
        {"inputs": []},
        {
            "inputs": [{"name": "input-0", "shape": [1], "datatype": "BYTES", "data": [HAM]}],
            "outputs": [{"name": "labels"}],
        },
    ):
        response = httpx.post(url, json=body)
        assert response.status_code == 422, (body, response.text)
        assert isinstance(response.json()["error"], str)
    big = httpx.post(url, content=b"x" * 3_000_000)
    assert big.status_code == 413 and isinstance(big.json()["error"], str)
    deadline = httpx.post(
        url,
        json={"inputs": [{"name": "input-0", "shape": [1], "datatype": "BYTES", "data": [HAM]}]},
        headers={"X-Request-Timeout": "soon"},
    )
    assert deadline.status_code == 422 and "X-Request-Timeout" in deadline.json()["error"]


def test_requests_are_counted_under_fixed_route_labels(server: ServerProcess) -> None:
    httpx.get(f"{server.url}/v2/models/some-unknown-name/ready")
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'route="/v2/models/infer"' in metrics and 'route="/v2/models/ready"' in metrics
    assert "some-unknown-name" not in metrics
