"""The shapes of completions' and chat completions' answers, whole and streamed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel

from speculant.sequence import TokenLogprob
from speculant.server.bridge.worker import Delta
from speculant.server.chat.reasoning import ReasoningParser, ThoughtSplitter, reasoning_tokens, thought_end
from speculant.server.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionTokensDetails,
    DeltaMessage,
    FunctionCallDelta,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprobInfo,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    UsageInfo,
)
from speculant.structured.tools import ToolCallStream, ToolFormat


def prompt_logprobs(ids: list[int], lps: list[TokenLogprob | None] | None, n: int | None,
                    token_text: Callable[[int], str]) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs: per prompt token (the first None), its own entry and the n most likely ones'."""
    if n is None or lps is None:
        return None

    def entry(token: int, logprob: float, rank: int) -> PromptLogprob:
        return PromptLogprob(logprob=logprob, rank=rank, decoded_token=token_text(token))

    return [None if lp is None else {str(t): entry(t, lp.logprob, lp.rank), **{
        str(a): entry(a, v, r + 1) for r, (a, v) in enumerate(lp.top[:n]) if a != t}}
        for t, lp in zip(ids, lps)]


@dataclass
class Echo:
    """What completions' echo puts before each choice's text: its prompt's text, and, with logprobs, its
    tokens' log-probabilities with the top `logprobs`."""

    texts: list[str]  # per prompt
    logprobs: int | None


