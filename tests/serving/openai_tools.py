"""Tool calling with the official `openai` client against `tandem serve` on Qwen2.5.

Usage: python openai_tools.py BASE_URL MODEL API_KEY
Exits non-zero (an AssertionError or an API error) on the first failed check.
Greedy and short, so it runs in seconds on a CPU.
"""

import json
import sys

import openai

base_url, model, api_key = sys.argv[1:4]
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
checks = 0


def check(condition, what):
    global checks
    assert condition, what
    checks += 1


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city, e.g. Paris"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "description": "An IANA time zone"}},
            "required": ["zone"],
        },
    },
}
# Without the system turn Qwen2.5-Coder-0.5B, given the tool's answer, repeats its call.
system = {"role": "system", "content": "You are a helpful assistant. After a tool result, answer the user in one plain sentence."}
question = [system, {"role": "user", "content": "What is the weather like in Paris today?"}]
NAMES = {"get_weather", "get_time"}


def ask(messages, **kwargs):
    return client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=32, **kwargs)


# The model calls the tool on its own; the call is parsed into tool_calls.
r = ask(question, tools=[WEATHER, TIME])
choice = r.choices[0]
calls = choice.message.tool_calls
check(calls and len(calls) >= 1, f"a tool call: {choice.message}")
check(choice.finish_reason == "tool_calls", f"finish_reason tool_calls: {choice.finish_reason}")
call = calls[0]
check(call.type == "function" and call.id.startswith("call_"), f"call id and type: {call}")
check(call.function.name == "get_weather", f"the weather tool: {call.function.name}")
arguments = json.loads(call.function.arguments)
check("paris" in str(arguments.get("city", "")).lower(), f"arguments name the city: {arguments}")
check(not choice.message.content, f"no content beside the call: {choice.message.content!r}")


def streamed_calls(**kwargs):
    """The calls the client reassembles from delta.tool_calls, and the finish reason."""
    calls, finish, content = {}, None, ""
    for chunk in ask(question, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            if d.id:
                entry["id"] = d.id
            if d.function and d.function.name:
                entry["name"] += d.function.name
            if d.function and d.function.arguments:
                entry["arguments"] += d.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    check(all(calls[i]["id"].startswith("call_") for i in calls), "streamed call ids")
    return [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], finish, content


# Streamed, the client reassembles the same call from delta.tool_calls.
whole = [(c.function.name, c.function.arguments) for c in calls]
parts, finish, content = streamed_calls(tools=[WEATHER, TIME])
check(parts == whole and not content, f"streamed calls {parts} equal {whole}, no content {content!r}")
check(finish == "tool_calls", f"streamed finish_reason: {finish}")

# The round trip: the call and the tool's answer go back; the model answers in text
# (tool_choice none: this small model calls again while it may).
answer = ask(
    question
    + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 22, "sky": "sunny"})},
    ],
    tools=[WEATHER, TIME],
    tool_choice="none",
)
reply = answer.choices[0]
check(not reply.message.tool_calls and reply.message.content, f"an answer in text: {reply.message}")
check("22" in reply.message.content, f"the answer uses the tool's result: {reply.message.content!r}")
check(reply.finish_reason == "stop", f"the answer ends: {reply.finish_reason}")

# tool_choice names a function: one call of it, its arguments valid under its schema.
named = ask(question, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
named_calls = named.choices[0].message.tool_calls
check(named_calls and [c.function.name for c in named_calls] == ["get_time"], f"the named function: {named.choices[0].message}")
check(isinstance(json.loads(named_calls[0].function.arguments).get("zone"), str), "get_time's arguments")
check(named.choices[0].finish_reason == "tool_calls", f"named finish_reason: {named.choices[0].finish_reason}")
named_whole = [(c.function.name, c.function.arguments) for c in named_calls]
named_parts, finish, _ = streamed_calls(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
check(named_parts == named_whole and finish == "tool_calls", f"streamed {named_parts} equal {named_whole}")

# required: calls of the request's functions even for a greeting; none: text, no calls.
required = ask([{"role": "user", "content": "Hello!"}], tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
required_calls = required.choices[0].message.tool_calls
check(required_calls and len(required_calls) == 1, f"required makes one call: {required.choices[0].message}")
check(required_calls[0].function.name in NAMES, f"a function of the request: {required_calls[0].function.name}")
schema_keys = {"get_weather": "city", "get_time": "zone"}
check(schema_keys[required_calls[0].function.name] in json.loads(required_calls[0].function.arguments), "required arguments")
none = ask(question, tools=[WEATHER, TIME], tool_choice="none")
check(not none.choices[0].message.tool_calls and none.choices[0].message.content, "none answers in text")
single = ask(question, tools=[WEATHER, TIME], parallel_tool_calls=False)
check(len(single.choices[0].message.tool_calls or []) == 1, f"one call: {single.choices[0].message}")

# Chat logprobs in OpenAI's shape, as the client's types read them.
lp = client.chat.completions.create(
    model=model, messages=question, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3
)
content = lp.choices[0].logprobs.content
check(len(content) == lp.usage.completion_tokens, "one entry per token")
for entry in content:
    check(isinstance(entry.token, str) and entry.logprob <= 0, f"token and logprob: {entry}")
    check(bytes(entry.bytes).decode("utf-8", "replace") == entry.token, f"bytes: {entry}")
    check(len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob, "top 3")

print(f"openai tools: {checks} passed, 0 failed")
