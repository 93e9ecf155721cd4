"""Adapters at run time, in vLLM's shapes so its clients and gateways work:
POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter, and GET /v1/adapters."""

from __future__ import annotations

from fastapi import APIRouter

from api.http.routes.common import Core
from api.http.schemas import (
    AdapterEntry,
    AdapterLoaded,
    AdaptersResponse,
    AdapterUnloaded,
    ErrorBody,
    LoadLoraAdapterRequest,
    ModelAdapters,
    UnloadLoraAdapterRequest,
)
from api.serving.adapters import AdapterInfo

ERRORS: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorBody} for status in (401, 403, 404, 409, 422, 503)
}

router = APIRouter()


@router.post("/v1/load_lora_adapter", response_model=AdapterLoaded, responses=ERRORS)
async def load_lora_adapter(body: LoadLoraAdapterRequest, service: Core) -> AdapterLoaded:
    """Loads an adapter, or swaps in new weights for one of that name: checked against its
    base first (refused with the reason, nothing changed), then attached between batches.
    Only from under ADAPTERS_DIR or ADAPTER_ROOTS: elsewhere is a 403 that says nothing of
    what lies there."""
    adapters, done = await service.load_adapter(
        body.model, body.lora_name, body.lora_path, body.sha256, body.pinned
    )
    return AdapterLoaded(
        model=adapters.served.name,
        result=done.result,  # type: ignore[arg-type]
        seconds=round(done.seconds, 6),
        attach_seconds=round(done.attach_seconds, 6),
        adapter=entry(done.adapter),
    )


@router.post("/v1/unload_lora_adapter", response_model=AdapterUnloaded, responses=ERRORS)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, service: Core) -> AdapterUnloaded:
    """Unloads a run-time adapter: new requests for it get 404 at once; this answers once the
    requests already holding it are answered and it is detached."""
    adapters, info = await service.unload_adapter(body.model, body.lora_name)
    return AdapterUnloaded(model=adapters.served.name, adapter=entry(info))


@router.get("/v1/adapters", response_model=AdaptersResponse)
async def list_adapters(service: Core) -> AdaptersResponse:
    """Every model's adapters: source, digest, rank, pinned, resident, loaded at, requests."""
    return AdaptersResponse(
        models=[
            ModelAdapters(
                model=name,
                runtime_adapters=runner.adapters.accepts_runtime,
                max_resident=runner.adapters.max_resident,
                adapters=[entry(info) for info in runner.adapters.listing()],
            )
            for name, runner in service.runners.items()
        ]
    )


def entry(info: AdapterInfo) -> AdapterEntry:
    """An adapter as the routes answer it."""
    loaded_at = info.loaded_at.isoformat() if info.loaded_at is not None else None
    return AdapterEntry(
        name=info.name,
        source=info.source,
        path=info.path,
        digest=info.digest,
        rank=info.rank,
        pinned=info.pinned,
        resident=info.resident,
        loaded_at=loaded_at,
        requests=info.requests,
        identity=info.identity,
    )
