"""Structured output through the official `openai` client against `tandem serve`.

Usage: python structured_client.py BASE_URL MODEL API_KEY MAX_TOKENS [quick]
Every JSON output is validated with the `jsonschema` package; `quick` runs
one greedy and one sampled request per schema and the streamed one only.
Exits non-zero (an AssertionError or an API error) on the first failed check.
"""

import json
import re
import sys

import jsonschema
import openai

base_url, model, api_key, max_tokens = sys.argv[1:5]
max_tokens = int(max_tokens)
quick = sys.argv[5:] == ["quick"]
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
checks = 0


def check(condition, what):
    global checks
    assert condition, what
    checks += 1


SCHEMAS = {
    # Nested objects, an array of objects, integer and number bounds.
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "customer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "vip": {"type": "boolean"},
                },
                "required": ["name", "vip"],
                "additionalProperties": False,
            },
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 12},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 10},
                        "price": {"type": "number", "minimum": 0, "maximum": 1000},
                    },
                    "required": ["sku", "quantity", "price"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["order_id", "customer", "items"],
        "additionalProperties": False,
    },
    # Enums, a bounded number, a boolean.
    "review": {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "flagged": {"type": "boolean"},
            "topics": {
                "type": "array",
                "items": {"enum": ["price", "quality", "delivery", "service"]},
                "maxItems": 4,
            },
        },
        "required": ["sentiment", "confidence", "flagged", "topics"],
        "additionalProperties": False,
    },
    # Definitions referenced with $ref (as pydantic writes them), a negative range.
    "weather": {
        "$defs": {
            "reading": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "celsius": {"type": "integer", "minimum": -40, "maximum": 50},
                },
                "required": ["city", "celsius"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "readings": {"type": "array", "items": {"$ref": "#/$defs/reading"}, "maxItems": 2},
            "unit": {"const": "C"},
        },
        "required": ["readings", "unit"],
        "additionalProperties": False,
    },
}

PROMPTS = {
    "order": "Write a JSON order for two books bought by Ada.",
    "review": "Classify this review as JSON: 'Fast delivery, but the price was too high.'",
    "weather": "Give the weather in Paris and Oslo as JSON.",
}


def chat(messages, **kwargs):
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, **kwargs
    )


def schema_format(name):
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
    }


def valid(text, schema):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


# Every schema, greedy and sampled: the output parses and validates.
for name, schema in SCHEMAS.items():
    messages = [{"role": "user", "content": PROMPTS[name]}]
    settings = [dict(temperature=0), dict(temperature=0.9, seed=7)]
    if not quick:
        settings.append(dict(temperature=1.2, top_p=0.95, seed=11, n=2))
    for sampling in settings:
        r = chat(messages, response_format=schema_format(name), **sampling)
        for c in r.choices:
            check(c.finish_reason == "stop", f"{name} {sampling}: finish {c.finish_reason}")
            valid(c.message.content, schema)
            check(True, f"{name} {sampling} validates")

# json_object: always a JSON object (its strings are unbounded: only with a
# real model, which ends them).
for sampling in [] if quick else [dict(temperature=0), dict(temperature=1.0, seed=3)]:
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "A JSON object with a cat's name and age."}],
        response_format={"type": "json_object"},
        max_tokens=1000,
        **sampling,
    )
    c = r.choices[0]
    check(c.finish_reason == "stop", f"json_object {sampling}: finish {c.finish_reason}")
    check(isinstance(json.loads(c.message.content), dict), "json_object parses")

# Streaming: the deltas reassemble into a valid document.
stream = chat(
    [{"role": "user", "content": PROMPTS["review"]}],
    response_format=schema_format("review"),
    temperature=0.7,
    seed=5,
    stream=True,
)
text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
valid(text, SCHEMAS["review"])
check(True, "streamed output validates")

if not quick:
    # vLLM's extensions through extra_body: regex on completions, a choice on chat.
    r = client.completions.create(
        model=model,
        prompt="Call me at",
        max_tokens=20,
        temperature=0.8,
        seed=2,
        extra_body={"guided_regex": r" \(\d{3}\) \d{3}-\d{4}"},
    )
    check(re.fullmatch(r" \(\d{3}\) \d{3}-\d{4}", r.choices[0].text), "guided_regex matches")
    r = chat(
        [{"role": "user", "content": "Is the sky blue?"}],
        temperature=1.0,
        seed=4,
        extra_body={"guided_choice": ["yes", "no", "it depends"]},
    )
    check(r.choices[0].message.content in ("yes", "no", "it depends"), "guided_choice")

    # A JSON document cut by max_tokens: finish_reason "length", as vLLM reports it.
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPTS["order"]}],
        response_format=schema_format("order"),
        max_tokens=5,
        temperature=0,
    )
    c = r.choices[0]
    check(c.finish_reason == "length", "a cut document ends with length")
    try:
        json.loads(c.message.content)
        check(False, "five tokens cannot hold the order")
    except json.JSONDecodeError:
        check(True, "the cut document does not parse")

    # Bad schemas and grammars: a 400 naming the field and the problem.
    bad = [
        (
            dict(response_format={"type": "json_schema", "json_schema": {
                "name": "r", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}),
            "response_format",
        ),
        (dict(response_format={"type": "xml"}), "response_format.type"),
        (dict(extra_body={"guided_regex": "[a-"}), "guided_regex"),
        (dict(extra_body={"guided_grammar": "start: missing_rule"}), "guided_grammar"),
        (
            dict(response_format={"type": "json_object"}, extra_body={"guided_choice": ["a"]}),
            "guided_choice",
        ),
    ]
    for kwargs, param in bad:
        try:
            chat([{"role": "user", "content": "hi"}], **kwargs)
            check(False, f"{param}: accepted")
        except openai.BadRequestError as e:
            check(e.status_code == 400 and param in str(e), f"{param}: {e}")

print(f"{checks} checks passed")
