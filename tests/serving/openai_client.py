"""The official `openai` client against a running `tandem serve`.

Usage: python openai_client.py BASE_URL MODEL API_KEY
Exits non-zero (an AssertionError or an API error) on the first failed check.
"""

import sys

import openai

base_url, model, api_key = sys.argv[1:4]
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
checks = 0


def check(condition, what):
    global checks
    assert condition, what
    checks += 1


# Models.
check([m.id for m in client.models.list()] == [model], "/v1/models lists the model")

# Completions, greedy: usage adds up and the finish reason is consistent.
r = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=12, temperature=0)
c = r.choices[0]
check(r.object == "text_completion" and len(r.choices) == 1, "one completion choice")
check(r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0, "usage counts")
check(r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, "usage total")
check(c.finish_reason in ("stop", "length"), "finish reason")
check(c.finish_reason == "stop" or r.usage.completion_tokens == 12, "length means max_tokens tokens")
greedy_text = c.text

# Same request again: greedy is deterministic.
again = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=12, temperature=0)
check(again.choices[0].text == greedy_text, "greedy completions repeat")

# Streaming gives the same text, and usage in the last chunk when asked.
chunks = list(
    client.completions.create(
        model=model,
        prompt="The quick brown fox",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
)
streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
check(streamed == greedy_text, f"streamed text {streamed!r} equals {greedy_text!r}")
check(chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens, "usage chunk")

# A stop string ends the text before it.
if len(greedy_text) >= 6:
    stop = greedy_text[3:5]
    s = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=12, temperature=0, stop=[stop])
    check(s.choices[0].text == greedy_text[: greedy_text.find(stop)], "stop string cuts the text")
    check(s.choices[0].finish_reason == "stop", "stop string finish reason")

# n samples with a seed: n choices, reproducible.
def sampled():
    return client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, n=3, temperature=1.0, seed=42)


a, b = sampled(), sampled()
check(sorted(ch.index for ch in a.choices) == [0, 1, 2], "n=3 gives three choices")
check([ch.text for ch in a.choices] == [ch.text for ch in b.choices], "seeded samples repeat")

# Logprobs: the chosen token and two alternatives per position.
lp = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
info = lp.choices[0].logprobs
check(len(info.token_logprobs) == lp.usage.completion_tokens, "one logprob per token")
check(all(len(t) <= 2 for t in info.top_logprobs) and all(x <= 0 for x in info.token_logprobs), "top logprobs")

# Chat, plain and streamed.
messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
chat = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
check(chat.object == "chat.completion" and chat.choices[0].message.role == "assistant", "chat message")
check(chat.usage.completion_tokens <= 10, "chat usage")
stream = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0, stream=True)
parts = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
check("".join(parts) == chat.choices[0].message.content, "streamed chat equals chat")
chat_lp = client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
check(len(chat_lp.choices[0].logprobs.content) == chat_lp.usage.completion_tokens, "chat logprobs")
chat_n = client.chat.completions.create(model=model, messages=messages, max_tokens=4, n=2, temperature=0.7, seed=3)
check(len(chat_n.choices) == 2, "chat n=2")

# A batch of one token list (the client's own type for token prompts), and a developer turn.
ids = client.completions.create(model=model, prompt=[[9, 69, 28]], max_tokens=3, temperature=0)
check(ids.usage.prompt_tokens == 3 and len(ids.choices) == 1, "a batch of one token list")
dev = [{"role": "developer", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
check(client.chat.completions.create(model=model, messages=dev, max_tokens=10, temperature=0).choices[0].message.content
      == chat.choices[0].message.content, "developer is the system turn")

# Errors map to the client's exception classes.
def raises(kind, call):
    try:
        call()
    except kind as e:
        return e
    raise AssertionError(f"expected {kind.__name__}")


e = raises(openai.NotFoundError, lambda: client.completions.create(model="nope", prompt="x", max_tokens=2))
check("nope" in str(e), "unknown model is 404")
raises(openai.BadRequestError, lambda: client.completions.create(model=model, prompt="x", max_tokens=-1))
checks += 1
raises(openai.BadRequestError, lambda: client.completions.create(model=model, prompt="", max_tokens=2))
checks += 1
e = raises(openai.BadRequestError, lambda: client.completions.create(model=model, prompt="x", max_tokens=10**9))
check("context length" in str(e), "huge max_tokens is 400")
e = raises(openai.BadRequestError, lambda: client.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "x"}]))
check("messages[0].role" in str(e), "an unknown role is 400 naming the field")
e = raises(openai.BadRequestError, lambda: client.completions.create(model=model, prompt=["a", "b"], max_tokens=2))
check("2 prompts" in str(e), "a batch of two prompts is 400")
bad_key = openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0)
raises(openai.AuthenticationError, lambda: bad_key.completions.create(model=model, prompt="x", max_tokens=2))
checks += 1

# Still serving after the errors.
check(client.completions.create(model=model, prompt="ok", max_tokens=2).usage.completion_tokens >= 1, "still serving")
print(f"openai client: {checks} passed, 0 failed")
