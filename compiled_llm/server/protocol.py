"""Pydantic models of the OpenAI-compatible API: requests, responses and errors."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, Strict

from compiled_llm.server.unicode import valid_unicode

# Strict scalars: "1" is not an int and 1 is not a string, as in the OpenAI API.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # ints are accepted
Bool = Annotated[bool, Strict()]
# Every request string must encode as UTF-8: JSON can carry lone surrogates ("\ud800") that the tokenizer
# cannot take; they are a 400 naming the field, not a 500 from deep inside tokenization.
Str = Annotated[str, Strict(), AfterValidator(valid_unicode)]
TokenIds = Annotated[list[Int], Field(min_length=1)]
Seed = Annotated[int, Strict(), Field(ge=-(2**63), le=2**63 - 1)]


class APIModel(BaseModel):
    """Responses (and errors): NaN/Infinity are never produced."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RequestModel(APIModel):
    """Requests: a field this server does not implement is a 400 that names it, never silently dropped (the few
    accepted and ignored ones are declared fields, marked "accepted, ignored" and listed in docs/server.md)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# ---------------------------------------------------------------- errors
class ErrorInfo(APIModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(APIModel):
    error: ErrorInfo


# ---------------------------------------------------------------- shared request fields
class StreamOptions(RequestModel):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False  # vLLM: with include_usage, every chunk carries the usage so far


class SamplingFields(RequestModel):
    """Sampling fields shared by chat and completions (vLLM extensions included)."""

    model: Str | None = None
    n: Int = Field(1, ge=1, le=128)
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    seed: Seed | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    stop: Str | list[Str] | None = None
    stop_token_ids: list[Int] | None = None
    logit_bias: dict[Str, Float] | None = None  # token id (as text, OpenAI's shape) -> bias in [-100, 100]
    allowed_token_ids: list[Int] | None = None  # vLLM: only these may be sampled
    bad_words: list[Str] | None = None  # vLLM: words the output may not contain
    ignore_eos: Bool = False
    min_tokens: Int = 0
    include_stop_str_in_output: Bool = False
    skip_special_tokens: Bool = True
    spaces_between_special_tokens: Bool = True
    stream: Bool = False
    stream_options: StreamOptions | None = None
    priority: Int = 0  # vLLM: the engine's scheduling priority, lower first (--scheduling-policy priority)
    truncate_prompt_tokens: Int | None = None  # vLLM: keep the prompt's last N tokens (-1: max_model_len - 1)
    return_tokens_as_token_ids: Bool = False  # vLLM: logprobs name each token "token_id:<id>"
    user: Str | None = None  # accepted, ignored


# ---------------------------------------------------------------- chat completions
class TextPart(RequestModel):
    type: Literal["text"]
    text: Str


class MediaURL(RequestModel):
    url: Str
    detail: Str | None = None  # accepted, ignored


class ImageURLPart(RequestModel):  # media parts: docs/multimodal.md
    type: Literal["image_url"]
    image_url: MediaURL | Str


class VideoURLPart(RequestModel):
    type: Literal["video_url"]
    video_url: MediaURL | Str


class InputAudio(RequestModel):
    data: Str  # base64 WAV
    format: Str | None = None


class InputAudioPart(RequestModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart | InputAudioPart, Field(discriminator="type")]


class FunctionCallIn(RequestModel):
    name: Str
    arguments: Str  # JSON text, as the API returned it


class ToolCallIn(RequestModel):
    """An assistant message's earlier tool call, fed back through the chat template."""

    id: Str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[ContentPart] | None = None
    name: Str | None = None  # accepted, ignored
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: Str | None = None  # tool: the call this message answers
    reasoning: Str | None = None  # assistant: its reasoning, as returned (--reasoning-parser)
    reasoning_content: Str | None = None  # the same, under vLLM's older / SGLang's name


