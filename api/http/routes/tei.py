"""POST /predict: one model or the cascade, behind the cache and the batcher."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from api.http.classifying import answer_headers, classify
from api.http.routes.common import (
    OwnBodyRoute,
    ScoresResponse,
    classifier_of,
    json_body,
    read_body,
)
from api.http.schemas import ErrorBody, PredictRequest, PredictResponse
from api.serving.ranking import rank

ERRORS: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorBody} for status in (401, 404, 413, 422, 429, 500, 503, 504)
}

router = APIRouter(route_class=OwnBodyRoute)


PREDICT_BODY = json_body(PredictRequest)


@router.post("/", response_model=PredictResponse, responses=ERRORS, openapi_extra=PREDICT_BODY)
@router.post(
    "/predict", response_model=PredictResponse, responses=ERRORS, openapi_extra=PREDICT_BODY
)
async def predict(request: Request) -> Response:
    """Classifies one text or a list of texts, with one model or the cascade."""
    body = await read_body(request, PredictRequest)
    service = classifier_of(request)
    answer = await classify(
        request, service, body.texts, body.model, body.adapter, body.truncate, body.cache
    )
    result, labels = answer.result, answer.labels
    headers = answer_headers(answer, body.model or answer.answered_by[0])
    ranked = [rank(labels, s, body.scores_shown, body.best) for s in result.scores]
    # Built here, not by FastAPI from the response model: re-validating every score of every
    # answer costs more than the rest of the route (PredictResponse still documents it).
    # One text gets one list (TEI's answer), unless the request came in the Hugging Face
    # Inference API's shape (with `parameters`, as InferenceClient sends it), whose answer to
    # one text is a list holding that list.
    one_list = isinstance(body.inputs, str) and body.parameters is None
    return ScoresResponse(ranked[0] if one_list else ranked, headers=headers)
