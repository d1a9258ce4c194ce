"""Turning API requests into engine inputs: prompts (chat template, token ids) and SamplingParams."""

from __future__ import annotations

import asyncio

from compiled_llm.sampling_params import SamplingParams
from compiled_llm.server.errors import APIError
from compiled_llm.server.multimodal import is_media_part, media_prompt, placeholder_for, processed_media_prompt
from compiled_llm.server.protocol import ChatMessage, InputMessage
from compiled_llm.server.tools import message_tool_fields

_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "truncate_prompt_tokens", "bad_words")
_PASSTHROUGH = ("n", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output",
                "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids")


def sampling_params(req, *, max_tokens: int | None, logprobs: int | None, vocab_size: int,
                    **overrides) -> SamplingParams:
    """SamplingParams from the request's fields; its ValueError becomes a 400 naming the field."""
    kw = {name: getattr(req, name) for name in _PASSTHROUGH if hasattr(req, name)}
    kw.update({name: getattr(req, name) for name in _OPTIONAL if getattr(req, name, None) is not None})
    kw.update(max_tokens=max_tokens, logprobs=logprobs, **overrides)
    if getattr(req, "logit_bias", None):
        kw["logit_bias"] = _logit_bias(req.logit_bias, vocab_size)
    for name in ("stop_token_ids", "allowed_token_ids"):
        if kw.get(name):
            check_token_ids(kw[name], vocab_size, name)
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as exc:
        first = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), param=first if first in kw else None) from exc


def request_priority(state, req) -> int:
    """The request's scheduling priority; a 400 for one other than 0 on a server that schedules first come, first
    served."""
    if req.priority and state.engine.config.scheduling_policy != "priority":
        raise APIError(400, "priority needs a server started with --scheduling-policy priority", param="priority")
    return req.priority


def _logit_bias(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys) -> {token id: bias}; a key that is not a token id of the
    vocabulary is a 400."""
    out = {}
    for key, value in bias.items():
        if not key.strip().isdigit():
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        out[int(key)] = value
    check_token_ids(list(out), vocab_size, "logit_bias")
    return out


def check_context(num_prompt: int, max_tokens: int | None, max_model_len: int, param: str,
                  prompt_name: str = "messages") -> None:
    """A prompt that leaves no room, or max_tokens beyond what the context leaves after the prompt, is a 400
    (vLLM's message) rather than a request silently clamped to the context."""
    if num_prompt >= max_model_len:
        raise APIError(400, f"the prompt has {num_prompt} tokens; max_model_len is {max_model_len}, which must "
                            "leave room for at least one generated token", param="prompt")
    if max_tokens is not None and num_prompt + max_tokens > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                            f"{num_prompt + max_tokens} tokens ({num_prompt} in the {prompt_name}, {max_tokens} in the "
                            f"completion). Please reduce the length of the {prompt_name} or completion.", param=param)


def truncate_prompt(params: SamplingParams, prompt, max_model_len: int):
    """A prompt's token ids after the request's truncate_prompt_tokens (before the context check, which then sees
    what the model will); a 400 naming the field for a media prompt or a count past the context."""
    if params.truncate_prompt_tokens is None or isinstance(prompt, str):  # (an empty text: the engine's 400)
        return prompt
    if not isinstance(prompt, list):
        raise APIError(400, "truncate_prompt_tokens cannot cut a prompt with media (it could split an item's tokens)",
                       param="truncate_prompt_tokens")
    try:
        return params.truncated(prompt, max_model_len)
    except ValueError as e:
        raise APIError(400, str(e), param="truncate_prompt_tokens") from e


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    for t in ids:
        if not 0 <= t < vocab_size:
            raise APIError(400, f"token id {t} is out of the vocabulary [0, {vocab_size})", param=param)


def _content(content, media: list | None = None, placeholders: dict[str, str] | None = None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if not is_media_part(part):
            texts.append(part.text)
            continue
        texts.append(placeholder_for(part, placeholders or {}))  # 400 when this model takes no such media
        if media is not None:
            media.append(part)
    return "\n".join(texts)


def has_media(messages: list[ChatMessage | InputMessage]) -> bool:
    return any(not isinstance(m.content, (str, type(None))) and any(is_media_part(p) for p in m.content)
               for m in messages)


def chat_messages(messages: list[ChatMessage | InputMessage], instructions: str | None = None,
                  media: list | None = None, placeholders: dict[str, str] | None = None) -> list[dict]:
    """API messages -> template messages (text parts joined; developer is system; tool calls and tool answers as
    server/tools.py gives them). Media parts become the processor's placeholder text and are appended to `media`
    (server/multimodal.py)."""
    out = [{"role": "system", "content": instructions}] if instructions else []
    calls: dict[str, str] = {}  # tool_call id -> function name, for the tool messages that answer them
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": _content(m.content, media, placeholders),
                    **message_tool_fields(m, calls), **_reasoning_field(m)})
    return out


def _reasoning_field(message) -> dict:
    """An assistant message's earlier reasoning (`reasoning` or `reasoning_content`, as this server returned it),
    under both names for the template (Qwen's templates read `reasoning_content`)."""
    text = getattr(message, "reasoning", None)
    text = text if text is not None else getattr(message, "reasoning_content", None)
    return {} if text is None else {"reasoning_content": text, "reasoning": text}


