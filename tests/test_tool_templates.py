"""A tool round trip (tools, an assistant's call, the tool's answer) parsed as the server parses a request
(`protocol`, `tool_calls`) and rendered through each family's tools-aware template the way the server's
tokenizer renders it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from iterserve.server.api.protocol import ChatCompletionRequest, parse_body
from iterserve.server.api.tool_calls import template_messages, template_tools
from iterserve.server.model.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def render(template: str, call_id: str) -> str:
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21}'}]
    body = json.dumps({"messages": messages, "tools": TOOLS}).encode()
    req = parse_body(ChatCompletionRequest, body, "application/json")
    tokenizer = Tokenizer(BackendTokenizer(models.BPE()), "<s>", "</s>", (TEMPLATES / template).read_text())
    return tokenizer.apply_chat_template(template_messages(req.messages), add_generation_prompt=True,
                                         tools=template_tools(req.tools))


def test_llama3_1():
    text = render("llama3_1.jinja", "call_1")
    assert "Environment: ipython\n" in text
    assert '"name": "get_weather",\n        "description": "Weather now"' in text  # tools, tojson(indent=4)
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": '
            '{"city": "Paris"}}<|eot_id|>') in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"temperature\\": 21}"<|eot_id|>' in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_qwen2_5():
    text = render("qwen2_5.jinja", "call_1")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>') in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text


def test_mistral_v3():
    text = render("mistral_v3.jinja", "abc123def")
    assert text.startswith('<s>[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", '
                           '"description": "Weather now", "parameters": ')
    assert ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123def"}]</s>'
            '[TOOL_RESULTS] {"content": {"temperature": 21}, "call_id": "abc123def"}[/TOOL_RESULTS]') in text


def test_mistral_refuses_an_id_it_was_not_trained_on():
    with pytest.raises(ValueError, match="length 9"):
        render("mistral_v3.jinja", "call_1")
