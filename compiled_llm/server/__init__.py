"""OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the engine."""

from compiled_llm.server.cli import add_serve_args, run_server

__all__ = ["add_serve_args", "run_server", "create_app"]


def __getattr__(name):
    if name == "create_app":  # lazy: importing the app pulls in FastAPI
        from compiled_llm.server.app import create_app

        return create_app
    raise AttributeError(name)
