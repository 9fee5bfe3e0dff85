"""Tool calls in the formats the chat templates teach, and back into OpenAI's tool_calls.

Two formats: Hermes (Qwen2.5 and templates that render `tools` themselves: one JSON object per
<tool_call> block) and SmolLM2's (a JSON list of calls in one <tool_call> block, the tools described in
the system prompt, since its template knows nothing of tools). A `required` or named tool_choice becomes a
grammar (structured output), so the answer is a well-formed call whose arguments match the function's
parameters; `auto` leaves the model free and parses whatever calls it wrote.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from speculant.config import StructuredOutputsParams
from speculant.structured.grammar import JSON_OPTIONS

SMOLLM2_SYSTEM = (
    "You are an expert in composing functions. You are given a question and a set of possible functions. "
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose. "
    "If none of the functions can be used, point it out and refuse to answer. If the given question lacks the "
    "parameters required by the function, also point it out.\n\nYou have access to the following tools:\n"
    "<tools>{tools}</tools>\n\nThe output MUST strictly adhere to the following format, and NO other text MUST be "
    "included.\nThe example format is as follows. Please make sure the parameter type is correct. If no function "
    "call is needed, please make the tool calls an empty list '[]'.\n<tool_call>[\n{{\"name\": \"func_name1\", "
    "\"arguments\": {{\"argument1\": \"value1\", \"argument2\": \"value2\"}}}},\n... (more tool calls as "
    "required)\n]</tool_call>")
# With tool_choice "auto" the model may also answer in text (after a tool's result, most often): SmolLM2's own
# prompt above forbids any text and asks for an empty list instead, which would never end an agent's loop.
SMOLLM2_AUTO_SYSTEM = SMOLLM2_SYSTEM.replace(
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.",
    "To call functions, the output MUST strictly adhere to the following format.").replace(
    "If no function call is needed, please make the tool calls an empty list '[]'.",
    "If no function call is needed (for instance once the tool results answer the question), answer in plain "
    "text, without any <tool_call>.")


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str
    close: str
    as_list: bool  # all calls as one JSON list in one block (SmolLM2), else one block per call (Hermes)
    template_renders_tools: bool

    def call_schema(self, functions: list[dict]) -> dict:
        """A call {"name": ..., "arguments": ...} of one of `functions` (OpenAI function objects)."""
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                   "arguments": f.get("parameters") or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return {**schema, "x-guidance": JSON_OPTIONS}

    def constraint(self, functions: list[dict], parallel: bool) -> StructuredOutputsParams:
        """The grammar of an answer that calls `functions` (one call, or several when `parallel`)."""
        call = f"call: %json {json.dumps(self.call_schema(functions))}"
        if self.as_list:
            more = ' (", " call)*' if parallel else ""
            start = f"start: {lark_string(self.open + '[')} call{more} {lark_string(']' + self.close)}"
        else:
            block = f"block: {lark_string(self.open + chr(10))} call {lark_string(chr(10) + self.close)}"
            start = ("start: block (\"\\n\" block)*" if parallel else "start: block") + "\n" + block
        return StructuredOutputsParams(grammar=f"{start}\n{call}\n")

    def parse(self, text: str) -> tuple[str | None, list[dict]] | None:
        """An answer → (its content outside the calls, None if empty; the calls as OpenAI tool_calls);
        None when it holds no well-formed call."""
        pattern = re.escape(self.open) + r"(.*?)" + re.escape(self.close)
        blocks = re.findall(pattern, text, flags=re.DOTALL)
        if not blocks:
            return None
        calls = []
        for block in blocks:
            try:
                found = json.loads(block)
            except json.JSONDecodeError:
                return None
            for call in found if isinstance(found, list) else [found]:
                if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
                    return None
                arguments = call.get("arguments", {})
                calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": call["name"], "arguments": arguments if isinstance(arguments, str)
                                           else json.dumps(arguments, ensure_ascii=False)}})
        if not calls:
            return None
        content = re.sub(pattern, "", text, flags=re.DOTALL).strip()
        return content or None, calls

    def messages_for_template(self, messages: list[dict], functions: list[dict] | None,
                              auto: bool = False) -> list[dict]:
        """OpenAI messages (assistant tool_calls, tool results) → what the chat template reads. A template
        that knows no tools gets them in the system prompt (which lets it answer in text where `auto`), and
        earlier calls in this format as text."""
        out = []
        for m in messages:
            calls = [{"name": c["function"]["name"], "arguments": json_value(c["function"]["arguments"])}
                     for c in m.get("tool_calls") or []]
            if calls and not self.template_renders_tools:
                blocks = [calls] if self.as_list else calls
                text = "".join(self.open + json.dumps(b, ensure_ascii=False) + self.close for b in blocks)
                m = {"role": "assistant", "content": ((m.get("content") or "") + text)}
            elif calls:
                m = {**m, "tool_calls": [{"type": "function", "function": c} for c in calls]}
            out.append(m)
        if functions and not self.template_renders_tools:
            system = SMOLLM2_AUTO_SYSTEM if auto else SMOLLM2_SYSTEM
            prompt = system.format(tools=json.dumps(functions, ensure_ascii=False))
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": prompt + "\n\n" + out[0]["content"]}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", as_list=False, template_renders_tools=True)
SMOLLM2 = ToolFormat("smollm2", "<tool_call>", "</tool_call>", as_list=True, template_renders_tools=False)


def tool_format(chat_template: str | None) -> ToolFormat:
    """The format a chat template teaches: Hermes where it renders `tools` itself (Qwen2.5), else SmolLM2's."""
    template = chat_template or ""
    return HERMES if "tools" in template and "<tool_call>" in template else SMOLLM2


def json_value(text: str):
    """A call's arguments as the templates want them: parsed (the API sends them as JSON text)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return text


def lark_string(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text)


class ToolCallStream:
    """A streamed answer's text, split as it grows: content streams until a call may be starting (the
    opening tag, or a tail that could become it); from there the text is held and parsed at the end."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.text = ""
        self.sent = 0  # characters streamed as content
        self.holding = False

    def push(self, piece: str) -> str:
        """More text → the content that can be streamed now."""
        self.text += piece
        if self.holding:
            return ""
        at = self.text.find(self.fmt.open, self.sent)
        if at >= 0:
            self.holding = True
            end = at
        else:
            end = len(self.text)
            for n in range(min(len(self.fmt.open) - 1, len(self.text) - self.sent), 0, -1):
                if self.text.endswith(self.fmt.open[:n]):
                    end -= n
                    break
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """The answer is complete → (content not yet streamed, the calls)."""
        rest = self.text[self.sent:]
        parsed = self.fmt.parse(rest) if self.holding else None
        if parsed is None:
            return rest, []
        content, calls = parsed
        return content or "", calls
