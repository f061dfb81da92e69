"""Rendering a conversation with the model's chat template (transformers).

Messages reach the template as OpenAI clients send them, made into what templates expect: a
`content` that is null or absent becomes "" (an assistant's tool-call message has none, and
templates concatenate `message['content']`), content parts become one string, and a tool
call's JSON-text `arguments` become an object (templates write them with `tojson`).
"""

from __future__ import annotations

import json
from typing import Any

Conversation = list[dict[str, Any]]


def render_chat(
    tokenizer: Any,
    conversation: Conversation,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
) -> tuple[str, list[int]]:
    """The prompt text and its token ids for one conversation; `tools` (OpenAI's function
    definitions) are rendered by the template, which decides how the model sees them. Any role
    is passed on: the template decides what it makes of it. `continue_final_message` leaves
    the last message open (the text ends with its content, for the model to continue);
    `add_special_tokens` adds the tokenizer's own (bos) to what the template wrote."""
    if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
        raise ValueError("a conversation must be a list of {'role': ..., 'content': ...} messages")
    for message in conversation:
        if "role" not in message:
            raise ValueError("every chat message needs a 'role'")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the model has no chat template; pass chat_template=...")
    conversation = [template_message(m) for m in conversation]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            **(chat_template_kwargs or {}),
        )
    except Exception as exc:  # jinja raises many types for a bad conversation or template
        raise ValueError(f"cannot apply the chat template: {exc}") from exc
    # The template already wrote any special tokens (bos, role markers) as text.
    return text, list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """One message as chat templates read it (see the module docstring); raises `ValueError`
    for content that is neither text nor text parts."""
    message = {**message, "content": _text_content(message.get("content"))}
    if message.get("tool_calls"):
        message["tool_calls"] = [_with_arguments_as_object(call) for call in message["tool_calls"]]
    return message


def _text_content(content: Any) -> str:
    """OpenAI content parts (`[{"type": "text", "text": ...}, ...]`) joined into one string;
    shoal's models read text only."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("a message's content must be a string, a list of text parts, or null")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
        texts.append(part["text"])
    return "\n".join(texts)


def _with_arguments_as_object(call: Any) -> Any:
    """A tool call whose `function.arguments` is the JSON text of an object, with that object
    (as vLLM gives templates); other arguments are left as they came."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return call
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**function, "arguments": parsed}}  # type: ignore[dict-item]
