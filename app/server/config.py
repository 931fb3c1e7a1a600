"""What the bootstrap hands each HTTP frontend worker (FrontendConfig, through CONFIG_VARIABLE): its own module, so
that the bootstrap reads it without importing the Starlette application (0.2 s before the engine starts)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

CONFIG_VARIABLE = "APPLIANCE_FRONTEND_CONFIG"


@dataclass
class FrontendConfig:
    served_name: str
    model_path: str
    model_format: str
    max_model_len: int
    engine_addresses: list[str]  # one per data-parallel replica
    chat_template: str | None = None
    reasoning: str = "auto"  # model.reasoning
    pooling: str = "last"  # model.pooling, resolved (Deployment.pooling): how /v1/embeddings pools
    # the sampling fields' defaults where a request leaves them out (Deployment.sampling_defaults)
    sampling_defaults: dict = field(default_factory=dict)
    api_key: str | None = None
    max_body_size: int = 4 << 20
    cors_origins: list[str] = field(default_factory=list)
    metrics_auth: bool = True  # with a key set, /metrics needs it too
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 1000
    tokenizer_dir: str | None = None  # the bootstrap's torch-free export; None: read it from the model
    draining_marker: str | None = None  # the bootstrap creates this file when SIGTERM arrives
    shutdown_grace: float = 30.0  # server.shutdown_grace: from that file's creation, in-flight requests' time left
    started_marker: str | None = None  # ... and this one once every replica has been ready together
    metrics_dir: str | None = None
    responses_store: int = 0  # server.responses_store: responses kept, in responses_dir (ResponseStore)
    responses_dir: str | None = None

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, text: str) -> FrontendConfig:
        return cls(**json.loads(text))
