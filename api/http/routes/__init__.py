"""The HTTP routes: /predict, the Open Inference Protocol's /v2, vLLM's adapter routes, and
the routes that report on the service."""

from fastapi import APIRouter

from api.http.routes import adapters, oip, status, tei

router = APIRouter()
router.include_router(tei.router)
router.include_router(status.router)
router.include_router(oip.router)
router.include_router(adapters.router)
