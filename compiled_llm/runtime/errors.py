"""Errors the engine raises to its callers."""


class EngineDeadError(RuntimeError):
    """The engine cannot run any more (a worker process died, a collective failed). Every later step
    raises it too; `LLMEngine.is_healthy()` is False. Start a new engine."""
