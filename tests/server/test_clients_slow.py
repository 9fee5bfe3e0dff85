"""The clients people already run, against the bundled SmolLM2 served with prompt lookup: the OpenAI Agents SDK
with its default model (the Responses API) running a function tool to a final answer, and lm-evaluation-harness'
`local-completions` scoring a multiple-choice task from a local file (echo log-probabilities).

Slow, and their libraries are an extra of their own (`pip install 'speculant[clients]'`): each test skips with
the reason where its library is missing.
"""

from __future__ import annotations

import json
import math
from importlib.util import find_spec

import pytest
from conftest import server_engine
from test_server import live_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(smollm_path):
    return server_engine(smollm_path, 1024)


@pytest.fixture(scope="module")
def base(engine):
    from speculant.server.http.app import create_app

    with live_server(create_app(engine, ["smollm"])) as url:
        yield url


def missing(module: str, what: str):
    """Skipped before the server starts where the client library is missing."""
    return pytest.mark.skipif(find_spec(module) is None, reason=f"{what} is not installed: pip install "
                                                                 "'speculant[clients]' (docs/server.md)")


@missing("agents", "the OpenAI Agents SDK")
def test_the_agents_sdk_runs_a_tool_to_a_final_answer(base):
    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    cities = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return "sunny, 21 degrees"

    # The Agents SDK's default model speaks the Responses API. The first turn must call the tool
    # (tool_choice "required"); the SDK then resets tool_choice to "auto", and the loop ends where the model
    # answers in text.
    model = agents.OpenAIResponsesModel("smollm", AsyncOpenAI(base_url=f"{base}/v1", api_key="unused",
                                                              max_retries=0))
    # With these instructions the bundled model answers from the tool's result; with others (no instructions, or
    # "Answer questions about the weather.") it calls the tool again at every turn.
    instructions = ("Use the tools when you need them. When a tool result is available, answer the question in "
                    "plain text.")
    agent = agents.Agent(name="weather", instructions=instructions, tools=[get_weather],
                         model=model, model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                                          max_tokens=80))
    result = agents.Runner.run_sync(agent, "What is the weather like in Paris?", max_turns=4)
    assert cities == ["Paris"]
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert len(calls) == len(outputs) == len(cities)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert result.new_items[-1].type == "message_output_item"


# A multiple-choice task from a local file, as lm-eval's own tasks are written (arc_easy's shape).
DOCS = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Water freezes at a temperature of zero degrees", ["Celsius", "apples", "Tuesday", "blue"], 0),
    ("The opposite of hot is", ["loud", "cold", "tall", "green"], 1),
    ("A week has seven", ["planets", "colours", "days", "oceans"], 2),
    ("The sun rises in the", ["west", "north", "south", "east"], 3),
    ("Two plus two equals", ["four", "five", "three", "six"], 0),
]
TASK = """task: speculant_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""


def hand_scores(base: str, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) from our own /v1/completions echo log-probabilities: the prompt's tokens
    as lm-eval cuts them (the whole text's tokens, the context's first), the continuation's summed."""
    import httpx

    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    n_context = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    out = httpx.post(f"{base}/v1/completions", json={"model": "smollm", "prompt": whole, "echo": True, "logprobs": 1,
                                                     "max_tokens": 0, "temperature": 0}, timeout=60).json()
    return sum(out["choices"][0]["logprobs"]["token_logprobs"][n_context:])


@missing("lm_eval", "lm-evaluation-harness")
def test_lm_eval_local_completions_scores_a_local_task(base, smollm_path, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    transformers = pytest.importorskip("transformers")

    # lm-eval counts tokens with the model's Hugging Face tokenizer: the bundled GGUF's, saved locally (no hub).
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "label": y}) + "\n" for q, c, y in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "speculant_mc.yaml").write_text(TASK.format(data=data))

    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["speculant_mc"], task_manager=TaskManager(include_path=str(tasks)),
        model_args=f"model=smollm,base_url={base}/v1/completions,tokenizer={tmp_path / 'tokenizer'},"
                   "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1",
        log_samples=True)
    samples = sorted(results["samples"]["speculant_mc"], key=lambda s: s["doc_id"])
    right = 0
    for (question, choices, label), sample in zip(DOCS, samples, strict=True):
        ours = [hand_scores(base, tokenizer, question, " " + c) for c in choices]
        theirs = [resp[0][0] for resp in sample["resps"]]
        assert theirs == pytest.approx(ours, abs=1e-4), question
        right += max(range(len(ours)), key=ours.__getitem__) == label
    acc = results["results"]["speculant_mc"]["acc,none"]
    print(f"lm-eval acc {acc} ({right} of {len(DOCS)} by hand)")
    assert math.isclose(acc, right / len(DOCS)), (acc, right)
