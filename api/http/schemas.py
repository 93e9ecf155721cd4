"""Request and response bodies of the HTTP contract (text-embeddings-inference compatible)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

from api.models.spec import NAME_PATTERN, SimulatedDevice
from api.serving.unicode import first_lone_surrogate


class ClassificationParameters(BaseModel):
    """`parameters` as Hugging Face's InferenceClient sends them for text classification."""

    model_config = ConfigDict(extra="forbid")

    top_k: Annotated[int, Field(ge=1)] | None = Field(None, description="Only the k best.")
    function_to_apply: Literal["softmax", "sigmoid", "none"] | None = Field(
        None, description="softmax (the default), sigmoid of each logit, or none (logits)."
    )


class PredictRequest(BaseModel):
    """`POST /predict`: TEI's fields plus optional `model`, `adapter` and `top_k`."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"inputs": "WINNER!! Claim your free prize now"}]},
    )

    inputs: StrictStr | Annotated[list[StrictStr], Field(min_length=1)] = Field(
        description="One text, or a list of texts."
    )
    truncate: StrictBool = Field(
        True, description="Cut texts to the model's max length; false refuses longer texts."
    )
    raw_scores: StrictBool = Field(False, description="Return logits instead of probabilities.")
    model: Annotated[str, Field(pattern=NAME_PATTERN)] | None = Field(
        None, description="Model to use; the first configured one if unset."
    )
    adapter: Annotated[str, Field(pattern=NAME_PATTERN)] | None = Field(
        None, description="LoRA adapter to use; the model's default if unset."
    )
    top_k: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Return only the k best labels."
    )
    cache: StrictBool = Field(True, description="false: neither read nor write the cache.")
    parameters: ClassificationParameters | None = Field(
        None, description="InferenceClient's parameters: top_k, function_to_apply."
    )
    truncation_direction: Literal["right", "Right"] = Field(
        "right", description="TEI's field: texts are cut at the end (left is not supported)."
    )

    @field_validator("inputs")
    @classmethod
    def _valid_unicode(cls, inputs: str | list[str]) -> str | list[str]:
        index = first_lone_surrogate([inputs] if isinstance(inputs, str) else inputs)
        if index is not None:
            raise ValueError(f"inputs[{index}] is not valid Unicode (lone surrogate)")
        return inputs

    @property
    def scores_shown(self) -> str:
        """softmax (probabilities as the model gives them), sigmoid, or none (logits)."""
        function = self.parameters.function_to_apply if self.parameters else None
        if function is not None:
            return function
        return "none" if self.raw_scores else "softmax"

    @property
    def best(self) -> int | None:
        """How many labels to return: `parameters.top_k`, else `top_k`, else all."""
        if self.parameters is not None and self.parameters.top_k is not None:
            return self.parameters.top_k
        return self.top_k

    @property
    def texts(self) -> list[str]:
        """The inputs as a list."""
        return [self.inputs] if isinstance(self.inputs, str) else list(self.inputs)


class LabelScore(BaseModel):
    """One label with its probability (or logit, with raw_scores)."""

    label: str
    score: float


PredictResponse = list[LabelScore] | list[list[LabelScore]]


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorBody(BaseModel):
    """Every error answer has this shape."""

    error: ErrorDetail


class ServableIdentity(BaseModel):
    """The answer identity of one servable (the model with one adapter)."""

    adapter: str | None
    digest: str
    components: dict[str, Any] = Field(
        description="Base and adapter digests, numerics choices, library versions."
    )


class ModelInfo(BaseModel):
    """What `GET /models` says of one loaded model."""

    name: str
    base: str | None = Field(description="Its base; null for a simulated model.")
    simulated: SimulatedDevice | None = Field(
        description="A simulated device's declared cost (it loads no weights and its scores "
        "are a hash of the tokens); null for a real model."
    )
    revision: str | None
    architecture: str
    quantization: str
    dtype: str
    languages: list[str] | None = Field(
        None, description="The languages it reads (ISO 639-1); null: any, nothing detected."
    )
    on_other_language: str = Field(
        "answer", description="A text detected outside them: route, refuse or answer."
    )
    device: str
    labels: list[str]
    max_length: int
    adapters: list[str]
    default_adapter: str | None
    adapter_mode: str = Field(description="unmerged, merged into the base, or none.")
    weight_bytes: int
    load_seconds: dict[str, float] = Field(description="Seconds per load phase.")
    prequantized_cache: str | None = Field(
        description="The pre-quantized checkpoint of an int8/nf4/fp4 model: hit (loaded from "
        "it), written (quantized at start, saved for the next), rebuilt (an unusable one "
        "set aside and replaced), unwritten (the save failed), unreadable (it could not be "
        "read now: quantized at start, the entry left as it is), off; null for other "
        "quantizations."
    )
    batch_overhead_tokens: float | None = Field(
        description="A forward's fixed cost in tokens, as the batcher uses it; null: no limit."
    )
    packed_batches: bool = Field(
        description="Batches run padding-free, the texts packed into one sequence."
    )
    cuda_graphs: bool = Field(
        description="Batches run padded to buckets (rows to a power of two, tokens to a "
        "multiple of 32), each bucket's forward replayed as a CUDA graph (CUDA_GRAPHS)."
    )
    batch_max_logit_difference: float | None = Field(
        description="Largest logit difference of a probe text alone and among batch-mates of "
        "other lengths, measured at load: 0 means a text's scores do not depend on its batch."
    )
    scores_texts_alone: bool = Field(
        description="Each text runs as a batch of one: batch_max_logit_difference was over "
        "BATCH_LOGIT_TOLERANCE, so no answer depends on its batch-mates."
    )
    identities: list[ServableIdentity] = Field(
        description="Per adapter: what decides its answers, and the digest every cache keys by."
    )


class ModelsResponse(BaseModel):
    models: list[ModelInfo]


class ModelProgress(BaseModel):
    state: str = Field(description="waiting, loading, ready or failed.")
    phase: str | None = None
    seconds: float = 0.0


class ReadyResponse(BaseModel):
    """`GET /ready`: `ready` once every model is loaded and warmed up."""

    status: str
    loaded: int
    total: int
    models: dict[str, ModelProgress]
    error: str | None = None


class HealthResponse(BaseModel):
    status: str


class CascadeInfo(BaseModel):
    """The cascade (`"model": "cascade"`): its two models and the threshold between them."""

    first: str
    second: str
    threshold: float
    threshold_source: str = Field(
        description="CASCADE_THRESHOLD, models file (the first model's cascade_threshold), "
        "or fallback."
    )


class ClassifierType(BaseModel):
    id2label: dict[str, str]
    label2id: dict[str, int]


class InfoResponse(BaseModel):
    """The service, its limits, and text-embeddings-inference's fields (first model)."""

    name: str
    version: str
    models: list[str]
    model_id: str | None = Field(None, description="TEI: the first model's base.")
    model_sha: str | None = None
    model_dtype: str | None = None
    model_type: dict[str, ClassifierType] | None = Field(
        None, description="TEI: {'classifier': {id2label, label2id}} of the first model."
    )
    max_input_length: int | None = Field(None, description="TEI: the first model's max tokens.")
    low_cpu_mem_usage: bool = Field(description="LOW_CPU_MEM_USAGE as set.")
    low_cpu_mem_usage_effect: str = Field(description="What it does with this transformers.")
    max_batch_tokens: int | None = Field(
        description="The first model's, once loaded: MAX_BATCH_TOKENS, where unset 2048 on a "
        "CPU and 8192 on a GPU; before, MAX_BATCH_TOKENS as set."
    )
    max_batch_requests: int
    max_client_batch_size: int
    max_concurrent_requests: int
    max_texts_per_request: int
    max_text_chars: int
    max_body_bytes: int
    latency_target_seconds: float
    cascade: CascadeInfo | None = None
    decision_thresholds: dict[str, float | None] = Field(
        default_factory=dict,
        description="Each model's decision_threshold from the models file: its second label "
        "wins above it; null: the top probability wins (0.5 for two labels).",
    )


