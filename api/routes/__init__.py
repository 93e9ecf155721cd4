"""The HTTP routes: /predict, and the routes that report on the service."""

from fastapi import APIRouter

from api.routes import predict, status

router = APIRouter()
router.include_router(predict.router)
router.include_router(status.router)
