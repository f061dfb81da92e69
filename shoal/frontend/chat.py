"""Rendering a conversation with the model's chat template (transformers)."""

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
    conversation = [_with_tool_call_arguments_as_objects(m) for m in conversation]
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


def _with_tool_call_arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool calls with their arguments as JSON objects: OpenAI clients
    send them as JSON text, and chat templates write them out with `tojson`."""
    tool_calls = message.get("tool_calls")
    if not tool_calls:
        return message
    converted = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                call = {**call, "function": {**function, "arguments": json.loads(arguments)}}  # type: ignore[dict-item]
            except json.JSONDecodeError as exc:
                raise ValueError(f"a tool call's arguments are not JSON: {exc}") from exc
        converted.append(call)
    return {**message, "tool_calls": converted}