# --- the Open Inference Protocol (KServe v2), /v2/... ---


class OipError(BaseModel):
    """The Open Inference Protocol's error body, on every /v2 route."""

    error: str


class OipServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class OipLive(BaseModel):
    live: bool


class OipReady(BaseModel):
    ready: bool


class OipModelReady(BaseModel):
    name: str
    ready: bool


class OipTensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int] = Field(description="-1: a dimension of any size.")


class OipModelMetadata(BaseModel):
    name: str
    versions: list[str] = Field(description="None can be asked for: no /versions/ routes.")
    platform: str
    inputs: list[OipTensorMetadata]
    outputs: list[OipTensorMetadata]


class OipParameters(BaseModel):
    """Request `parameters`: `adapter` is this service's; others (e.g. tritonclient's
    `binary_data_output`) are accepted and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)

    adapter: Annotated[str, Field(pattern=NAME_PATTERN)] | None = Field(
        None, description="LoRA adapter to use; the model's default if unset."
    )


class OipRequestInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    shape: list[Annotated[int, Field(ge=0)]]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = Field(
        None, description="A flat list of strings; absent when sent as binary data."
    )


class OipRequestOutput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    parameters: dict[str, Any] | None = None


class OipInferenceRequest(BaseModel):
    """`POST /v2/models/{name}/infer`: one BYTES input of texts."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str | None = None
    parameters: OipParameters | None = None
    inputs: Annotated[list[OipRequestInput], Field(min_length=1, max_length=1)]
    outputs: list[OipRequestOutput] | None = None


class OipResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: list[int] | list[float]


class OipInferenceResponse(BaseModel):
    model_name: str
    id: str
    outputs: list[OipResponseOutput]


# --- adapters at run time, in vLLM's shapes: /v1/load_lora_adapter, /v1/unload_lora_adapter ---

AdapterName = Annotated[str, Field(pattern=NAME_PATTERN)]


class LoadLoraAdapterRequest(BaseModel):
    """`POST /v1/load_lora_adapter`: vLLM's body, plus `model`, `sha256` and `pinned`."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"lora_name": "spam-v2", "lora_path": "/adapters/v2"}]},
    )

    lora_name: AdapterName = Field(description="Name requests select it by (`adapter`).")
    lora_path: Annotated[str, Field(min_length=1)] = Field(
        description="Adapter folder on the server (adapter_config.json, adapter_model.safetensors)."
    )
    model: AdapterName | None = Field(
        None, description="Model to attach it to; the first if unset."
    )
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = Field(
        None, description="Expected sha256 of adapter_model.safetensors; refused if it differs."
    )
    pinned: StrictBool = Field(False, description="Never evicted past MAX_ADAPTERS_PER_MODEL.")
    load_inplace: StrictBool = Field(
        False, description="vLLM's; a load always swaps a same-named adapter, atomically."
    )


class UnloadLoraAdapterRequest(BaseModel):
    """`POST /v1/unload_lora_adapter`: vLLM's body, plus `model`."""

    model_config = ConfigDict(extra="forbid")

    lora_name: AdapterName
    model: AdapterName | None = Field(None, description="Its model; the first if unset.")
    lora_int_id: int | None = Field(None, description="vLLM's: accepted and not used.")


class AdapterEntry(BaseModel):
    """One adapter of a model, as `GET /v1/adapters` lists it."""

    name: str
    source: Literal["models_file", "api", "folder"] = Field(
        description="models_file (there for good), api (/v1/load_lora_adapter) or folder "
        "(ADAPTERS_DIR)."
    )
    path: str
    digest: str | None = Field(description="sha256 of its weights file.")
    rank: int | None = Field(description="LoRA rank (None: merged into the base).")
    pinned: bool
    resident: bool = Field(description="Attached now; false: evicted to CPU memory.")
    loaded_at: str | None = Field(description="When it was loaded (UTC, ISO 8601).")
    requests: int = Field(description="Requests that used it since it was loaded.")
    identity: str = Field(description="The answer identity its cache entries are keyed by.")


class ModelAdapters(BaseModel):
    model: str
    runtime_adapters: bool = Field(description="Takes adapters at run time.")
    max_resident: int = Field(description="MAX_ADAPTERS_PER_MODEL.")
    adapters: list[AdapterEntry]


class AdaptersResponse(BaseModel):
    """`GET /v1/adapters`: every model's adapters."""

    models: list[ModelAdapters]


class AdapterLoaded(BaseModel):
    """What a load did: loaded (new), swapped (new weights for a name) or unchanged."""

    model: str
    result: Literal["loaded", "swapped", "unchanged"]
    seconds: float = Field(description="Time to read, check and attach it.")
    attach_seconds: float = Field(
        description="Of that, the time the model's forwards paused while it was attached."
    )
    adapter: AdapterEntry


class AdapterUnloaded(BaseModel):
    model: str
    result: Literal["unloaded"] = "unloaded"
    adapter: AdapterEntry


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema with its `$defs` written in place, for an OpenAPI request body
    declared by hand (a route that reads its body itself: it may be binary)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(item) for item in node]
        return node

    resolved: dict[str, Any] = resolve(schema)
    return resolved
