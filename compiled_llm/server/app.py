"""The FastAPI app: routes, API-key check, lifespan of the engine thread."""

from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from compiled_llm.server.async_engine import AsyncEngine
from compiled_llm.server.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES, BodyLimitMiddleware
from compiled_llm.server.chat import create_chat_completion
from compiled_llm.server.completions import create_completion
from compiled_llm.server.errors import APIError, error_response, install_error_handlers
from compiled_llm.server.inputs import chat_token_ids, check_token_ids
from compiled_llm.server.metrics import Metrics
from compiled_llm.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseObject,
    ResponsesRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from compiled_llm.server.responses import create_response
from compiled_llm.server.state import ServerState
from compiled_llm.server.structured_output import grammar_library_installed
from compiled_llm.server.reasoning import reasoning_parser as get_reasoning_parser
from compiled_llm.server.tools import make_tool_parser, template_tools

logger = logging.getLogger(__name__)

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503)}


def _streamable(model) -> dict:
    return {200: {"model": model, "content": {"text/event-stream": {}}}, **_ERRORS}


class APIKeyMiddleware:
    """Plain ASGI middleware: /v1 routes need `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(auth, self.expected):
                response = error_response(401, "Incorrect or missing API key; send `Authorization: Bearer <key>`.",
                                          code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def warm_streaming() -> None:
    """What the first streamed response would otherwise load while the engine runs the first request's step:
    starlette streams in an anyio task group, and anyio imports its asyncio backend (with its socket and stream
    modules) on first use. On a 2-core CPU that import took ~35 ms of the event loop's first wave under a
    profiler, holding the GIL that the engine thread needs between its ops (session 38)."""
    import anyio

    send, receive = anyio.create_memory_object_stream(1)
    with send, receive:
        async with anyio.create_task_group() as group:
            group.start_soon(send.send, None)
            await receive.receive()


def warm_chat_template(inputs, chat_template: str | None) -> None:
    """Renders the chat template once at start-up: transformers compiles a template on its first use and keeps
    it for the process, and that compile (Python work, holding the GIL) would otherwise fall in the first chat
    request, beside the engine's step (the demo model's 520-byte template: 5.1 ms the first time, 0.08 ms after;
    released checkpoints' templates are ten or more times longer). A model without a template, or a template
    that refuses a lone user turn, is left to its first request."""
    try:
        inputs.apply_chat_template([{"role": "user", "content": "hi"}], True, chat_template)
    except Exception:  # noqa: BLE001 - only a warm-up: the first real request reports the template's error
        pass


async def warm_structured_output(aengine: AsyncEngine) -> None:
    """Builds the grammar compiler (xgrammar's tables of the vocabulary) and the any-JSON-object grammar at
    start-up when xgrammar is installed, so that the first constrained request does not: ~0.7 s at 262,144
    tokens on a 2-core CPU, mostly Python work holding the GIL that the engine thread needs. An engine that
    cannot (started without a tokenizer) says so to its first constrained request, as before."""
    if not grammar_library_installed():
        return
    try:
        await aengine.prepare_structured_output({"json_object": True})
    except Exception as e:  # noqa: BLE001 - a warm-up: the first constrained request reports the error
        logger.info("structured output not prepared at start-up: %s", e)


def create_app(engine, served_model_names: list[str] | None = None, api_key: str | None = None,
               chat_template: str | None = None, media_policy=None,
               max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
               tool_call_parser: str | None = None, engine_thread=None,
               reasoning_parser: str | None = None, tokenizer_info_endpoint: bool = False) -> FastAPI:
    """App serving ``engine`` (an LLMEngine); the engine thread runs while the app's lifespan does.
    tool_call_parser: the tool-call format (server/tool_parsers/); default: the checkpoint's model type's.
    reasoning_parser: qwen3 or gemma4 (server/reasoning.py): the output's reasoning split from its content.
    tokenizer_info_endpoint: serve GET /tokenizer_info (vLLM's; it shows the chat template, so it is opt-in).
    engine_thread: the async_engine.EngineThread that built the engine (its steps run there too)."""
    names = list(served_model_names or [engine.model_name])
    aengine = AsyncEngine(engine, Metrics(names[0]), engine_thread)
    template = chat_template or getattr(aengine.tokenizer, "chat_template", None)
    state = ServerState(aengine, names, chat_template=chat_template, api_key=api_key,
                        tool_parser=make_tool_parser(tool_call_parser, engine.config.resolved_model(), template),
                        reasoning_parser=get_reasoning_parser(reasoning_parser))
    if media_policy is not None:  # multimodal.media.MediaPolicy (--allowed-media-domains, ...)
        state.media_policy = media_policy

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await warm_streaming()
        warm_chat_template(aengine.inputs, chat_template)
        await warm_structured_output(aengine)
        aengine.start()
        try:
            yield
        finally:
            await aengine.stop()

    app = FastAPI(title="compiled_llm OpenAI-compatible server", lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app, lambda request, _status: state.count_error(request.url.path))
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)  # outermost: before auth reads

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        if not aengine.healthy:
            return error_response(503, str(aengine.error or "engine is not running"), code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        text = aengine.metrics.render(aengine.stats, aengine.healthy)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models", response_model=ModelList, responses=_ERRORS)
    async def list_models():
        return ModelList(data=[_card(state, n) for n in names])

    @v1.get("/models/{model:path}", response_model=ModelCard, responses=_ERRORS)
    async def get_model(model: str):
        return _card(state, state.model_name(model))

    @v1.post("/chat/completions", response_model=None, responses=_streamable(ChatCompletionResponse))
    async def chat(req: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state, req, request)

    @v1.post("/completions", response_model=None, responses=_streamable(CompletionResponse))
    async def completions(req: CompletionRequest, request: Request):
        return await create_completion(state, req, request)

    @v1.post("/responses", response_model=None, responses=_streamable(ResponseObject))
    async def responses(req: ResponsesRequest, request: Request):
        return await create_response(state, req, request)

    app.include_router(v1)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(req: TokenizeRequest):
        state.model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            tools = template_tools(req.tools) if req.tools else None
            ids = await chat_token_ids(state, req.messages, req.add_generation_prompt, bool(req.add_special_tokens),
                                       tools, req.chat_template_kwargs, req.continue_final_message)
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await state.preprocess.run(lambda inputs: list(inputs.tokenize(req.prompt, add_special_tokens=add)))
        strs = None
        if req.return_token_strs:
            strs = await state.preprocess.run(lambda inputs: list(inputs.tokenizer.convert_ids_to_tokens(ids)))
        return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)

    if tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info():
            """What a client needs to tokenize as the server does (lm-evaluation-harness's remote tokenizer reads
            it, then calls /tokenize and /detokenize)."""
            tok = state.tokenizer
            info = {"tokenizer_class": type(tok).__name__, "vocab_size": state.vocab_size,
                    "model_max_length": state.max_model_len,
                    "chat_template": state.chat_template or getattr(tok, "chat_template", None)}
            for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
                value = getattr(tok, name, None)
                info[name] = None if value is None else str(value)
            return JSONResponse(info)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(req: DetokenizeRequest):
        state.model_name(req.model)
        check_token_ids(req.tokens, state.vocab_size, "tokens")
        text = await state.preprocess.run(lambda inputs: inputs.tokenizer.decode(req.tokens))
        return DetokenizeResponse(prompt=text)

    _document_400_not_422(app)
    return app


def _document_400_not_422(app: FastAPI) -> None:
    """Validation errors are 400 here: drop the 422 responses FastAPI puts in the schema."""
    build = app.openapi

    def openapi():
        schema = build()
        for ops in schema.get("paths", {}).values():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
        return schema

    app.openapi = openapi


def _card(state: ServerState, name: str) -> ModelCard:
    return ModelCard(id=name, created=state.created, root=state.engine.config.resolved_model(),
                     max_model_len=state.max_model_len)
