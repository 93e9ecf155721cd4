"""GET routes that say what the service is doing: /models, /health, /ready, /info, /metrics."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Response
from fastapi.responses import JSONResponse
from prometheus_client.exposition import choose_encoder

from api import __version__
from api.http.routes.common import Core
from api.http.schemas import (
    CascadeInfo,
    ClassifierType,
    HealthResponse,
    InfoResponse,
    ModelInfo,
    ModelProgress,
    ModelsResponse,
    ReadyResponse,
    ServableIdentity,
)
from api.models.loader import low_cpu_mem_usage_effect
from api.models.registry import ServedModel
from api.service.contract import RETRY_AFTER_LOADING_SECONDS, Phase
from api.service.core import Service
from api.serving.classify import ModelRunner

router = APIRouter()


@router.get("/models", response_model=ModelsResponse)
async def models(service: Core) -> ModelsResponse:
    """What is loaded: base, adapters, quantization, dtype, device, load time by phase."""
    return ModelsResponse(
        models=[
            model_info(served, service.runners.get(served.name))
            for served in service.registry.in_order()
        ]
    )


def model_info(served: ServedModel, runner: ModelRunner | None) -> ModelInfo:
    """One model's entry in /models; its answer identities once its runner is up."""
    loaded, spec = served.loaded, served.loaded.spec
    identities = [] if runner is None else list(runner.identities.items())
    mode = "merged" if loaded.merged else ("unmerged" if loaded.adapters else "none")
    return ModelInfo(
        name=spec.name,
        base=spec.base,
        simulated=spec.simulated,
        revision=loaded.revision,
        architecture=loaded.architecture,
        quantization=spec.quantization,
        dtype=loaded.dtype,
        languages=spec.languages,
        on_other_language=spec.on_other_language,
        device=str(loaded.device),
        labels=loaded.labels,
        max_length=spec.max_length,
        adapters=loaded.adapters,
        default_adapter=served.default_adapter,
        adapter_mode=mode,
        weight_bytes=loaded.weight_bytes,
        load_seconds={phase: round(seconds, 4) for phase, seconds in loaded.phases.items()},
        prequantized_cache=loaded.prequantized,
        batch_overhead_tokens=served.overhead_tokens,
        packed_batches=served.predictor.packs_batches,
        cuda_graphs=served.predictor.cuda_graphs is not None,
        batch_max_logit_difference=served.batch_variance,
        scores_texts_alone=served.predictor.scores_alone,
        identities=[
            ServableIdentity(adapter=name, digest=identity.digest, components=identity.components)
            for name, identity in identities
        ],
    )


@router.get("/health", response_model=HealthResponse)
async def health() -> HealthResponse:
    """Alive: the process answers. Says nothing of the models."""
    return HealthResponse(status="ok")


@router.get("/ready", response_model=ReadyResponse, responses={503: {"model": ReadyResponse}})
async def ready(service: Core) -> JSONResponse:
    """200 once every model is loaded and warmed up; 503 with progress before, or draining."""
    registry = service.registry
    body = ReadyResponse(
        status=service.phase.value,
        loaded=len(registry.models),
        total=len(registry.specs),
        models={
            name: ModelProgress(state=p.state, seconds=round(p.seconds, 3))
            for name, p in registry.progress.items()
        },
        error=service.error,
    )
    ok = service.phase is Phase.READY
    headers = None if ok else {"Retry-After": str(RETRY_AFTER_LOADING_SECONDS)}
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503, headers=headers)


@router.get("/info", response_model=InfoResponse)
async def info(service: Core) -> InfoResponse:
    """The service's version, models and request limits."""
    settings = service.settings
    first = service.registry.specs[0]
    served = service.registry.models.get(first.name)
    loaded = served.loaded if served is not None else None
    return InfoResponse(
        name="loraserve",
        version=__version__,
        models=[spec.name for spec in service.registry.specs],
        model_id=first.base or first.name,
        model_sha=loaded.revision if loaded else None,
        model_dtype=loaded.dtype if loaded else None,
        model_type=None if loaded is None else {"classifier": classifier_type(loaded.labels)},
        max_input_length=first.max_length,
        low_cpu_mem_usage=settings.low_cpu_mem_usage,
        low_cpu_mem_usage_effect=low_cpu_mem_usage_effect(),
        max_batch_tokens=served.max_batch_tokens if served else settings.max_batch_tokens,
        max_batch_requests=settings.max_batch_size,
        max_client_batch_size=settings.max_texts_per_request,
        max_concurrent_requests=settings.max_queue_size,
        max_texts_per_request=settings.max_texts_per_request,
        max_text_chars=settings.max_text_chars,
        max_body_bytes=settings.max_body_bytes,
        latency_target_seconds=settings.latency_target_seconds,
        cascade=cascade_info(service),
        decision_thresholds={spec.name: spec.decision_threshold for spec in service.registry.specs},
    )


def classifier_type(labels: list[str]) -> ClassifierType:
    """TEI's `model_type.classifier`: the labels by index and back."""
    return ClassifierType(
        id2label={str(index): label for index, label in enumerate(labels)},
        label2id={label: index for index, label in enumerate(labels)},
    )


def cascade_info(service: Service) -> CascadeInfo | None:
    """The cascade once its models are loaded; None before, or when fewer than two are served."""
    cascade = service.cascade
    if cascade is None:
        return None
    return CascadeInfo(
        first=cascade.first.served.name,
        second=cascade.second.served.name,
        threshold=cascade.threshold,
        threshold_source=cascade.threshold_source,
    )


@router.get("/metrics", include_in_schema=False)
async def metrics(service: Core, accept: Annotated[str, Header()] = "") -> Response:
    """Prometheus exposition of every metric the service keeps: OpenMetrics (with the
    latency histogram's exemplars, the trace ids) when the scraper asks for it, as
    Prometheus does; otherwise the classic text format."""
    if service.cache is not None:
        service.cache.refresh_gauges()
    encode, content_type = choose_encoder(accept)
    return Response(encode(service.metrics.registry), headers={"Content-Type": content_type})