# ---------------------------------------------------------------- tools
class FunctionDef(RequestModel):
    name: Annotated[Str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: Str | None = None
    parameters: dict[Str, Any] | None = None  # JSON schema; rendered by the chat template
    strict: Bool | None = None  # accepted, ignored (no grammar backend: nothing is enforced)


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(RequestModel):
    name: Str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


class JSONSchemaFormat(RequestModel):
    name: Str | None = None  # accepted, ignored (OpenAI requires it; vLLM does not)
    description: Str | None = None  # accepted, ignored
    schema_: dict[Str, Any] | None = Field(None, alias="schema")
    strict: Bool | None = None  # accepted: the schema is always enforced


class ResponseFormat(RequestModel):
    """Structured output (server/structured_output.py): "json_object" is any JSON object, "json_schema" JSON
    valid against json_schema.schema, enforced while decoding."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs` request field: one constraint (server/structured_output.py)."""
    json_: dict[Str, Any] | Str | None = Field(None, alias="json")  # a JSON schema (or its JSON text)
    regex: Str | None = None
    choice: list[Str] | None = None
    grammar: Str | None = None  # EBNF (xgrammar's GBNF-style syntax; rule `root`)
    json_object: Bool | None = None


class ConstraintFields(RequestModel):
    """Structured output beside OpenAI's response_format: vLLM's `structured_outputs` and its older `guided_*`
    fields (chat and completions); at most one constraint a request."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[Str, Any] | Str | None = None
    guided_regex: Str | None = None
    guided_choice: list[Str] | None = None
    guided_grammar: Str | None = None
    guided_decoding_backend: Str | None = None  # accepted, ignored (xgrammar serves every constraint)


class ChatCompletionRequest(ConstraintFields, SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = None  # false: only the first call is returned
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: Bool = True
    # vLLM's: the last message (an answer begun by the client) is left open and the model goes on with it; with
    # add_generation_prompt false
    continue_final_message: Bool = False
    chat_template_kwargs: dict[Str, Any] | None = None  # extra template variables ({"enable_thinking": false})
    include_reasoning: Bool = True  # false: a reasoning parser's reasoning is left out of the answer
    # vLLM's: the last message's text before the answer, where that message has the answer's role (an assistant
    # message continued, or any last message without add_generation_prompt)
    echo: Bool = False
    prompt_logprobs: Int | None = None  # vLLM's: the prompt's logprobs and top-N, in the response's prompt_logprobs


class TopLogprob(APIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(APIModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(APIModel):
    name: str
    arguments: str  # JSON text


class ToolCall(APIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(APIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None  # --reasoning-parser: the chain of thought
    reasoning_content: str | None = None  # the same text under vLLM's older / SGLang's name


class ChatChoice(APIModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptTokensDetails(APIModel):
    cached_tokens: int = 0


class CompletionTokensDetails(APIModel):
    reasoning_tokens: int = 0


class Usage(APIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # with a reasoning parser


class ChatCompletionResponse(APIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's, when asked for


# ---------------------------------------------------------------- completions
class CompletionRequest(ConstraintFields, SamplingFields):
    prompt: (
        Str
        | Annotated[list[Str], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: Bool = False  # with logprobs: the prompt's tokens and their logprobs come first (scoring a text)
    prompt_logprobs: Int | None = None  # vLLM: each prompt token's logprob and top-N, in choices[].prompt_logprobs
    suffix: Str | None = None


class CompletionLogprobs(APIModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(APIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class CompletionResponse(APIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


# ---------------------------------------------------------------- responses API
class InputText(RequestModel):
    type: Literal["input_text", "output_text", "text"]
    text: Str
    annotations: list[Any] | None = None  # accepted, ignored: an output_text part of an earlier response
    logprobs: list[Any] | None = None  # accepted, ignored: the same


class InputImage(RequestModel):
    type: Literal["input_image"]
    image_url: Str
    detail: Str | None = None  # accepted, ignored


class InputVideo(RequestModel):
    type: Literal["input_video"]
    video_url: Str


InputPart = Annotated[InputText | InputImage | InputVideo | InputAudioPart, Field(discriminator="type")]


class InputMessage(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Str | list[InputPart]
    id: Str | None = None  # accepted, ignored: an earlier response's output message fed back
    status: Str | None = None  # accepted, ignored: the same
    _reasoning: str | None = PrivateAttr(None)  # the reasoning item before it (responses.py)

    @property
    def reasoning(self) -> str | None:
        return self._reasoning


class ReasoningTextIn(RequestModel):
    type: Literal["reasoning_text"]
    text: Str


class ReasoningInput(RequestModel):
    """An earlier response's reasoning item fed back: its text goes to the assistant message after it."""

    type: Literal["reasoning"]
    id: Str | None = None
    summary: list[Any] = []
    content: list[ReasoningTextIn] | None = None
    encrypted_content: Str | None = None
    status: Str | None = None


class ResponseTextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: Str | None = None
    schema_: dict[Str, Any] | None = Field(None, alias="schema")
    description: Str | None = None
    strict: Bool | None = None


class ResponseTextConfig(RequestModel):
    format: ResponseTextFormat | None = None


class ResponsesRequest(RequestModel):
    model: Str | None = None
    input: Str | Annotated[list[InputMessage | ReasoningInput], Field(min_length=1)]
    instructions: Str | None = None
    max_output_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    seed: Seed | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    top_logprobs: Int | None = None
    include: list[Str] | None = None
    stream: Bool = False
    store: Bool | None = None  # accepted, ignored: nothing is stored
    previous_response_id: Str | None = None
    metadata: dict[Str, Str] | None = None  # accepted, echoed in the response
    user: Str | None = None  # accepted, ignored
    text: ResponseTextConfig | None = None  # format: text, json_object or json_schema (structured output)


class OutputText(APIModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[dict[str, Any]] | None = None


class OutputMessage(APIModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class ReasoningText(APIModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(APIModel):
    """The chain of thought of a thinking model (--reasoning-parser), before the message."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = []
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(APIModel):
    cached_tokens: int = 0


class OutputTokensDetails(APIModel):
    reasoning_tokens: int = 0


class ResponseUsage(APIModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(APIModel):
    reason: str


class ResponseObject(APIModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    incomplete_details: IncompleteDetails | None = None
    error: ErrorInfo | None = None
    model: str
    instructions: str | None = None
    output: list[Annotated[ReasoningItem | OutputMessage, Field(discriminator="type")]]
    parallel_tool_calls: bool = False
    tool_choice: str = "none"
    tools: list[Any] = []
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    text: dict[str, Any] = {"format": {"type": "text"}}
    truncation: str = "disabled"
    usage: ResponseUsage | None = None


# ---------------------------------------------------------------- models, tokenizer
class ModelCard(APIModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "compiled_llm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(APIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize: either a prompt or chat messages."""

    model: Str | None = None
    prompt: Str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None  # with messages: rendered by the chat template, as for a chat completion
    add_special_tokens: Bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False  # with messages, as for a chat completion
    chat_template_kwargs: dict[Str, Any] | None = None  # with messages
    return_token_strs: Bool = False


class TokenizeResponse(APIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: Str | None = None
    tokens: list[Int]


class DetokenizeResponse(APIModel):
    prompt: str
