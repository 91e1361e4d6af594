//! Every OpenAI request field the server does not support gets a 400 that
//! names it, and the server goes on serving the next request: a client
//! learns what to drop instead of getting silently different output. The
//! fields it does support are in `serving_openai_fields.rs`.

mod serving_support;

use serde_json::{json, Value};

use serving_support::{assert_drains, completion, ok, post, start, MODEL};

#[test]
fn every_unsupported_field_gets_a_400_naming_it_and_the_server_keeps_serving() {
    let t = start(128, 64);
    let addr = t.server.addr;
    let user = json!([{"role": "user", "content": "hi"}]);
    let chat = |extra: Value| {
        let mut body = json!({"model": MODEL, "messages": user, "max_tokens": 2});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let cases: Vec<(&str, Value, &str, &str)> = vec![
        (
            "/v1/completions",
            completion(json!("x"), json!({"foo": 1})),
            "foo",
            "unsupported parameter: 'foo'",
        ),
        (
            "/v1/completions",
            completion(json!("x"), json!({"suffix": "tail"})),
            "suffix",
            "fill-in-the-middle",
        ),
        (
            "/v1/completions",
            completion(json!("x"), json!({"messages": user})),
            "messages",
            "unsupported parameter",
        ),
        (
            "/v1/completions",
            completion(json!("x"), json!({"min_tokens": 2})),
            "min_tokens",
            "unsupported parameter",
        ),
        (
            "/v1/completions",
            completion(json!("x"), json!({"n": 3, "best_of": 2})),
            "best_of",
            "at least n",
        ),
        (
            "/v1/completions",
            completion(json!("x"), json!({"best_of": 2, "stream": true})),
            "best_of",
            "stream",
        ),
        (
            "/v1/completions",
            completion(
                json!("x"),
                json!({"stream_options": {"include_usage": true}}),
            ),
            "stream_options",
            "only allowed with 'stream'",
        ),
        (
            "/v1/completions",
            completion(
                json!("x"),
                json!({"stream": true, "stream_options": {"continuous_usage_stats": true}}),
            ),
            "stream_options",
            "continuous_usage_stats",
        ),
        (
            "/v1/completions",
            completion(json!("x"), json!({"logit_bias": {"99999": 1}})),
            "logit_bias",
            "'99999'",
        ),
        (
            "/v1/completions",
            completion(json!("x"), json!({"logit_bias": {"5": 101}})),
            "logit_bias",
            "-100 to 100",
        ),
        (
            "/v1/completions",
            completion(json!("x"), json!({"logit_bias": [5]})),
            "logit_bias",
            "an object",
        ),
        (
            "/v1/completions",
            completion(json!("x"), json!({"frequency_penalty": 3})),
            "frequency_penalty",
            "-2 to 2",
        ),
        (
            "/v1/completions",
            completion(json!("x"), json!({"repetition_penalty": 0})),
            "repetition_penalty",
            "greater than 0",
        ),
        (
            "/v1/completions",
            completion(json!("x"), json!({"top_k": -2})),
            "top_k",
            "'top_k'",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"echo": true})),
            "echo",
            "unsupported parameter: 'echo'",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"best_of": 2})),
            "best_of",
            "unsupported parameter",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"functions": []})),
            "functions",
            "unsupported parameter",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"audio": {"voice": "x"}})),
            "audio",
            "unsupported parameter",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"store": true})),
            "store",
            "does not store",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"service_tier": "flex"})),
            "service_tier",
            "'flex'",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"modalities": ["text", "audio"]})),
            "modalities",
            "text only",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"tool_choice": "required"})),
            "tool_choice",
            "'tools' is empty",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"tools": [{"type": "retrieval"}]})),
            "tools[0]",
            "only functions",
        ),
    ];
    for (path, body, param, message) in cases {
        let (status, err) = post(addr, path, &body);
        assert_eq!(status, 400, "{body}: {err}");
        assert_eq!(err["error"]["param"], param, "{body}: {err}");
        let text = err["error"]["message"].as_str().unwrap();
        assert!(text.contains(message), "{body}: {text}");
    }
    // What the official client sends for metadata is accepted.
    ok(
        addr,
        "/v1/chat/completions",
        chat(
            json!({"user": "u-1", "store": false, "service_tier": "auto", "metadata": {"k": "v"},
                    "modalities": ["text"], "parallel_tool_calls": true, "tool_choice": "none",
                    "prompt_cache_key": "k", "safety_identifier": "s",
                    "stream": true, "stream_options": {"include_usage": true}}),
        ),
    );
    ok(
        addr,
        "/v1/completions",
        completion(
            json!("x"),
            json!({"user": "u-1", "suffix": "", "priority": 3}),
        ),
    );
    assert_drains(addr);
}
