"""Prompt inputs (after ``vllm.inputs``): a str, a TextPrompt or a TokensPrompt, and how to read one.
Knows nothing about steps or engines (a tokenizer is passed in)."""

from __future__ import annotations

from typing import Any, TypedDict

__all__ = ["PromptType", "TextPrompt", "TokensPrompt", "parse_prompt"]


class TextPrompt(TypedDict, total=False):
    """A prompt as text (tokenized by the engine's tokenizer)."""

    prompt: str


class TokensPrompt(TypedDict, total=False):
    """A prompt as token ids (``prompt``, when given, is only echoed back)."""

    prompt_token_ids: list[int]
    prompt: str


PromptType = str | TextPrompt | TokensPrompt


def parse_prompt(tokenizer, prompt: Any) -> tuple[str | None, Any]:
    """(text or None, token ids) of a str, a TextPrompt or a TokensPrompt."""
    if isinstance(prompt, str):
        return prompt, tokenizer(prompt)["input_ids"]
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise TypeError(f"prompt={text!r:.80} must be a str (the text of prompt_token_ids) or absent")
        return text, prompt["prompt_token_ids"]
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"], tokenizer(prompt["prompt"])["input_ids"]
    raise TypeError(f"prompt {prompt!r:.80} is not a string, {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}")

