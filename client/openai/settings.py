"""What the frontend is told on its command line (cli.py builds it; upstream.py and app.py read it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.paths import REPO_ROOT

DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_REQUEST_TIMEOUT_S = 600.0


@dataclass
class Settings:
    triton_url: str = "127.0.0.1:8001"
    host: str = "127.0.0.1"
    port: int = 9000
    model_names: list[str] = field(default_factory=list)
    tokenizer: str | None = None
    model_repository: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    api_key: str | None = None
