"""/v2/...: the Open Inference Protocol (KServe v2), as Triton's and KServe's clients speak it.

`infer` answers as KServe's Hugging Face runtime answers sequence classification: output
`output-0`, INT64, shape [n], the predicted class index of each text; and beside it
`probabilities`, FP32, shape [n, n_labels], each text's softmax in class-index order. The
limits, deadline, cache, cascade and refusals are /predict's (the helpers of `tei`); errors
come out as `{"error": "<message>"}` (the one error handler picks that shape for /v2 paths).

Inputs may come as JSON `data` or in Triton's binary tensor extension (tritonclient's
default): a JSON header of `Inference-Header-Content-Length` bytes, then each input's bytes.
Outputs always come as JSON `data`, which tritonclient reads whether or not it asked for
binary.
"""

from __future__ import annotations

import math
import struct
import uuid
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from api import __version__
from api.http.classifying import answer_headers, classify
from api.http.errors import BadRequest
from api.http.lengths import parse_length
from api.http.routes.common import Core, ScoresResponse, classifier_of, json_body
from api.http.schemas import (
    OipError,
    OipInferenceRequest,
    OipInferenceResponse,
    OipLive,
    OipModelMetadata,
    OipModelReady,
    OipReady,
    OipRequestInput,
    OipServerMetadata,
    OipTensorMetadata,
)
from api.service.contract import RETRY_AFTER_LOADING_SECONDS
from api.service.core import Service
from api.serving.cascade import CASCADE_NAME, cascade_models
from api.serving.errors import InvalidInput, NotFound
from api.serving.unicode import first_lone_surrogate

INPUT = "input-0"
CLASS_OUTPUT = "output-0"  # KServe's Hugging Face runtime's name for the class indices
PROBABILITIES_OUTPUT = "probabilities"
OUTPUTS = (CLASS_OUTPUT, PROBABILITIES_OUTPUT)
HEADER_LENGTH = "Inference-Header-Content-Length"
ERRORS: dict[int | str, dict[str, object]] = {
    status: {"model": OipError} for status in (400, 401, 404, 413, 422, 429, 500, 503, 504)
}
NOT_READY: dict[int | str, dict[str, object]] = {503: {"model": OipReady}}

TAG = "Open Inference Protocol (KServe v2)"
router = APIRouter(prefix="/v2", tags=[TAG])
# Apart: `infer` needs only a service's classify, so the split's front end serves it itself
# (its client's disconnect cancels the call); the other routes read the core's models.
infer_router = APIRouter(prefix="/v2", tags=[TAG])


@router.get("", response_model=OipServerMetadata, responses=ERRORS)
async def server_metadata() -> OipServerMetadata:
    """The server's name and version; no protocol extension is claimed."""
    return OipServerMetadata(name="loraserve", version=__version__, extensions=[])


@router.get("/health/live", response_model=OipLive)
async def live() -> OipLive:
    """Alive: the process answers (as /health)."""
    return OipLive(live=True)


@router.get("/health/ready", response_model=OipReady, responses=NOT_READY)
async def ready(service: Core) -> JSONResponse:
    """200 once every model is loaded and warmed up; 503 before, when draining or failed
    (as /ready)."""
    ok = service.serving
    headers = None if ok else {"Retry-After": str(RETRY_AFTER_LOADING_SECONDS)}
    return JSONResponse({"ready": ok}, status_code=200 if ok else 503, headers=headers)


@router.get("/models/{name}", response_model=OipModelMetadata, responses=ERRORS)
async def model_metadata(name: str, service: Core) -> OipModelMetadata:
    """The model's one input (texts) and two outputs (class indices, probabilities)."""
    labels = known_labels(service, name)
    classes = -1 if labels is None else len(labels)
    return OipModelMetadata(
        name=name,
        versions=[],
        # Triton's word for a pipeline of models, which the cascade is.
        platform="ensemble" if name == CASCADE_NAME else "pytorch",
        inputs=[OipTensorMetadata(name=INPUT, datatype="BYTES", shape=[-1])],
        outputs=[
            OipTensorMetadata(name=CLASS_OUTPUT, datatype="INT64", shape=[-1]),
            OipTensorMetadata(name=PROBABILITIES_OUTPUT, datatype="FP32", shape=[-1, classes]),
        ],
    )


@router.get(
    "/models/{name}/ready",
    response_model=OipModelReady,
    responses={**ERRORS, 503: {"model": OipModelReady}},
)
async def model_ready(name: str, service: Core) -> JSONResponse:
    """200 when the model (or the cascade) answers requests; 503 while not; 404 unknown."""
    known_labels(service, name)
    if name == CASCADE_NAME:
        ok = service.serving and service.cascade is not None
    else:
        ok = service.serving and name in service.runners
    headers = None if ok else {"Retry-After": str(RETRY_AFTER_LOADING_SECONDS)}
    return JSONResponse(
        {"name": name, "ready": ok}, status_code=200 if ok else 503, headers=headers
    )


