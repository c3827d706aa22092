"""The request side of tool calling: `tools`, `tool_choice`, `parallel_tool_calls` -> a `ToolPlan`.

    none       the tools are rendered (as vLLM does by default) but the output is always text
    auto       the model writes text or calls; the family's parser (`tool_parsers`) tells them apart
    required   the grammar forces one or more calls to the given tools
    named      the grammar forces a call to that one function

Forced calls are constrained as JSON, not in the family's own markup: `required` is an array of
`{"name": ..., "parameters": {...}}` (name a const per tool, `anyOf` over the tools, one item unless
`parallel_tool_calls`), a named choice is only the arguments object (its name is known). That is vLLM's
design, kept because (1) it is the same for every family, templates without tool markup included, so no
per-family grammar can drift from the template; (2) the output needs no special tokens, which byte-level
vocabularies split; (3) the arguments are exactly the JSON the tool's schema allows, so they always parse
and validate. The cost: the model is steered into a shape it may not have been trained to write, which
matters little once every token is masked to the schema.

Messages follow HF's chat-template convention: an assistant message's `tool_calls` carry their arguments
as a dict (templates `tojson` them; OpenAI clients send JSON text, parsed here), a tool message its
`tool_call_id`. A template that ignores `tools` renders without them: the model never sees them (vLLM's
behaviour), and `auto` then finds no calls unless the model writes them unprompted.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from iterserve.server.api.errors import APIError
from iterserve.server.api.tool_parsers import Parser, detect_parser, get_parser
from iterserve.server.engine.structured_output import StructuredOutput

# OpenAI: "omitting parameters defines a function with an empty parameter list"
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolPlan:
    """What a chat request with tools asks of the output. `mode`: auto, required or named."""

    mode: str
    parser: Parser | None = None  # the family's (None: unknown): auto reads calls with it, all modes its ids
    function: str | None = None  # named: the one function called
    structured: StructuredOutput | None = None  # required / named: the grammar forcing the calls
    # required / named: (param, JSON schema) of each tool's parameters and of the grammar, in that order, for
    # the engine core to check (a schema it cannot take is a 400 naming the first such param)
    schema_checks: list[tuple[str, str]] = field(default_factory=list)
    parallel: bool = True  # auto: False keeps only the first call a model wrote (the grammar bounds required)


def call_id(parser: Parser | None) -> str:
    # Mistral's templates refuse any id but 9 alphanumeric characters when the call comes back
    if parser is not None and parser.name == "mistral":
        return uuid.uuid4().hex[:9]
    return f"call_{uuid.uuid4().hex[:24]}"


def plan_tools(req, chat_template: str | None, parser_setting: str = "auto") -> ToolPlan | None:
    """Check `tools` / `tool_choice` (400s naming the field) -> the plan, or None for plain text."""
    tools, choice = req.tools or [], req.tool_choice
    if choice is not None and not tools:
        raise APIError(400, "tool_choice: is given only with `tools`", param="tool_choice", code="invalid_value")
    if not tools:
        return None
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise APIError(400, f"tools[{i}].function.name: {name!r} is defined twice",
                           param=f"tools[{i}].function.name", code="invalid_value")
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    if choice == "none":
        return None
    parser = detect_parser(chat_template) if parser_setting == "auto" else get_parser(parser_setting)
    if choice == "auto":
        return ToolPlan("auto", parser=parser, parallel=req.parallel_tool_calls) if parser is not None else None
    if req.response_format is not None and req.response_format.type != "text":
        raise APIError(400, "tool_choice: a forced tool call cannot be combined with a `response_format`; "
                       "the tool's parameters already constrain the output", param="tool_choice",
                       code="invalid_value")
    schemas = [NO_PARAMETERS if t.function.parameters is None else t.function.parameters for t in tools]
    # each tool's schema on its own, so a bad one is named by its index
    checks = [(f"tools[{i}].function.parameters", json.dumps(schema)) for i, schema in enumerate(schemas)]
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in zip(names, schemas, strict=True)]
        array = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not req.parallel_tool_calls:
            array["maxItems"] = 1
        return _forced("required", parser, None, array, checks)
    name = choice.function.name
    if name not in names:
        raise APIError(400, f"tool_choice.function.name: {name!r} is not among the tools "
                       f"({', '.join(names)})", param="tool_choice.function.name", code="invalid_value")
    return _forced("named", parser, name, schemas[names.index(name)], checks)


def _forced(mode: str, parser: Parser | None, function: str | None, schema: dict,
            checks: list[tuple[str, str]]) -> ToolPlan:
    text = json.dumps(schema)
    return ToolPlan(mode, parser=parser, function=function, structured=StructuredOutput(json_schema=text),
                    schema_checks=[*checks, ("tools", text)])


def template_messages(messages) -> list[dict]:
    """The request's messages as the chat template takes them (HF's convention for tool calls)."""
    out = []
    for i, m in enumerate(messages):
        d = {"role": m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
        out.append(d)
    return out


def _template_call(call, param: str) -> dict:
    try:
        args = json.loads(call.function.arguments)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the decoder goes
        args = None
    if not isinstance(args, dict):
        raise APIError(400, f"{param}.function.arguments: must be a JSON object (as text)",
                       param=f"{param}.function.arguments", code="invalid_value")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}}


def template_tools(tools) -> list[dict] | None:
    if not tools:
        return None
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools]
