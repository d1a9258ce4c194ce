"""What every route needs: the async engine, served names, chat template, the server's input processor."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from compiled_llm.multimodal.media import MediaPolicy
from compiled_llm.server.async_engine import AsyncEngine
from compiled_llm.server.errors import APIError
from compiled_llm.server.logprobs import TokenText
from compiled_llm.server.reasoning import ReasoningParser, single_token_id
from compiled_llm.server.tool_parsers import ToolParser

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


@dataclass
class ServerState:
    aengine: AsyncEngine
    served_model_names: list[str]
    chat_template: str | None = None
    api_key: str | None = None
    media_policy: MediaPolicy = field(default_factory=MediaPolicy)  # media URLs, files, limits (multimodal)
    tool_parser: ToolParser | None = None  # the checkpoint's tool-call format (server/tools.py)
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser (server/reasoning.py)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.token_text = TokenText(self.tokenizer)
        self.vocab_size = len(self.tokenizer)
        self.reasoning_end_id = (single_token_id(self.tokenizer, self.reasoning_parser.end)
                                 if self.reasoning_parser is not None else None)

    @property
    def engine(self):
        return self.aengine.engine

    @property
    def inputs(self):
        """The event loop's own input processor (token texts): never the engine's. Prompts are preprocessed by
        `preprocess`'s threads."""
        return self.aengine.inputs

    @property
    def preprocess(self):
        """Worker threads for templates and tokenization (server/preprocess.py)."""
        return self.aengine.preprocess

    @property
    def tokenizer(self):
        return self.aengine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.config.max_model_len)

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if requested is None:
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise APIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")
        return requested

    def count_error(self, path: str) -> None:
        """Errors of generation routes count as requests_total{status="error"}."""
        if path in GENERATION_PATHS:
            self.aengine.metrics.count_status("error")

    def error_observer(self, path: str):
        return lambda _status: self.count_error(path)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"
