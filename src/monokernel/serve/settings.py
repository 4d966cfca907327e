"""Server settings, kept free of FastAPI so the CLI can build them before importing it."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
# Without max_tokens a request may run to the end of the context; cap it so a forgotten
# field does not hold the one engine slot for tens of thousands of tokens.
DEFAULT_MAX_TOKENS_CAP = 4096
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_queue: int = DEFAULT_MAX_QUEUE  # requests waiting behind the running one
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP
    retry_after_s: int = 1
    # Browser origins allowed to call the API (CORS); empty: no CORS headers at all.
    allowed_origins: tuple[str, ...] = ()
    # On SIGTERM, how long running requests may go on before they are ended.
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