def render_chat(inputs, messages: list[dict], add_generation_prompt: bool, chat_template: str | None,
                tools: list[dict] | None = None, prefix: str = "", template_kwargs: dict | None = None,
                continue_final_message: bool = False) -> str:
    """The chat template rendered with the server's input processor (400 for template errors), then `prefix`
    (a forced tool-call opening, server/tools.py). template_kwargs: the request's chat_template_kwargs;
    continue_final_message: the last message left open for the model to go on with."""
    kw = {"tools": tools} if tools else {}
    if template_kwargs:
        kw["template_kwargs"] = template_kwargs
    if continue_final_message:
        kw["continue_final_message"] = True
    try:
        text = inputs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                          chat_template=chat_template, **kw)
    except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
        # named: the option the message is about (the input processor refuses one together with
        # add_generation_prompt, transformers a final message it cannot leave open), else the messages
        named = [name for name, given in (("chat_template_kwargs", template_kwargs),
                                          ("continue_final_message", continue_final_message))
                 if given and name in str(exc)]
        param = named[0] if named else "messages"
        raise APIError(400, f"cannot apply the chat template: {exc}", param=param) from exc
    return text + prefix


def chat_prompt(inputs, messages: list[dict], add_generation_prompt: bool, chat_template: str | None,
                add_special_tokens: bool = False, tools: list[dict] | None = None, prefix: str = "",
                template_kwargs: dict | None = None, continue_final_message: bool = False) -> list[int]:
    """Render the chat template and tokenize it (the template already has the special tokens)."""
    text = render_chat(inputs, messages, add_generation_prompt, chat_template, tools, prefix, template_kwargs,
                       continue_final_message)
    return list(inputs.tokenize(text, add_special_tokens=add_special_tokens))


def completion_prompts(prompt) -> list[str | list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> one engine prompt per entry (the engine checks
    token ids against the model's vocabulary)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _media_chat_text(inputs, api_messages, instructions, add_generation_prompt, chat_template, tools, prefix,
                     template_kwargs, continue_final_message):
    """A media chat's rendered template (the processor's placeholders in it) and its media parts."""
    media: list = []
    messages = chat_messages(api_messages, instructions, media, inputs.media_placeholders())
    return render_chat(inputs, messages, add_generation_prompt, chat_template, tools, prefix, template_kwargs,
                       continue_final_message), media


def _chat_ids(inputs, api_messages, instructions, add_generation_prompt, chat_template, tools, prefix,
              template_kwargs, continue_final_message, add_special_tokens=False) -> list[int]:
    return chat_prompt(inputs, chat_messages(api_messages, instructions), add_generation_prompt, chat_template,
                       add_special_tokens=add_special_tokens, tools=tools, prefix=prefix,
                       template_kwargs=template_kwargs, continue_final_message=continue_final_message)


async def chat_engine_prompt(state, api_messages: list[ChatMessage | InputMessage], add_generation_prompt: bool,
                             instructions: str | None = None, tools: list[dict] | None = None,
                             prefix: str = "", add_special_tokens: bool = False,
                             template_kwargs: dict | None = None, continue_final_message: bool = False):
    """Token ids of a text-only chat; for a chat with media parts, a ProcessedPrompt (runtime/input_processor.py):
    the rendered template (placeholders in it) with the media fetched and decoded in a thread (400 for bad or
    too many media), then through the checkpoint's processor in a preprocessing thread. `tools` and
    `template_kwargs` (chat_template_kwargs) go to the template, `prefix` after it (server/tools.py). Templates,
    tokenization and the media processor run in the preprocessing threads (server/preprocess.py), never on the
    event loop or the engine thread."""
    args = (api_messages, instructions, add_generation_prompt, state.chat_template, tools, prefix, template_kwargs,
            continue_final_message)
    if not has_media(api_messages):
        return await state.preprocess.run(_chat_ids, *args, add_special_tokens)
    text, media = await state.preprocess.run(_media_chat_text, *args)
    prompt = await asyncio.to_thread(media_prompt, text, media, state.media_policy)  # may fetch URLs: own thread
    prompt["add_special_tokens"] = add_special_tokens
    return await state.preprocess.run(processed_media_prompt, prompt)


def engine_prompt_ids(prompt) -> list[int]:
    """The token ids of what chat_engine_prompt returned."""
    return prompt if isinstance(prompt, list) else prompt.token_ids


async def chat_token_ids(state, api_messages: list[ChatMessage], add_generation_prompt: bool,
                         add_special_tokens: bool, tools: list[dict] | None = None,
                         template_kwargs: dict | None = None, continue_final_message: bool = False) -> list[int]:
    """/tokenize of chat messages: the template's tokens; with media parts, the ids after the processor expanded
    the placeholders (what the model sees), media fetched and decoded as for a chat completion."""
    prompt = await chat_engine_prompt(state, api_messages, add_generation_prompt, tools=tools,
                                      add_special_tokens=add_special_tokens, template_kwargs=template_kwargs,
                                      continue_final_message=continue_final_message)
    return engine_prompt_ids(prompt)


def _tokenize_all(inputs, prompts: list) -> list:
    return [inputs.tokenize(p) if isinstance(p, str) and p else p for p in prompts]


async def tokenize_prompts(state, prompts: list[str | list[int]]) -> list[str | list[int]]:
    """Completion prompts: text -> token ids in a preprocessing thread (an empty text stays, for the engine's
    400); token ids as given."""
    if not any(isinstance(p, str) and p for p in prompts):
        return prompts
    return await state.preprocess.run(_tokenize_all, prompts)