@infer_router.post(
    "/models/{name}/infer",
    response_model=OipInferenceResponse,
    responses=ERRORS,
    openapi_extra=json_body(OipInferenceRequest),
)
async def infer(name: str, request: Request) -> Response:
    """Classifies the texts of the one BYTES input with the model or the cascade."""
    payload, binary = parse_request(await request.body(), request.headers.get(HEADER_LENGTH))
    wanted = requested_outputs(payload)
    texts = input_texts(payload.inputs[0], binary)
    adapter = payload.parameters.adapter if payload.parameters else None
    done = await classify(request, classifier_of(request), texts, name, adapter)
    probabilities = [list(scores.probabilities) for scores in done.result.scores]
    classes = [max(range(len(row)), key=row.__getitem__) for row in probabilities]
    outputs: dict[str, dict[str, Any]] = {
        CLASS_OUTPUT: {"shape": [len(classes)], "datatype": "INT64", "data": classes},
        PROBABILITIES_OUTPUT: {
            "shape": [len(probabilities), len(done.labels)],
            "datatype": "FP32",
            "data": [p for row in probabilities for p in row],
        },
    }
    body = {
        "model_name": name,
        "id": payload.id if payload.id is not None else str(uuid.uuid4()),
        "outputs": [{"name": output, **outputs[output]} for output in wanted],
    }
    return ScoresResponse(body, headers=answer_headers(done, name))


def known_labels(service: Service, name: str) -> list[str] | None:
    """The labels of a declared model or of the cascade (None: not known before loading);
    404 for any other name."""
    if name == CASCADE_NAME:
        pair = cascade_models(service.settings, service.registry.specs)
        if pair is None:
            raise NotFound(f"no {CASCADE_NAME!r}: it needs two models")
        name = pair[0]  # both models of a cascade have the same labels
    for spec in service.registry.specs:
        if spec.name == name:
            served = service.registry.models.get(name)
            return served.loaded.labels if served is not None else spec.labels
    names = ", ".join(spec.name for spec in service.registry.specs)
    raise NotFound(f"model {name!r} is not served; models: {names}")


def parse_request(body: bytes, header_length: str | None) -> tuple[OipInferenceRequest, bytes]:
    """The request's JSON part, validated, and the binary part that follows it (if any)."""
    split = len(body)
    if header_length is not None:
        declared = parse_length(header_length)
        if declared is None or declared > len(body):
            raise BadRequest(f"{HEADER_LENGTH}: not a length within the body")
        split = declared
    try:
        payload = OipInferenceRequest.model_validate_json(body[:split])
    except ValidationError as exc:
        # The one validation handler words it (where and what, never the value).
        raise RequestValidationError(exc.errors(include_input=False)) from None
    return payload, body[split:]


def requested_outputs(payload: OipInferenceRequest) -> list[str]:
    """The outputs asked for, in the order asked; both when none are named."""
    if not payload.outputs:
        return list(OUTPUTS)
    names = [output.name for output in payload.outputs]
    for output in names:
        if output not in OUTPUTS:
            raise InvalidInput(f"no output {output!r}; outputs: {', '.join(OUTPUTS)}")
    return names


def input_texts(tensor: OipRequestInput, binary: bytes) -> list[str]:
    """The texts of the BYTES input, from its JSON `data` or from the binary part."""
    if tensor.datatype != "BYTES":
        raise InvalidInput(f"input {tensor.name!r}: datatype must be BYTES (texts)")
    size = (tensor.parameters or {}).get("binary_data_size")
    if size is not None:
        if tensor.data is not None:
            raise InvalidInput(f"input {tensor.name!r}: both data and binary_data_size")
        if not isinstance(size, int) or isinstance(size, bool) or size != len(binary):
            raise BadRequest(f"input {tensor.name!r}: binary_data_size does not match the body")
        texts = decode_bytes_tensor(binary, tensor.name)
    else:
        if binary:
            raise BadRequest("bytes after the JSON header, but no input names binary_data_size")
        if tensor.data is None:
            raise InvalidInput(f"input {tensor.name!r}: no data")
        if not all(isinstance(text, str) for text in tensor.data):
            raise InvalidInput(f"input {tensor.name!r}: data must be a flat list of strings")
        texts = list(tensor.data)
        index = first_lone_surrogate(texts)
        if index is not None:
            raise InvalidInput(
                f"input {tensor.name!r}: data[{index}] is not valid Unicode (lone surrogate)"
            )
    if not texts:
        raise InvalidInput(f"input {tensor.name!r}: no texts")
    count = math.prod(tensor.shape)
    if count != len(texts):
        raise InvalidInput(
            f"input {tensor.name!r}: shape {tensor.shape} holds {count} elements, "
            f"data has {len(texts)}"
        )
    return texts


def decode_bytes_tensor(data: bytes, name: str) -> list[str]:
    """Triton's BYTES layout: each element a 4-byte little-endian length, then its bytes."""
    texts: list[str] = []
    offset = 0
    while offset < len(data):
        if offset + 4 > len(data):
            raise BadRequest(f"input {name!r}: binary data ends inside an element's length")
        (length,) = struct.unpack_from("<I", data, offset)
        offset += 4
        if offset + length > len(data):
            raise BadRequest(f"input {name!r}: binary data ends inside element {len(texts)}")
        try:
            texts.append(data[offset : offset + length].decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidInput(f"input {name!r}: element {len(texts)} is not UTF-8") from None
        offset += length
    return texts
