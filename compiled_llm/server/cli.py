"""`serve` flags and entry point: add_serve_args(parser) and run_server(args)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from pathlib import Path

from compiled_llm.config import add_engine_args, config_from_args

logger = logging.getLogger("compiled_llm.server")

DESCRIPTION = (
    "Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
    "/v1/responses, /v1/models, /tokenize, /detokenize, /health, /metrics). "
    "Without --model the built-in demo model is served."
)


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Server flags plus every engine flag (--model, --max-model-len, ...)."""
    parser.description = parser.description or DESCRIPTION
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) the API answers to; the first is reported (default: the checkpoint "
                        "folder name)")
    g.add_argument("--api-key", default=os.environ.get("COMPILED_LLM_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every /v1 route "
                        "(default: $COMPILED_LLM_API_KEY, else no key)")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template file (or inline template) replacing the checkpoint's")
    g.add_argument("--tool-call-parser", default=None, choices=["gemma4", "qwen"],
                   help="tool-call format of the model's output (default: the one of the checkpoint's model type: "
                        "gemma4 for Gemma 4, qwen for Qwen3.5)")
    g.add_argument("--reasoning-parser", default=None, choices=["qwen3", "gemma4"],
                   help="split a thinking model's output into `reasoning` and `content`: qwen3 (<think>...</think>, "
                        "Qwen3 and Qwen3.5) or gemma4 (<|channel>thought...<channel|>) (default: off, the reasoning "
                        "stays in the content)")
    g.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (the tokenizer's special tokens, class and chat template), which "
                        "lm-evaluation-harness's remote tokenizer reads (default: off, as in vLLM)")
    g.add_argument("--graceful-shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, how long in-flight requests may run before they are aborted "
                        "(default: 30)")
    g.add_argument("--allowed-media-domains", nargs="*", default=[], metavar="DOMAIN",
                   help="hosts (and their subdomains) that image/video http(s) URLs may come from (default: none; "
                        "data: URLs are always accepted)")
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="folder under which file: media URLs may be read (default: no local files)")
    g.add_argument("--limit-mm-per-prompt", default=None, metavar="LIMITS",
                   help="most media items per prompt, e.g. 'image=4,audio=1,video=1' or a JSON object "
                        "(default: image=8,audio=4,video=2)")
    g.add_argument("--max-media-bytes", type=int, default=20 << 20, metavar="BYTES",
                   help="largest media file accepted, in bytes (default: 20 MiB)")
    g.add_argument("--max-request-body-bytes", type=int, default=32 << 20, metavar="BYTES",
                   help="largest request body accepted, in bytes; larger ones get a 413 (default: 32 MiB)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="log level (default: info)")
    if "--model" not in parser._option_string_actions:  # the caller may have added engine flags already
        add_engine_args(parser.add_argument_group("engine"))
    return parser


def load_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise SystemExit(f"--chat-template: no such file: {value}")


def run_server(args: argparse.Namespace) -> int:
    """Load the engine, serve until SIGTERM/SIGINT, shut down gracefully; returns the exit status (0)."""
    import uvicorn

    from compiled_llm.runtime.engine import LLMEngine
    from compiled_llm.server.app import create_app
    from compiled_llm.server.async_engine import EngineThread, one_thread_elsewhere

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(args.log_level.upper())
    chat_template = load_chat_template(args.chat_template)
    config = config_from_args(args)
    logger.info("loading %s", config.resolved_model())
    engine_thread = EngineThread()  # start-up and steps on one thread (EngineThread says why)
    engine = engine_thread.call(LLMEngine, config)
    one_thread_elsewhere()
    app = create_app(engine, served_model_names=args.served_model_name, api_key=args.api_key,
                     chat_template=chat_template, media_policy=media_policy_from_args(args),
                     max_request_body_bytes=args.max_request_body_bytes, tool_call_parser=args.tool_call_parser,
                     engine_thread=engine_thread, reasoning_parser=args.reasoning_parser,
                     tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=args.graceful_shutdown_timeout,
    ))
    # uvicorn re-raises the signal that stopped it once it has shut down gracefully; with these
    # handlers in place that re-raise is a no-op and the process exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    logger.info("serving %s on http://%s:%d", app.state.server.served_model_names[0], args.host, args.port)
    server.run()
    return 0 if server.started else 1


def media_policy_from_args(args: argparse.Namespace):
    """The media policy of the serve flags (multimodal/media.py)."""
    from compiled_llm.multimodal.media import MediaPolicy, parse_limits

    try:
        limits = parse_limits(getattr(args, "limit_mm_per_prompt", None))
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--limit-mm-per-prompt: {e}") from None
    return MediaPolicy(allowed_domains=list(getattr(args, "allowed_media_domains", None) or []),
                       allowed_local_path=getattr(args, "allowed_local_media_path", None), limits=limits,
                       max_bytes=getattr(args, "max_media_bytes", 20 << 20))
