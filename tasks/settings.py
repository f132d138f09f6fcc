"""Every knob of shoal, read from environment variables prefixed `SHOAL_`.

The README lists them; `shoal settings` prints the values in force.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from tasks import engines
from tasks.gateway_settings import GatewaySettings, comma_list
from tasks.precision import Precision
from tasks.topology import QueueType

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
_TASKS_DIR = Path(__file__).resolve().parent
# The source checkout; only tests and benchmarks use it: an installed shoal has none.
REPO_ROOT = _TASKS_DIR.parent


def _packaged_catalog_dir() -> Path:
    # A wheel installs the top-level models/ as tasks/models (pyproject's package-dir); a
    # source checkout or an editable install has no tasks/models and reads models/ itself.
    installed = _TASKS_DIR / "models"
    return installed if installed.is_dir() else REPO_ROOT / "models"


PACKAGED_CATALOG_DIR = _packaged_catalog_dir()


class Settings(GatewaySettings):
    """Every setting: the gateway's (`tasks.gateway_settings`) and the rest."""

    # --- broker and topology ---
    broker_url: str = "amqp://guest:guest@127.0.0.1:5672//"
    broker_heartbeat: float = Field(10.0, description="AMQP heartbeat, seconds (0 disables)")
    management_url: str = "http://guest:guest@127.0.0.1:15672/api/"
    queue_prefix: str = "shoal"
    queue_max_length: int = Field(10_000, ge=1, description="messages per model queue")
    queue_delivery_limit: int = Field(20, ge=2)
    queue_type: QueueType = Field(
        "quorum", description="the model queues' type, where a model's catalog entry sets no "
        "queue_type; classic: less broker CPU, but no delivery limit nor replication"
    )

    # --- models ---
    catalog_dir: Path = Field(
        PACKAGED_CATALOG_DIR, description="a folder of your own entries, read over the "
        "packaged catalog (an entry with the same id replaces the packaged one)"
    )
    models: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [DEFAULT_MODEL], description="worker: the models it may serve: "
        "catalog ids or globs ('*', 'BAAI/*'); a model not pinned loads on its first request")
    pin: Annotated[list[str] | None, NoDecode] = Field(
        None, description="worker: models loaded at start and never evicted (default: the "
        "models SHOAL_MODELS names without a glob; empty: none)")
    device_memory_bytes: int | None = Field(
        None, ge=1, description="worker: bytes of device memory its models may take "
        "(default: SHOAL_DEVICE_MEMORY_FRACTION of the device; of RAM on CPU)")
    device_memory_fraction: float = Field(0.8, gt=0, le=1)
    placement: Literal["fleet", "lru"] = Field(
        "fleet", description="worker: fleet (copies by demand, eviction by value) or lru")
    host_memory_bytes: int | None = Field(
        None, ge=0, description="worker: host memory that keeps evicted models' weights for a "
        "cheap reload (default: a quarter of RAM; 0: off)")
    pool_state_interval_s: float = Field(
        2.0, gt=0, description="worker: how often it tells gateways and its peers what it "
        "has loaded and what it is asked for (and at once on a change)")

    # --- worker ---
    prefetch: int = Field(64, ge=1, description="unacked messages per model consumer")
    batch_max_tokens: int = Field(16_384, ge=1, description="padded tokens per batch")
    batch_max_items: int = Field(64, ge=1)
    batch_max_delay_ms: float = Field(
        0.0, ge=0, description="wait for a fuller batch only while the runtime is busy"
    )
    bulk_slice_ms: float = Field(
        50.0, gt=0, allow_inf_nan=False, description="while callers' requests come, a bulk "
        "job's part runs in batches predicted at most this long, one at a time (issue 29)")
    bulk_pass_ms: float = Field(
        1000.0, gt=0, allow_inf_nan=False, description="job parts passed over for callers' "
        "requests get a batch at least this often")
    hold_horizon_batches: float = Field(
        2.0, gt=0, description="predicted batches of work held beyond the running one"
    )
    hold_horizon_ms: float = Field(
        100.0, gt=0, allow_inf_nan=False, description="held work must be predicted to start "
        "within this (default: this or the smallest latency_target_ms of the served profiles)"
    )
    part_target_ms: float = Field(
        100.0, gt=0, allow_inf_nan=False, description="a request too big for one batch runs "
        "in parts predicted to take at most this (or the profile's latency_target_ms)"
    )
    lora_mixed_batches: bool = Field(
        True, description="requests for different LoRA adapters of a model share batches "
        "(one forward pass); false: a batch per adapter")
    torch_threads: int = Field(0, ge=0, description="0 = torch's default")
    device: str = "cpu"
    precision: Precision | None = Field(
        None, description="worker: every model's forward pass in this format (default: the "
        "catalog profile's precision, else bf16 on a CUDA device that has it, fp16 on other "
        "CUDA devices, fp32 on CPU); a format only one runtime has (bf16: PyTorch, int8: ONNX) "
        "applies to that runtime's models")
    runtime: Annotated[str, AfterValidator(engines.known)] = Field(
        engines.DEFAULT, description="the worker's engine (`tasks.engines`): the models it "
        "takes move onto it, the rest stay where their entries say. sglang: causal LMs and "
        "last-token dense models on SGLang servers (`make sglang`). onnx: the text encoders "
        "ONNX Runtime serves (`shoal export` makes their graphs). sim: no model runs; "
        "batches sleep as long as SHOAL_DEVICE would take (runtimes/doubles/sim) and "
        "results are fake, marked 'simulated'")
    feed_return_after_ms: float = Field(
        200.0, ge=0, allow_inf_nan=False, description="continuous runtimes (SGLang): a "
        "request that waited this long for room while another worker consumes its queue is "
        "given back to the queue")
    sim_speed: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="sim: divides every simulated latency"
    )
    sim_cost_a_ms: float | None = Field(
        None, ge=0, allow_inf_nan=False,
        description="sim: fixed ms per batch (set with b_us and c_ns, or none of them)",
    )
    sim_cost_b_us: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="sim: us per padded token"
    )
    sim_cost_c_ns: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="sim: ns per padded token x longest"
    )
    runtime_start_timeout_s: float = Field(300.0, gt=0)
    runtime_batch_timeout_s: float = Field(
        600.0, gt=0, description="a batch running longer is killed and bisected like a crash"
    )
    # --- shutdown and recovery (worker) ---
    shutdown_grace_s: float = Field(
        25.0, gt=0,
        description="on SIGTERM/SIGINT a worker stops consuming, hands back what has not "
                    "started and finishes what runs within this many seconds, else exits "
                    "as a crash would (what ran is redelivered); 25 leaves Kubernetes' "
                    "default 30 s terminationGracePeriodSeconds room to close the runtime",
    )

    runtime_pipeline_depth: int = Field(
        2, ge=1, le=2, description="batches a worker hands its PyTorch runtime process at "
        "once: 2 lets the runtime tokenize and pad the next batch (and send the last one's "
        "results) while the device computes one; 1 runs them one after another")

    runtime_replicas: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        "auto", description="PyTorch runtime processes per device, each with every model "
        "loaded: several prepare (tokenize, pad, pool, answer) batches on several cores "
        "while the device runs them; auto = 1 on a CPU (its forward uses every core "
        "already), a quarter of the host's cores (at most 8) on a GPU "
        "(runtimes/worker_side/replicas.py)")

    # --- runtime recovery (spare runtime) ---
    runtime_spare: bool = Field(
        True, description="keep a spare PyTorch runtime process imported ahead (torch, "
        "transformers; no model, no CUDA context) so that a crashed runtime is replaced at "
        "the cost of its model loads only; costs the spare's memory (~390 MB RSS on CPU)")

    # --- broker failover ---
    # SHOAL_BROKER_URL takes several `;`-separated URLs (nodes of one cluster), Celery's own
    # failover convention: every process tries them in turn (tasks.broker_urls).
    broker_reconnect_max_s: float = Field(
        1.0, gt=0, le=60, allow_inf_nan=False, description="worker and gateway: the most "
        "seconds between attempts to reconnect to the broker (Celery's own back-off grows "
        "2, 4, 6... to 30 s); each attempt tries every URL of SHOAL_BROKER_URL in turn")
    broker_connect_timeout_s: float = Field(
        4.0, gt=0, allow_inf_nan=False, description="worker and gateway: how long one "
        "connection attempt to one broker URL may take before the next URL is tried")

    # --- HTTP edge (gateway) ---
    # gateway.edge enforces these in uvicorn's httptools protocol; on SIGTERM the gateway
    # drains within SHOAL_SHUTDOWN_GRACE_S (the worker's setting, shared).
    gateway_max_header_bytes: int = Field(
        16 * 1024, ge=1024, description="gateway: bytes of a request's line and headers; "
        "over it: 431 HEADERS_TOO_LARGE and the connection closed")
    gateway_header_timeout_s: float = Field(
        10.0, gt=0, allow_inf_nan=False, description="gateway: seconds a connection may take "
        "to send a request's headers (from its first byte, or from the connection's "
        "opening); then 408 REQUEST_TIMEOUT (or, if nothing came, a bare close)")
    gateway_body_timeout_s: float = Field(
        60.0, gt=0, allow_inf_nan=False, description="gateway: seconds a request may take to "
        "send its whole body after its headers; then 408 REQUEST_TIMEOUT and a close")
    gateway_max_connections: int = Field(
        2048, ge=1, description="gateway: open connections per gateway process; one over it "
        "is answered 503 TOO_MANY_CONNECTIONS and closed at once")
    gateway_keep_alive_s: float = Field(
        5.0, gt=0, allow_inf_nan=False, description="gateway: an idle keep-alive connection "
        "is closed after this many seconds")
    gateway_drain_delay_s: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="gateway: on SIGTERM, keep serving this "
        "many seconds with /readyz answering 503 (a load balancer takes the gateway out) "
        "before it stops accepting; part of SHOAL_SHUTDOWN_GRACE_S")

    # --- API keys, Flower and secrets ---
    api_keys_file: Path | None = Field(
        None, description="gateway: a YAML or JSON file of API keys (sha256 hashes, the "
        "models each may use, rate limits; `shoal keys add` makes entries). Unset: no keys, "
        "the API is open (the local default); set: every route but /healthz, /readyz and "
        "/metrics needs `Authorization: Bearer <key>`")
    api_keys_reload_s: float = Field(
        5.0, gt=0, allow_inf_nan=False, description="gateway: how often it looks for a "
        "changed keys file (keys are added, rotated and revoked without a restart)")
    task_events: bool = Field(
        False, description="worker: send task events (task-received/started/succeeded/"
        "failed, how Flower sees requests) from the start, as `celery worker -E`. Off, "
        "Celery's default: they start when Flower (or `celery control enable_events`) "
        "enables them and stop at `disable_events`; each costs the worker CPU per request")
    flower_user: str = Field("shoal", description="Flower's basic-auth user")
    flower_password: SecretStr | None = Field(
        None, description="Flower's basic-auth password (default: generated by the first "
        "`shoal flower` and kept in SHOAL_FLOWER_PASSWORD_FILE)")
    flower_password_file: Path = Field(
        default_factory=lambda: Path.home() / ".config" / "shoal" / "flower-password",
        description="where `shoal flower` keeps its generated password (mode 0600)")
    worker_metrics_host: str = Field(
        "127.0.0.1", description="worker: the address of its /metrics (loopback unless set)")
    worker_metrics_port: int = Field(9540, ge=0, description="0 disables the worker's /metrics "
                                     "and its probes (/healthz, /readyz)")
    worker_stall_s: float = Field(
        120.0, gt=0, description="worker: /healthz answers 503 (stalled) when its event loop, "
        "consuming with the broker up, has not turned for longer than this")

    @field_validator("models", "pin", mode="before")
    @classmethod
    def _split_models(cls, value: object) -> object:
        return comma_list(value)

    @model_validator(mode="after")
    def _sim_costs_together(self) -> Settings:
        # One or two constants would leave the rest to guess; the device picks all or none.
        given = [self.sim_cost_a_ms, self.sim_cost_b_us, self.sim_cost_c_ns]
        if any(v is not None for v in given) and any(v is None for v in given):
            raise ValueError("set all of SHOAL_SIM_COST_A_MS, SHOAL_SIM_COST_B_US and "
                             "SHOAL_SIM_COST_C_NS, or none of them")
        return self

    @model_validator(mode="after")
    def _no_guest_off_loopback(self) -> Settings:
        # RabbitMQ's well-known guest:guest is for one machine only (RabbitMQ itself refuses
        # it from elsewhere): a fleet across hosts needs a user of its own.
        from tasks.redact import guest_off_loopback

        for name in ("broker_url", "management_url"):
            host = guest_off_loopback(getattr(self, name))
            if host is not None:
                raise ValueError(
                    f"SHOAL_{name.upper()} uses guest:guest on {host}, which is not this "
                    "machine: create a RabbitMQ user (rabbitmqctl add_user; set_permissions; "
                    "set_user_tags for management) and put it in the URL")
        return self

    @property
    def sim_constants(self) -> tuple[float, float, float] | None:
        """The explicit (a_ms, b_us, c_ns) of the sim runtime, if set."""
        if self.sim_cost_a_ms is None or self.sim_cost_b_us is None or self.sim_cost_c_ns is None:
            return None
        return self.sim_cost_a_ms, self.sim_cost_b_us, self.sim_cost_c_ns


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
