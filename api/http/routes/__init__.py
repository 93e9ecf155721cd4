"""The HTTP routes: /predict, the Open Inference Protocol's /v2, vLLM's adapter routes, and
the routes that report on the service."""

from fastapi import APIRouter

from api.http.routes import adapters, oip, rollout, status, tei

# Included into the app one by one, not through a router of routers: FastAPI walks every
# level of inclusion on every request, and /predict is matched first.
ROUTERS: tuple[APIRouter, ...] = (
    tei.router,
    status.router,
    oip.router,
    oip.infer_router,
    adapters.router,
    rollout.router,
)
