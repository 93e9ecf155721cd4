"""Scoring against a running server over HTTP: POST /predict, with API_KEY as its bearer
key. The server's refusals come back as the same codes the in-process scorer raises."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from api.batch.scoring import MULTI_LABEL, Outcome, Refused, Servable, Target
from api.serving.cascade import CASCADE_NAME
from api.serving.errors import NotFound

# A batch of long texts on a busy CPU server can take a while; the server's own deadline
# answers first (504, waited out and asked again).
TIMEOUT_SECONDS = 300.0


@asynccontextmanager
async def remote_service(
    url: str, api_key: str | None, use_cache: bool = True
) -> AsyncIterator[RemoteSource]:
    """A client of the server at `url` until the block ends."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(
        base_url=url.rstrip("/"), headers=headers, timeout=TIMEOUT_SECONDS
    ) as client:
        yield RemoteSource(client, use_cache)


class RemoteSource:
    """Scores by POST /predict; describes its targets from GET /models and /info."""

    def __init__(self, client: httpx.AsyncClient, use_cache: bool = True) -> None:
        self.client = client
        self.use_cache = use_cache
        self.max_texts: int | None = None  # the server's MAX_TEXTS_PER_REQUEST, once asked

    async def describe(self, target: Target) -> Servable:
        models = {m["name"]: m for m in (await self._get("/models"))["models"]}
        if target.cascade:
            cascade = (await self._get("/info")).get("cascade")
            if cascade is None:
                raise Refused(NotFound.code, f"no {CASCADE_NAME!r}: the server runs no cascade")
            chosen = [models[cascade["first"]], models[cascade["second"]]]
            adapters = [m["default_adapter"] for m in chosen]
            name, adapter = CASCADE_NAME, None
        else:
            first = next(iter(models.values()))
            model = models.get(target.model or first["name"])
            if model is None:
                raise Refused(NotFound.code, f"no model {target.model!r} (models: {list(models)})")
            adapter = target.adapter or model["default_adapter"]
            chosen, adapters, name = [model], [adapter], model["name"]
        return Servable(
            model=name,
            adapter=adapter,
            labels=list(chosen[0]["labels"]),
            decision_threshold=None if target.cascade else threshold_of(chosen[0], adapter),
            identities={
                m["name"]: identity_of(m, a)["digest"]
                for m, a in zip(chosen, adapters, strict=True)
            },
            multi_label=components_of(chosen[0], adapters[0]).get("problem_type") == MULTI_LABEL,
        )

    async def score(self, target: Target, texts: list[str], truncate: bool) -> list[Outcome]:
        if self.max_texts is None:
            self.max_texts = int((await self._get("/info"))["max_texts_per_request"])
        step = self.max_texts
        if len(texts) > step:  # a --batch-size over the server's limit: requests it takes
            return [
                outcome
                for start in range(0, len(texts), step)
                for outcome in await self.score(target, texts[start : start + step], truncate)
            ]
        body: dict[str, Any] = {"inputs": texts, "truncate": truncate, "cache": self.use_cache}
        if target.cascade:
            body["model"] = CASCADE_NAME
        elif target.model is not None:
            body["model"] = target.model
        if target.adapter is not None:
            body["adapter"] = target.adapter
        # Sent with JSON's ASCII escapes: httpx's own encoding (UTF-8) raises here on a lone
        # surrogate ("\\ud800" in a JSONL input), which the server refuses as one bad text.
        content = json.dumps(body, allow_nan=False).encode("ascii")
        response = await self.client.post(
            "/predict", content=content, headers={"Content-Type": "application/json"}
        )
        if response.status_code != 200:
            raise refusal(response)
        answered_by = response.headers.get("X-Answered-By", "").split(",")
        return [
            Outcome(ranked, by) for ranked, by in zip(response.json(), answered_by, strict=True)
        ]

    async def _get(self, path: str) -> dict[str, Any]:
        response = await self.client.get(path)
        if response.status_code != 200:
            raise refusal(response)
        answer: dict[str, Any] = response.json()
        return answer


def identity_of(model: dict[str, Any], adapter: str | None) -> dict[str, Any]:
    """The /models identity of `model` answering with `adapter`."""
    for identity in model["identities"]:
        if identity["adapter"] == adapter:
            found: dict[str, Any] = identity
            return found
    raise Refused(NotFound.code, f"model {model['name']!r} has no adapter {adapter!r}")


def components_of(model: dict[str, Any], adapter: str | None) -> dict[str, Any]:
    """What the answer identity of `model` with `adapter` records: its numerics among them."""
    components: dict[str, Any] = identity_of(model, adapter)["components"]
    return components


def threshold_of(model: dict[str, Any], adapter: str | None) -> float | None:
    """The model's decision threshold, as its answer identity records it."""
    threshold = components_of(model, adapter).get("decision_threshold")
    return None if threshold is None else float(threshold)


def refusal(response: httpx.Response) -> Refused:
    """A non-200 answer as a refusal: the error body's code and message, and Retry-After."""
    try:
        error = response.json()["error"]
        code, message = str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        code, message = f"http_{response.status_code}", response.text[:200]
    wait = response.headers.get("Retry-After")
    return Refused(code, message, float(wait) if wait and wait.isdigit() else None)
