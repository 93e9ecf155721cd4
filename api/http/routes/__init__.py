"""The HTTP routes: /predict, and the routes that report on the service."""

from fastapi import APIRouter

from api.http.routes import status, tei

router = APIRouter()
router.include_router(tei.router)
router.include_router(status.router)
