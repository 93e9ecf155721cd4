"""Service settings: one pydantic-settings class read from the environment and `.env`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from dotenv import dotenv_values
from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from api.cpus import parse_cpu_list

ADAPTER_DIR_SUFFIX = "_ADAPTER_DIR"
REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://")


class AdapterDirSource(PydanticBaseSettingsSource):
    """Collects the seed names `<MODEL>_ADAPTER_DIR` from `.env` and the environment.

    Their names depend on the models declared, so they cannot be fields of their own.
    """

    def __init__(self, settings_cls: type[BaseSettings], env_file: str | None) -> None:
        super().__init__(settings_cls)
        self._env_file = env_file

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        found: dict[str, str] = {}
        if self._env_file and Path(self._env_file).is_file():
            for key, value in dotenv_values(self._env_file).items():
                if key.upper().endswith(ADAPTER_DIR_SUFFIX) and value:
                    found[key.upper()] = value
        for key, value in os.environ.items():
            if key.upper().endswith(ADAPTER_DIR_SUFFIX) and value:
                found[key.upper()] = value
        return {"adapter_dirs": found} if found else {}


class Settings(BaseSettings):
    """Every knob of the service; each one is also listed in `.env.example`."""

    model_config = SettingsConfigDict(
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        case_sensitive=False,
        # `NAME=` with nothing after it means unset, as in the shells and loaders people use.
        env_ignore_empty=True,
    )

    # --- models and loading ---
    models_file: Path | None = Field(
        None, description="YAML/JSON file declaring the models; unset serves the embedded default."
    )
    use_safetensors: bool = Field(True, description="Load weights only from .safetensors files.")
    low_cpu_mem_usage: bool = Field(
        True,
        description="Build models empty, then fill them (transformers 5 always does).",
    )
    max_memory_gb: float | None = Field(
        None,
        gt=0,
        description="Memory budget per GPU shared by every model, in GiB: each gets what the "
        "models before it left; one it cannot hold on the GPU is refused, never offloaded.",
    )
    hf_home: Path | None = Field(
        None, description="Hugging Face cache root (put it on an SSD); hub ids resolve here."
    )
    transformers_cache: Path | None = Field(
        None,
        description="Deprecated by transformers for HF_HOME: the hub cache folder itself; "
        "honoured before HF_HOME/hub, with a warning at start.",
    )
    model_cache_dir: Path | None = Field(
        None,
        description="Where models converted (GGUF, EXAONE) or pre-quantized at start-up are "
        "kept; unset: ~/.cache/loraserve/models, so each machine converts once.",
    )
    prequantized_cache: bool = Field(
        True,
        description="Save an int8/nf4/fp4 model once quantized under MODEL_CACHE_DIR/"
        "prequantized, keyed by its sources and settings, and load it from there next time.",
    )
    offline: bool = Field(
        True, description="Never reach the model hub: resolve hub ids from the local cache only."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where models run: auto picks cuda when present, else cpu."
    )
    torch_num_threads: int | None = Field(
        None,
        ge=1,
        description="Intra-op threads for torch on CPU; unset uses every core (MODEL_CPUS's, "
        "when set).",
    )
    forward_processes: int = Field(
        1,
        ge=1,
        le=64,
        description="Processes each CPU model's batches run in, each holding the model with "
        "torch on TORCH_NUM_THREADS / n threads: a batch is cut into parts the processes take "
        "as they finish one (a batch under 8 texts runs in the serving process). The serving "
        "process keeps its own copy too (n + 1 copies in memory). 1: every batch runs in the "
        "serving process.",
    )
    memory_allocator: Literal["jemalloc", "system"] = Field(
        "jemalloc",
        description="The serving process's allocator: jemalloc (preloaded at start, where "
        "installed; else the system's, with a warning) keeps a CPU forward's speed and the "
        "heap flat as a server ages; system: glibc's.",
    )
    warmup: bool = Field(
        True, description="Run the largest batches the batcher can form after loading."
    )
    merge_single_adapter: bool = Field(
        True, description="Merge a model's only adapter into full-precision weights."
    )
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", description="Attention kernel: PyTorch's fused SDPA, or the eager reference."
    )
    torch_compile: bool = Field(
        False, description="torch.compile each model's forward (slower start-up)."
    )
    cuda_graphs: bool = Field(
        True,
        description="On a GPU, pad an unquantized classifier's batches to buckets and replay "
        "each bucket's forward as a CUDA graph (each checked against the eager forward).",
    )
    pack_batches: bool = Field(
        True,
        description="Run BERT/ELECTRA batches padding-free (checked against padded at load).",
    )
    pad_to_multiple_of: int | None = Field(
        None, ge=1, description="Pad batches to a multiple of this many tokens (length buckets)."
    )
    batch_logit_tolerance: float | None = Field(
        None,
        ge=0,
        description="A model whose load measures a batch_max_logit_difference above this "
        "scores each text alone (a forward per text), so that no answer depends on its "
        "batch-mates; unset: every model batches.",
    )
    adapter_dirs: dict[str, str] = Field(
        default_factory=dict,
        description="Read from <MODEL>_ADAPTER_DIR variables: overrides a model's adapter path.",
    )

    # --- HTTP ---
    host: str = Field("127.0.0.1", description="Address the server binds to.")
    port: int = Field(8000, ge=1, le=65535, description="Port the server listens on.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level of the service and uvicorn."
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="text: lines for a person; json: one JSON object per line (time, level, "
        "logger, message, and a request's id and fields), every logger and warning included.",
    )
    api_key: SecretStr | None = Field(
        None, description="When set, every route but health/ready/metrics needs this bearer key."
    )
    split_socket: Path | None = Field(
        None,
        description="A Unix socket for the front-end/model split: `loraserve` (the model "
        "side) also answers `loraserve front-end` processes on it, and a front end reaches "
        "the models through it. Put it in a folder only the service's user can open.",
    )
    model_cpus: Annotated[frozenset[int] | None, NoDecode] = Field(
        None,
        description="The CPUs the process holding the models runs on (the model side of the "
        "split, the one process, or `loraserve score` and `evaluate` without --url), as Linux "
        "lists them (0-3,8); unset: wherever the OS schedules it. Apart from FRONT_END_CPUS, "
        "the split's two processes stop taking each other's cores (see docs/scaling.md).",
    )
    front_end_cpus: Annotated[frozenset[int] | None, NoDecode] = Field(
        None,
        description="The CPUs `loraserve front-end` runs on, as for MODEL_CPUS; unset: "
        "wherever the OS schedules it.",
    )
    split_front_end: bool = Field(
        False,
        description="The split with one command: `loraserve` serves the models and starts "
        "`loraserve front-end` on HOST:PORT as a child process (on SPLIT_SOCKET, or a socket "
        "of its own), stops it first on SIGTERM, and stops (exit 4) if it dies.",
    )
    front_ends: int = Field(
        1,
        ge=1,
        le=64,
        description="With SPLIT_FRONT_END: how many front-end processes answer HOST:PORT "
        "together, the kernel spreading the clients' connections over them. More than one "
        "pays where HTTP, not the model, sets the pace: a GPU host with cores to spare "
        "(docs/scaling.md).",
    )

    # --- request limits ---
    max_texts_per_request: int = Field(32, ge=1, description="Most texts one request may carry.")
    max_text_chars: int = Field(
        20_000, ge=1, description="Most characters per text, checked before tokenizing."
    )
    max_body_bytes: int = Field(
        2 * 1024 * 1024, ge=1024, description="Largest request body, chunked bodies included."
    )
    request_timeout_seconds: float = Field(
        10.0, gt=0, description="Deadline per request; past it, its texts are dropped unrun (504)."
    )
    drain_seconds: float = Field(
        10.0, ge=0, description="On SIGTERM: most seconds to finish accepted requests."
    )
    gc_gen0_threshold: int = Field(
        10_000,
        ge=1,
        description="While serving: net allocations between Python's youngest-generation "
        "collections (Python's own default: 700; see docs/batching.md).",
    )

    # --- dynamic batching (per model) ---
    max_batch_size: int = Field(32, ge=1, description="Most texts in one forward pass.")
    max_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="Most tokens in one forward pass, padding counted if padded; unset: "
        "2048 on a CPU (past that a forward's cost per token rises), 8192 on a GPU.",
    )
    max_batch_wait_seconds: float = Field(
        0.0,
        ge=0,
        description="Longest a text waits for others to fill its batch once the device is "
        "free; 0 runs what is queued at once (batches still fill while the device is busy).",
    )
    batch_refill_wait_seconds: float = Field(
        0.005,
        ge=0,
        description="After a batch, longest the next one waits for the clients it answered "
        "to send their next texts (clients that wait for each answer), unless it is full; "
        "0 never waits for them.",
    )
    batch_overhead_tokens: float | None = Field(
        None,
        ge=0,
        description="A forward's fixed cost in tokens: rows of other lengths join a batch only "
        "if they raise its real tokens per cost; unset: measured per model at warm-up.",
    )
    max_queue_size: int = Field(
        256, ge=1, description="Most requests queued or running per model; more get 429."
    )

    # --- result cache ---
    lru_cache_entries: int = Field(
        100_000, ge=0, description="In-process LRU size in texts; 0 turns it off."
    )
    disk_cache_dir: Path = Field(
        Path(".cache/predictions"), description="Folder of the disk cache tier."
    )
    disk_cache_max_bytes: int = Field(
        1024**3, ge=0, description="Disk cache size bound in bytes; 0 turns it off."
    )
    disk_cache_ttl_seconds: float | None = Field(
        None, gt=0, description="Disk entries expire after this long; unset keeps them."
    )
    disk_cache_admission: Literal["every", "repeated"] = Field(
        "repeated",
        description="Which answers the disk tier writes: `repeated`, a text's from the second "
        "time this process stores it (a one-off text is never written, and most of a "
        "spam filter's texts come once; a restart forgets what was seen once), or `every` one.",
    )
    disk_cache_secret: SecretStr | None = Field(
        None,
        min_length=16,
        description="Key the disk tier signs its values with (16+ characters; e.g. `openssl "
        "rand -hex 32`): each value carries an HMAC over its key and itself, and a value "
        "without a valid one is a miss, so whoever can write DISK_CACHE_DIR cannot choose "
        "answers. Unset: the key in DISK_CACHE_SECRET_FILE.",
    )
    disk_cache_secret_file: Path | None = Field(
        None,
        description="The disk tier's key when DISK_CACHE_SECRET is unset: made once (random, "
        "mode 0600), read at every start; the tier is off if the file is another user's or "
        "others can read it. Outside DISK_CACHE_DIR; unset: `<DISK_CACHE_DIR>.key`, beside "
        "the folder. Replicas that share the folder need the same key: this file, or its "
        "text as DISK_CACHE_SECRET.",
    )

    # --- shared cache tier (Redis), after the LRU and the disk ---
    redis_url: str | None = Field(
        None,
        description="Redis that every replica shares as a cache tier "
        "(redis://:PASSWORD@host:6379/0, rediss:// for TLS, unix:///path.sock); unset: no "
        "shared tier. Needs REDIS_CACHE_SECRET (or REDIS_TRUSTED_NETWORK=true).",
    )
    redis_cache_secret: SecretStr | None = Field(
        None,
        min_length=16,
        description="Key every replica shares (16+ characters; e.g. `openssl rand -hex 32`): "
        "each Redis value carries an HMAC over its key and itself, and a value without a "
        "valid one is a miss. Required with REDIS_URL unless REDIS_TRUSTED_NETWORK=true.",
    )
    redis_trusted_network: bool = Field(
        False,
        description="Use REDIS_URL without REDIS_CACHE_SECRET: whoever can write to that Redis "
        "chooses the answers of every replica within a model's label count and softmax (a "
        "value copied from another text's key is served as this text's answer).",
    )
    redis_key_prefix: str = Field(
        "loraserve:", description="Prefix of every key the service writes in Redis."
    )
    redis_ttl_seconds: float | None = Field(
        86400.0, gt=0, description="Redis entries expire after this long; unset keeps them."
    )
    redis_timeout_seconds: float = Field(
        0.05,
        gt=0,
        description="Longest one Redis call (connecting included) may take; past it the "
        "request is answered without the tier.",
    )
    redis_backoff_seconds: float = Field(
        1.0,
        gt=0,
        description="After a Redis fault the tier is skipped this long, then tried once; "
        "each further fault doubles the wait.",
    )
    redis_backoff_max_seconds: float = Field(
        30.0, gt=0, description="Longest wait between tries of a failing Redis."
    )

    # --- cascade (request model "cascade") ---
    cascade_first_model: str | None = Field(
        None, description="Cascade's cheap model; unset: the first declared model."
    )
    cascade_second_model: str | None = Field(
        None, description="Cascade's second model; unset: the second declared, if any."
    )
    cascade_threshold: float | None = Field(
        None,
        ge=0.5,
        le=1.0,
        description="Texts whose top probability from the first model is below this go on; "
        "unset: the first model's cascade_threshold in the models file, else 0.9.",
    )

    admission_control: bool = Field(
        True,
        description="Refuse (429) a request expected to finish past LATENCY_TARGET_SECONDS or "
        "its deadline; false queues it (up to MAX_QUEUE_SIZE) whatever the wait.",
    )
    latency_target_seconds: float = Field(
        2.0,
        gt=0,
        description="Response-time target: a request expected to finish past it gets 429 "
        "(admission by time); requests over it are counted.",
    )
    refusal_delay_seconds: float = Field(
        1.0,
        ge=0,
        description="A request refused for load (429) gets its answer after this pause (never "
        "past its deadline), so clients that retry at once, ignoring Retry-After, cannot spend "
        "the CPU the model needs on refusals; 0 answers at once.",
    )

    # --- adapters at run time (models declared with runtime_adapters: true) ---
    adapters_dir: Path | None = Field(
        None,
        description="Watched folder ADAPTERS_DIR/<model>/<adapter>/: adapters appearing, "
        "changing or leaving it are loaded, swapped or unloaded; read again at start.",
    )
    adapters_poll_seconds: float = Field(
        2.0,
        gt=0,
        description="How often ADAPTERS_DIR is scanned; a change is acted on once it has "
        "stood unchanged for one scan (a copy still being written waits).",
    )
    max_adapters_per_model: int = Field(
        8,
        ge=1,
        description="Most run-time adapters attached per model; beyond it the least recently "
        "used unpinned one is evicted to CPU memory and attached again on its next request.",
    )
    max_adapter_rank: int = Field(
        64, ge=1, description="Largest LoRA rank a run-time adapter may have."
    )
    adapter_roots: Annotated[list[Path] | None, NoDecode] = Field(
        None,
        description="Folders (comma-separated) that POST /v1/load_lora_adapter may load from, "
        "besides ADAPTERS_DIR; a lora_path elsewhere, or reached through a link out of them, "
        "is refused (403).",
    )
    shadow_max_wait_seconds: float = Field(
        5.0,
        gt=0,
        description="How long a candidate's shadow rows wait for room in a batch beside the "
        "clients' rows before they are dropped (counted, never refused to a client).",
    )
    shadow_max_queued_rows: int = Field(
        1024, ge=0, description="Most shadow rows queued per model; more are dropped."
    )
    shadow_batch_share: float = Field(
        0.25,
        gt=0,
        le=1,
        description="A forward of shadow rows holds at most this share of MAX_BATCH_TOKENS: "
        "a client's row that comes while one runs waits for it, so it is kept short.",
    )
    rollout_samples_dir: Path | None = Field(
        None,
        description="Stores texts: where each model's candidate keeps a capped sample of the "
        "texts it labels otherwise than the served adapter, for a person to read. Unset "
        "(the default): no text is stored.",
    )
    rollout_samples_max: int = Field(
        200, ge=1, description="Most disagreeing texts kept per model and candidate."
    )
    admin_api_key: SecretStr | None = Field(
        None,
        description="Opens the routes that load and unload adapters and change a model's "
        "rollout (candidate, promote, rollback), to this bearer key alone "
        "(API_KEY does not open them); unset, they answer 403. It opens every other route too.",
    )

    @property
    def torch_threads(self) -> int | None:
        """torch's intra-op threads: TORCH_NUM_THREADS, else one a CPU of MODEL_CPUS (torch
        counted every core when it was imported, before the process was pinned), else None:
        torch's own count."""
        if self.torch_num_threads is not None:
            return self.torch_num_threads
        return None if self.model_cpus is None else len(self.model_cpus)

    @property
    def hub_cache(self) -> Path | None:
        """Where hub ids resolve: TRANSFORMERS_CACHE, else HF_HOME/hub, else the library's."""
        if self.transformers_cache is not None:
            return self.transformers_cache.expanduser()
        if self.hf_home is not None:
            return self.hf_home.expanduser() / "hub"
        return None

    @property
    def model_cache_folder(self) -> Path:
        """MODEL_CACHE_DIR, or the per-user default."""
        if self.model_cache_dir is not None:
            return self.model_cache_dir.expanduser()
        return Path.home() / ".cache" / "loraserve" / "models"

    @field_validator("models_file")
    @classmethod
    def _models_file_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"no such file: {value}")
        return value

    @field_validator("adapter_roots", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()] or None
        return value

    @field_validator("model_cpus", "front_end_cpus", mode="before")
    @classmethod
    def _cpu_list(cls, value: object) -> object:
        if isinstance(value, str):
            return parse_cpu_list(value) if value.strip() else None
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_url_scheme(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(REDIS_URL_SCHEMES):
            raise ValueError(f"must start with one of {', '.join(REDIS_URL_SCHEMES)}")
        return value

    @model_validator(mode="after")
    def _redis_values_authenticated(self) -> Settings:
        if (
            self.redis_url is not None
            and self.redis_cache_secret is None
            and not self.redis_trusted_network
        ):
            raise ValueError(
                "REDIS_URL is set without REDIS_CACHE_SECRET: whoever can write to that Redis "
                "would choose every replica's answers. Set REDIS_CACHE_SECRET to a secret the "
                "replicas share (e.g. `openssl rand -hex 32`), or REDIS_TRUSTED_NETWORK=true "
                "if only the replicas can reach that Redis"
            )
        return self

    @model_validator(mode="after")
    def _disk_key_outside_the_folder(self) -> Settings:
        key_file = self.disk_cache_secret_file
        if key_file is not None and key_file.resolve().is_relative_to(
            self.disk_cache_dir.resolve()
        ):
            raise ValueError(
                "DISK_CACHE_SECRET_FILE lies inside DISK_CACHE_DIR: whoever can write that "
                "folder could replace the key and choose the answers the disk tier serves. Put "
                "it elsewhere (unset, it is <DISK_CACHE_DIR>.key, beside the folder)"
            )
        return self

    @model_validator(mode="after")
    def _front_ends_of_the_split(self) -> Settings:
        if self.front_ends > 1 and not self.split_front_end:
            raise ValueError(
                f"FRONT_ENDS={self.front_ends} needs SPLIT_FRONT_END=true: it counts the front "
                "ends `loraserve` starts"
            )
        return self

    @model_validator(mode="after")
    def _redis_backoff_bounds(self) -> Settings:
        if self.redis_backoff_max_seconds < self.redis_backoff_seconds:
            raise ValueError("REDIS_BACKOFF_MAX_SECONDS must be at least REDIS_BACKOFF_SECONDS")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        env_file = settings_cls.model_config.get("env_file")
        adapter_dirs = AdapterDirSource(
            settings_cls, env_file if isinstance(env_file, str) else None
        )
        return init_settings, env_settings, dotenv_settings, adapter_dirs, file_secret_settings


class SettingsError(Exception):
    """Settings that cannot start the service; the message names each bad setting."""


def load_settings(**overrides: Any) -> Settings:
    """Read settings, turning validation errors into one message naming each setting."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            name = ".".join(str(part) for part in error["loc"]).upper() or "SETTINGS"
            lines.append(f"{name}: {error['msg']}")
        raise SettingsError("invalid settings:\n  " + "\n  ".join(lines)) from None