class CompletionFormat:
    """Completions' shapes. One instance serves one request (it counts text offsets per choice, and knows
    which choices have had their echo)."""

    id_prefix = "cmpl"

    def __init__(self, token_text: Callable[[int], str], echo: Echo | None = None,
                 prompts: list[list[int]] | None = None, n: int = 1, prompt_top: int | None = None):
        self.token_text = token_text
        self.echo = echo
        self.prompts, self.n = prompts or [], n  # choice i answers prompt i // n
        self.prompt_top = prompt_top  # vLLM's prompt_logprobs: None, or the top n
        self.offsets: dict[int, int] = {}
        self.started: set[int] = set()  # choices that have had their first chunk

    def logprobs(self, d: Delta, echoed: bool) -> CompletionLogprobs | None:
        if d.logprobs is None:
            return None
        ids, values, tops = list(d.token_ids), [lp.logprob for lp in d.logprobs], [lp.top for lp in d.logprobs]
        if echoed:  # the prompt's tokens first, the first one's null as OpenAI writes it
            prompt = self.prompts[d.index // self.n]
            lps = d.prompt_logprobs or [None] * len(prompt)
            ids = prompt + ids
            values = [None if lp is None else lp.logprob for lp in lps] + values
            tops = [None if lp is None else lp.top[:self.echo.logprobs] for lp in lps] + tops
        tokens = [self.token_text(t) for t in ids]
        offsets = []
        for tok in tokens:
            offsets.append(self.offsets.get(d.index, 0))
            self.offsets[d.index] = offsets[-1] + len(tok)
        return CompletionLogprobs(tokens=tokens, token_logprobs=values, text_offset=offsets,
                                  top_logprobs=[None if top is None else {self.token_text(t): v for t, v in top}
                                                for top in tops])

    def response(self, rid: str, model: str, choices: list[Delta], with_ids: bool, **extra) -> BaseModel:
        return CompletionResponse(id=rid, model=model, choices=self.choices(choices, with_ids), **extra)

    def opening(self, rid: str, created: int, model: str, n: int) -> list[BaseModel]:
        return []

    def chunk(self, rid: str, created: int, model: str, deltas: list[Delta], with_ids: bool,
              choice_ids: list[list[int]] | None = None, **extra) -> BaseModel:
        return CompletionResponse(id=rid, created=created, model=model, choices=self.choices(deltas, with_ids),
                                  **extra)

    def choices(self, deltas: list[Delta], with_ids: bool) -> list[CompletionChoice]:
        out = []
        for d in deltas:
            first = d.index not in self.started
            self.started.add(d.index)
            echoed = self.echo is not None and first
            text = self.echo.texts[d.index // self.n] + d.text if echoed else d.text
            prompt = self.prompts[d.index // self.n] if self.prompts else []
            out.append(CompletionChoice(
                index=d.index, text=text, finish_reason=d.finish_reason, logprobs=self.logprobs(d, echoed),
                token_ids=d.token_ids if with_ids else None,
                prompt_logprobs=prompt_logprobs(prompt, d.prompt_logprobs, self.prompt_top, self.token_text)))
        return out


class ChatFormat:
    """Chat's shapes. With `tools` (the tool format of a request whose tools are in play) an answer's calls
    leave as tool_calls, finish_reason "tool_calls"; a stream holds the text from where a call may begin. With
    `reasoning` (chat/reasoning.py) a thought leaves as reasoning_content, and the tools are looked for after it."""

    id_prefix = "chatcmpl"

    def __init__(self, token_text: Callable[[int], str], tools: ToolFormat | None = None,
                 prompt: list[int] | None = None, prompt_top: int | None = None,
                 reasoning: ReasoningParser | None = None, decode: Callable[[list[int]], str] | None = None):
        self.token_text = token_text
        self.tools = tools
        self.streams: dict[int, ToolCallStream] = {}
        self.prompt, self.prompt_top = prompt or [], prompt_top  # vLLM's prompt_logprobs: None, or the top n
        self.reasoning, self.decode = reasoning, decode  # decode: ids → the text the engine wrote for them
        self.splitters: dict[int, ThoughtSplitter] = {}

    def reasoning_tokens(self, ids: list[int], end: int) -> int:
        return reasoning_tokens(ids, end, self.decode)

    def with_reasoning_tokens(self, usage: UsageInfo | None, counts: list[int]) -> UsageInfo | None:
        if usage is None or self.reasoning is None:
            return usage
        return usage.model_copy(update={"completion_tokens_details": CompletionTokensDetails(
            reasoning_tokens=sum(counts))})

    def prompt_logprobs(self, deltas: list[Delta]) -> PromptLogprobs | None:
        first = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
        return prompt_logprobs(self.prompt, first, self.prompt_top, self.token_text)

    def logprobs(self, d: Delta) -> ChatLogprobs | None:
        if d.logprobs is None:
            return None

        def top(token: int, logprob: float) -> TopLogprob:
            text = self.token_text(token)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

        return ChatLogprobs(content=[
            TokenLogprobInfo(**top(t, lp.logprob).model_dump(), top_logprobs=[top(a, v) for a, v in lp.top])
            for t, lp in zip(d.token_ids, d.logprobs, strict=True)])

    def response(self, rid: str, model: str, choices: list[Delta], with_ids: bool, usage: UsageInfo | None = None,
                 **extra) -> BaseModel:
        out, counts = [], []
        for d in choices:
            thought, text = None, d.text
            if self.reasoning is not None:
                thought, text, end = self.reasoning.split(d.text)
                counts.append(self.reasoning_tokens(d.token_ids, end))
            message, finish = AssistantMessage(content=text, reasoning_content=thought), d.finish_reason
            if thought is not None and not text:
                message.content = None  # all thought (vLLM's null)
            parsed = self.tools.parse(text) if self.tools is not None else None
            if parsed is not None:
                content, calls = parsed
                message = AssistantMessage(content=content, reasoning_content=thought,
                                           tool_calls=[ToolCall(**c) for c in calls])
                finish = calls_finish(finish)
            out.append(ChatChoice(index=d.index, message=message, finish_reason=finish, logprobs=self.logprobs(d),
                                  token_ids=d.token_ids if with_ids else None))
        return ChatCompletionResponse(id=rid, model=model, choices=out, prompt_logprobs=self.prompt_logprobs(choices),
                                      usage=self.with_reasoning_tokens(usage, counts), **extra)

    def opening(self, rid: str, created: int, model: str, n: int) -> list[BaseModel]:
        # As OpenAI does: each choice's first chunk names the role, with empty content.
        return [ChatCompletionChunk(id=rid, created=created, model=model, choices=[
            ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]) for i in range(n)]

    def chunk(self, rid: str, created: int, model: str, deltas: list[Delta], with_ids: bool,
              usage: UsageInfo | None = None, choice_ids: list[list[int]] | None = None, **extra) -> BaseModel:
        """`choice_ids`, with the usage chunk: each choice's tokens (for its reasoning tokens)."""
        choices = [ChatStreamChoice(index=d.index, delta=delta, finish_reason=finish, logprobs=self.logprobs(d),
                                    token_ids=d.token_ids if with_ids else None)
                   for d in deltas for delta, finish in [self.delta(d)]]
        if usage is not None and choice_ids is not None:  # the usage chunk: every choice has finished
            usage = self.with_reasoning_tokens(usage, [self.reasoning_tokens(choice_ids[i], thought_end(s))
                                                       for i, s in self.splitters.items()])
        return ChatCompletionChunk(id=rid, created=created, model=model, choices=choices,
                                   prompt_logprobs=self.prompt_logprobs(deltas), usage=usage, **extra)

    def split(self, d: Delta) -> tuple[str, str]:
        """A streamed piece → (its thought's part, its answer's part), held back where a tag may be starting."""
        if self.reasoning is None:
            return "", d.text
        splitter = self.splitters.setdefault(d.index, self.reasoning.splitter())
        thought, text = splitter.push(d.text)
        if d.finish_reason is not None:
            more_thought, more_text = splitter.finish()
            thought, text = thought + more_thought, text + more_text
        return thought, text

    def delta(self, d: Delta) -> tuple[DeltaMessage, str | None]:
        thought, text = self.split(d)
        if self.tools is None:
            return DeltaMessage(content=text or None, reasoning_content=thought or None), d.finish_reason
        stream = self.streams.setdefault(d.index, ToolCallStream(self.tools))
        content, calls = stream.push(text), []
        if d.finish_reason is not None:
            rest, calls = stream.finish()
            content += rest
        tool_calls = [ToolCallDelta(index=i, id=c["id"], type="function",
                                    function=FunctionCallDelta(**c["function"])) for i, c in enumerate(calls)]
        finish = calls_finish(d.finish_reason) if calls else d.finish_reason
        return DeltaMessage(content=content or None, reasoning_content=thought or None,
                            tool_calls=tool_calls or None), finish


def calls_finish(reason: str | None) -> str | None:
    """An answer that ended by itself with calls finishes as "tool_calls"; one cut short keeps its reason."""
    return "tool_calls" if reason == "stop" else reason
