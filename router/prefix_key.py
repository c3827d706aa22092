"""The text `prefix-hash` routes on: the first characters of a request's prompt, as the pod will see it.

Chat messages are rendered as role and text in order (a shared system prompt therefore leads the key);
a completion's prompt is its text, or its token ids written out, or the first of a batch. A body that
is not a JSON object keys on its raw bytes: the pod answers it with its own 400, and routing it stays
deterministic.
"""

from __future__ import annotations

import json


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only the text parts reach a text model
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def prompt_text(body: dict, chars: int) -> str:
    """At most `chars` characters of the prompt `body` carries (chat or completion)."""
    out: list[str] = []
    size = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if not isinstance(m, dict):
                continue
            part = f"{m.get('role', '')}:{_content_text(m.get('content'))}\n"
            out.append(part)
            size += len(part)
            if size >= chars:  # later messages cannot reach the key
                break
        return "".join(out)[:chars]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its first prompt places it
    if isinstance(prompt, list):  # token ids
        return " ".join(map(str, prompt))[:chars]
    return str(prompt)[:chars] if prompt is not None else ""


def routing_key(raw: bytes, chars: int) -> str:
    """The key of a request body, `raw` as received."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw[:chars].decode("utf-8", "replace")
    if not isinstance(body, dict):
        return raw[:chars].decode("utf-8", "replace")
    return prompt_text(body, chars)
