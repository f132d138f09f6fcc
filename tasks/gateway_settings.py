"""The gateway's settings (and the blob store's and jobs', which the gateway runs), read from
environment variables prefixed `SHOAL_`; `tasks.settings.Settings` adds the rest."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def comma_list(value: object) -> object:
    """A comma-separated environment value as a list (lists pass as they are)."""
    if isinstance(value, str):
        return [m.strip() for m in value.split(",") if m.strip()]
    return value


class GatewaySettings(BaseSettings):
    # hide_input_in_errors: an error about one setting must not print the others (passwords).
    model_config = SettingsConfigDict(env_prefix="SHOAL_", extra="ignore",
                                      hide_input_in_errors=True)

    # --- gateway ---
    gateway_models: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["*"], description="the catalog models the gateway accepts "
        "requests for: ids or globs (default: all)")
    default_models: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="the models a request that names none gets, in "
        "order: on each route whose body may leave `model` out (TEI's, /v1/rerank, "
        "/v1/tokenize), the first of these ids of the kind the route needs; without one, the "
        "gateway's only model of that kind, else the only one workers serve now")
    gateway_unserved: Literal["refuse", "wait"] = Field(
        "refuse", description="a request for a model no worker consumes: refuse it at once "
        "(503), or queue it until its deadline (scale-to-zero deployments)")
    host: str = "127.0.0.1"
    port: int = 8080
    gateway_workers: int = Field(1, ge=1, description="gateway processes (uvicorn workers)")
    default_timeout_ms: int = Field(
        30_000, ge=1, description="a request's deadline when it sends no X-Timeout-Ms (every "
        "model route, the OpenAI ones included)")
    max_timeout_ms: int = Field(300_000, ge=1, description="the largest X-Timeout-Ms accepted")
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1, description="request body limit of the routes that take text "
        "(2,048 texts of ~1,500 characters, or OpenAI's 300,000 tokens per request)")
    max_items: int = Field(
        2048, ge=1, description="items (texts) per request, OpenAI's limit of inputs per "
        "embeddings request; the worker runs a large request in cost-bounded parts")
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="gateway: origins a browser may call it from, "
        "comma-separated ('https://app.example.com,http://localhost:3000'), or '*' for any; "
        "empty (the default): no CORS headers, preflights are refused as before")
    max_text_chars: int = Field(100_000, ge=1, description="characters per text item")
    image_url_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="gateway: the hosts whose http(s) image URLs "
        "/v1/embeddings and /v2/embed may fetch, comma-separated ('images.example.com,"
        "cdn.example.com'; exact names, no wildcards); empty (the default): no fetching, only "
        "data URIs (a URL would let any caller make the gateway fetch from any host: SSRF)")
    retry_after_s: int = Field(1, ge=0)
    coalesce: bool = Field(
        True, description="publish requests for one model that wait together as one message"
    )
    publishes_in_flight: int = Field(
        2, ge=1, description="unconfirmed publishes per model; later requests wait and coalesce"
    )

    # --- blob store (claim check) and jobs ---
    blob_url: str = Field(
        "", description="where binaries over SHOAL_CLAIM_CHECK_BYTES, job inputs and job "
        "results live: any fsspec URL (s3://bucket/prefix needs s3fs); default: a local "
        "folder, ~/.cache/shoal/blobs (one machine only)")
    claim_check_bytes: int = Field(
        256 * 1024, ge=0, description="gateway: a binary part (an image) over this many bytes "
        "goes to the blob store and the message carries a claim (0: every binary part)")
    claim_upload_timeout_s: float = Field(
        10.0, gt=0, allow_inf_nan=False, description="how long a worker waits for a claimed "
        "blob that is still being uploaded (within the request's deadline)")
    max_claim_body_bytes: int = Field(
        64 * 1024 * 1024, ge=1, description="body limit of routes that take images (their "
        "large parts are claim-checked); other routes keep SHOAL_MAX_BODY_BYTES")
    blob_ttl_s: float = Field(
        24 * 3600.0, gt=0, description="claim blobs older than this are orphans (their "
        "request was dead-lettered or lost) and are swept")
    blob_sweep_interval_s: float = Field(600.0, gt=0, description="gateway: how often it "
                                         "sweeps orphaned claim blobs")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="jobs' state")
    job_ttl_s: float = Field(7 * 24 * 3600.0, gt=0, description="how long a finished job "
                             "(its state and result file) is kept")
    max_job_input_bytes: int = Field(4 * 1024**3, ge=1, description="bytes of a bulk job's "
                                     "input file")
    job_part_items: int = Field(
        0, ge=0, description="items per task message of a bulk job (0: 8 batches of the "
        "model's tuned max_items, clamped to 256..4096)")
    job_parts_in_flight: int = Field(
        8, ge=1, description="a bulk job's parts published and not yet answered, and as "
        "many for all of an API key's jobs on one model together; the rest wait "
        "(backpressure: a big job never floods its model's queue, nor do many jobs of one key)")
    jobs_per_key: int = Field(
        10, ge=0, description="jobs and OpenAI batches an API key may have queued or running "
        "at once (all callers together when keys are off; 0: no limit); more: 429 with "
        "Retry-After. A key's `concurrent_jobs` in the keys file overrides it")
    job_texts_per_key: int = Field(
        10_000_000, ge=0, description="items (texts, images, batch lines) an API key's "
        "queued and running jobs may hold not yet done (0: no limit); more: 429 with "
        "Retry-After, or 413 for one job over it alone. A key's `queued_job_texts` "
        "overrides it")
    job_part_timeout_s: float = Field(
        3600.0, gt=0, allow_inf_nan=False, description="deadline of one job part")
    job_lease_s: float = Field(
        15.0, gt=0, allow_inf_nan=False, description="a job's splitter lease: a gateway that "
        "dies holding it is replaced after this")

    @field_validator("gateway_models", "default_models", "cors_origins", "image_url_hosts",
                     mode="before")
    @classmethod
    def _split_lists(cls, value: object) -> object:
        return comma_list(value)
