"""Rendering a conversation with the model's chat template (transformers)."""

from __future__ import annotations

from typing import Any

Conversation = list[dict[str, Any]]


def render_chat(
    tokenizer: Any,
    conversation: Conversation,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[int]]:
    """The prompt text and its token ids for one conversation."""
    if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
        raise ValueError("a conversation must be a list of {'role': ..., 'content': ...} messages")
    for message in conversation:
        if "role" not in message:
            raise ValueError("every chat message needs a 'role'")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the model has no chat template; pass chat_template=...")
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            **(chat_template_kwargs or {}),
        )
    except Exception as exc:  # jinja raises many types for a bad conversation or template
        raise ValueError(f"cannot apply the chat template: {exc}") from exc
    # The template already wrote any special tokens (bos, role markers) as text.
    return text, list(tokenizer.encode(text, add_special_tokens=False))
