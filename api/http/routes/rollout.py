"""A model's rollout: a candidate adapter set beside its default (shadow or canary), read,
stopped, promoted and rolled back. Changes need ADMIN_API_KEY (api.http.middleware.auth)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api.http.routes.common import Core
from api.http.schemas import ErrorBody
from api.models.spec import CandidateSpec
from api.serving.rollout import Rollout

ERRORS: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorBody} for status in (401, 403, 404, 409, 422, 503)
}
SUMMARY = (
    "The model's default adapter, the way back after a promotion, the candidate standing "
    "(adapter, mode, share, guards, the adapter it is compared with, since when) with its "
    "comparison (texts, agreement, flips by direction, each side's labels, the score "
    "difference's buckets), and how the last candidate ended."
)

router = APIRouter()


@router.get("/v1/adapters/{model}/candidate", responses=ERRORS, description=SUMMARY)
async def read_candidate(model: str, service: Core) -> JSONResponse:
    """The model's rollout: default, candidate and comparison."""
    return summary(service.rollout(model))


@router.put("/v1/adapters/{model}/candidate", responses=ERRORS, description=SUMMARY)
async def set_candidate(model: str, body: CandidateSpec, service: Core) -> JSONResponse:
    """Sets one of the model's adapters as its candidate (in shadow or canary, at a share),
    replacing one that stands; its comparison starts from zero."""
    return summary(service.set_candidate(model, body))


@router.delete("/v1/adapters/{model}/candidate", responses=ERRORS, description=SUMMARY)
async def stop_candidate(model: str, service: Core) -> JSONResponse:
    """Stops the candidate; the default stays."""
    return summary(service.stop_candidate(model))


@router.post("/v1/adapters/{model}/promote", responses=ERRORS, description=SUMMARY)
async def promote(model: str, service: Core) -> JSONResponse:
    """The candidate becomes the default; the old default stays loaded as the way back."""
    return summary(service.promote_candidate(model))


@router.post("/v1/adapters/{model}/rollback", responses=ERRORS, description=SUMMARY)
async def roll_back(model: str, service: Core) -> JSONResponse:
    """Rolls back the candidate standing, else the last promotion (the old default again)."""
    return summary(service.roll_back(model))


def summary(rollout: Rollout) -> JSONResponse:
    body: dict[str, Any] = rollout.summary()
    return JSONResponse(body)
