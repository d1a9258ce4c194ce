"""Errors the engine raises to its callers."""


class EngineDeadError(RuntimeError):
    """The engine cannot run any more (a worker process died, a collective failed). Every later step
    raises it too; `LLMEngine.is_healthy()` is False. Start a new engine."""


class StructuredOutputError(ValueError):
    """A request's structured output cannot be served: its JSON schema does not compile, or the grammar library
    (xgrammar) is not installed. Raised by `LLMEngine.add_request` before anything is queued; the server answers
    400 naming the request field the constraint came from."""
