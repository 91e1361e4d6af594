//! The OpenAI request's fields over HTTP, on a tiny random model: a -100
//! `logit_bias` bans tokens and +100 forces one; the penalties choose the
//! token OpenAI's formula chooses; a seed repeats its samples; `best_of`
//! keeps the samples with the highest summed logprob; `echo` puts the
//! prompt (and its tokens' logprobs) first; a `stop` list cuts at the
//! first of its strings; `/tokenize` and
//! `/detokenize` agree with generation; chat logprobs' `bytes` join into
//! the content. Tokens are told apart by id with vLLM's
//! `return_tokens_as_token_ids`.

mod serving_support;

use std::collections::HashMap;

use serde_json::{json, Value};

use serving_support::{assert_drains, completion, events, http, ok, post, start, KEY, MODEL};

/// The tiny model's end-of-text token.
const EOS: u32 = 256;

fn token_id(name: &Value) -> u32 {
    name.as_str()
        .and_then(|n| n.strip_prefix("token_id:"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not a token_id name: {name}"))
}

/// The token ids of a completion choice's logprobs.
fn ids(choice: &Value) -> Vec<u32> {
    (choice["logprobs"]["tokens"].as_array().unwrap().iter())
        .map(token_id)
        .collect()
}

fn logprob_sum(choice: &Value) -> f64 {
    (choice["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap()
        .iter())
    .map(|v| v.as_f64().unwrap())
    .sum()
}

#[test]
fn logit_bias_bans_and_forces_tokens() {
    let t = start(128, 64);
    let addr = t.server.addr;
    let base = ok(
        addr,
        "/v1/completions",
        completion(json!("hello"), json!({})),
    );
    let base_ids = ids(&base["choices"][0]);
    assert!(!base_ids.is_empty());

    // +100 forces a token at every step, greedy or sampled.
    for temperature in [0.0, 1.0] {
        let forced = ok(
            addr,
            "/v1/completions",
            completion(
                json!("hello"),
                json!({"logit_bias": {"65": 100}, "temperature": temperature}),
            ),
        );
        assert_eq!(ids(&forced["choices"][0]), vec![65; 8], "{forced}");
        assert_eq!(forced["choices"][0]["text"], "AAAAAAAA");
    }

    // -100 on every token greedy chose: none of them comes back.
    let ban: serde_json::Map<String, Value> = (base_ids.iter())
        .map(|id| (id.to_string(), json!(-100)))
        .collect();
    let banned = ok(
        addr,
        "/v1/completions",
        completion(json!("hello"), json!({"logit_bias": ban})),
    );
    let banned_ids = ids(&banned["choices"][0]);
    assert!(
        banned_ids.iter().all(|id| !base_ids.contains(id)),
        "{base_ids:?} banned, got {banned_ids:?}"
    );

    // Chat takes it too, and its logprobs name the tokens the same way.
    let chat = ok(
        addr,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
               "max_tokens": 3, "temperature": 0, "logit_bias": {"66": 100},
               "logprobs": true, "top_logprobs": 2, "return_tokens_as_token_ids": true}),
    );
    let content = chat["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    let chosen: Vec<u32> = content.iter().map(|c| token_id(&c["token"])).collect();
    assert_eq!(chosen, vec![66; 3], "{chat}");
    assert_eq!(chat["choices"][0]["message"]["content"], "BBB");
    assert!(content
        .iter()
        .all(|c| c["top_logprobs"].as_array().unwrap().len() == 2));
    assert_drains(addr);
}

#[test]
fn chat_logprobs_bytes_join_into_the_content() {
    let t = start(128, 64);
    let addr = t.server.addr;
    // The random model writes bytes of multi-byte characters one token at
    // a time; its control tokens (256-258), which content leaves out, are banned.
    let chat = ok(
        addr,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
               "max_tokens": 24, "temperature": 0, "logprobs": true,
               "logit_bias": {"256": -100, "257": -100, "258": -100}}),
    );
    let entries = chat["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    let bytes: Vec<u8> = (entries.iter())
        .flat_map(|e| e["bytes"].as_array().unwrap().clone())
        .map(|b| b.as_u64().unwrap() as u8)
        .collect();
    let content = chat["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(String::from_utf8_lossy(&bytes), content, "{chat}");
    assert!(
        content.chars().any(|c| c.len_utf8() > 1 && c != '\u{FFFD}'),
        "a character made of several tokens: {content:?}"
    );
    assert_drains(addr);
}

#[test]
fn penalties_choose_the_token_openais_formula_chooses() {
    let t = start(128, 64);
    let addr = t.server.addr;
    let (frequency, presence) = (1.5, 0.5);
    let body = completion(
        json!("the the the"),
        json!({"max_tokens": 24, "logprobs": 20, "frequency_penalty": frequency,
               "presence_penalty": presence, "logit_bias": {EOS.to_string(): -100}}),
    );
    let penalized = ok(addr, "/v1/completions", body);
    let choice = &penalized["choices"][0];
    let chosen = ids(choice);
    assert_eq!(chosen.len(), 24);
    // The reported logprobs are the model's own: the choice must be the
    // argmax of logprob - frequency * count - presence * (count > 0) over
    // the tokens generated before it.
    let mut counts: HashMap<u32, f64> = HashMap::new();
    for (i, &token) in chosen.iter().enumerate() {
        let score = |id: u32, logprob: f64| {
            let n = counts.get(&id).copied().unwrap_or(0.0);
            logprob - frequency * n - if n > 0.0 { presence } else { 0.0 }
        };
        let own = score(
            token,
            choice["logprobs"]["token_logprobs"][i].as_f64().unwrap(),
        );
        for (name, logprob) in choice["logprobs"]["top_logprobs"][i].as_object().unwrap() {
            let other = score(token_id(&json!(name)), logprob.as_f64().unwrap());
            assert!(
                own >= other - 1e-4,
                "step {i}: {token} ({own}) over {name} ({other})"
            );
        }
        *counts.entry(token).or_default() += 1.0;
    }
    // Without them, greedy repeats itself on this model: the penalties changed the output.
    let plain = ok(
        addr,
        "/v1/completions",
        completion(
            json!("the the the"),
            json!({"max_tokens": 24, "logit_bias": {EOS.to_string(): -100}}),
        ),
    );
    let plain_ids = ids(&plain["choices"][0]);
    let distinct = |ids: &[u32]| ids.iter().collect::<std::collections::HashSet<_>>().len();
    assert!(
        distinct(&chosen) > distinct(&plain_ids),
        "{chosen:?} vs {plain_ids:?}"
    );
    assert_drains(addr);
}

#[test]
fn a_seed_repeats_its_samples() {
    let t = start(128, 64);
    let addr = t.server.addr;
    let chat = |seed: u64| {
        let v = ok(
            addr,
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}],
                   "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": seed,
                   "top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1}),
        );
        (v["choices"].as_array().unwrap().iter())
            .map(|c| c["message"]["content"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    let first = chat(7);
    assert_eq!(first.len(), 3);
    assert_eq!(first, chat(7), "the same seed gives the same samples");
    assert_ne!(first, chat(8), "another seed gives other samples");
    assert_drains(addr);
}

#[test]
fn best_of_keeps_the_samples_with_the_highest_logprob() {
    let t = start(128, 64);
    let addr = t.server.addr;
    let sampled = |n: u64, best_of: Option<u64>| {
        let mut extra = json!({"n": n, "temperature": 1.0, "seed": 11, "max_tokens": 6,
                               "logit_bias": {EOS.to_string(): -100}});
        if let Some(b) = best_of {
            extra["best_of"] = json!(b);
        }
        ok(addr, "/v1/completions", completion(json!("Once"), extra))
    };
    // Sample i draws from seed + i: the four samples best_of=4 chooses from.
    let all = sampled(4, None);
    let mut ranked: Vec<(f64, String)> = (all["choices"].as_array().unwrap().iter())
        .map(|c| (logprob_sum(c), c["text"].as_str().unwrap().to_string()))
        .collect();
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
    for n in [1, 2] {
        let best = sampled(n, Some(4));
        let choices = best["choices"].as_array().unwrap();
        assert_eq!(choices.len(), n as usize, "{best}");
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(c["index"], i);
            assert_eq!(c["text"], ranked[i].1, "{best}");
            assert!((logprob_sum(c) - ranked[i].0).abs() < 1e-4);
        }
        // Every sample generated is counted.
        assert_eq!(best["usage"]["completion_tokens"], 24);
    }
    assert_drains(addr);
}

#[test]
fn echo_puts_the_prompt_and_its_logprobs_first() {
    let t = start(128, 64);
    let addr = t.server.addr;
    let prompt = "hello world";
    let plain = ok(
        addr,
        "/v1/completions",
        completion(json!(prompt), json!({"max_tokens": 3})),
    );
    let echoed = ok(
        addr,
        "/v1/completions",
        completion(
            json!(prompt),
            json!({"max_tokens": 3, "echo": true, "logprobs": 2}),
        ),
    );
    let choice = &echoed["choices"][0];
    let generated = plain["choices"][0]["text"].as_str().unwrap();
    assert_eq!(choice["text"], format!("{prompt}{generated}"));
    let prompt_tokens = echoed["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    let logprobs = &choice["logprobs"];
    let tokens = logprobs["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), prompt_tokens + 3, "{echoed}");
    assert_eq!(logprobs["token_logprobs"][0], Value::Null);
    assert_eq!(logprobs["top_logprobs"][0], Value::Null);
    for i in 1..tokens.len() {
        assert!(logprobs["token_logprobs"][i].as_f64().unwrap() <= 0.0);
        assert_eq!(logprobs["top_logprobs"][i].as_object().unwrap().len(), 2);
    }
    // A prompt token's logprob is the one generation gave it after the same tokens.
    let mut extended = ids(choice)[..prompt_tokens].to_vec();
    let first_generated = ids(&plain["choices"][0])[0];
    extended.push(first_generated);
    let scored = ok(
        addr,
        "/v1/completions",
        completion(json!(extended), json!({"max_tokens": 1, "echo": true})),
    );
    let as_prompt = scored["choices"][0]["logprobs"]["token_logprobs"][prompt_tokens]
        .as_f64()
        .unwrap();
    let as_generated = plain["choices"][0]["logprobs"]["token_logprobs"][0]
        .as_f64()
        .unwrap();
    assert!(
        (as_prompt - as_generated).abs() < 1e-3,
        "{as_prompt} vs {as_generated}"
    );
    // Streamed: the prompt comes first, then the same text.
    let (status, body) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(KEY),
        completion(
            json!(prompt),
            json!({"max_tokens": 3, "echo": true, "stream": true}),
        )
        .to_string()
        .as_bytes(),
    );
    assert_eq!(status, 200);
    let events = events(&body);
    let text: String = (events.iter().filter(|e| *e != "[DONE]"))
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .map(|c| c["choices"][0]["text"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(text, choice["text"].as_str().unwrap());
    assert_drains(addr);
}

#[test]
fn a_stop_list_cuts_at_the_first_of_its_strings() {
    let t = start(128, 64);
    let addr = t.server.addr;
    let no_eos = json!({"max_tokens": 16, "logit_bias": {EOS.to_string(): -100}});
    let full = ok(
        addr,
        "/v1/completions",
        completion(json!("hello"), no_eos.clone()),
    );
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 8, "{text:?}");
    let late: String = chars[5..7].iter().collect();
    let early: String = chars[2..4].iter().collect();
    let mut body = completion(json!("hello"), no_eos);
    body["stop"] = json!([late, early, "\u{1}never", "\u{2}never"]);
    let cut = ok(addr, "/v1/completions", body.clone());
    let at = text.find(&late).unwrap().min(text.find(&early).unwrap());
    assert_eq!(cut["choices"][0]["text"], text[..at], "{cut}");
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    body["stop"] = json!(["a", "b", "c", "d", "e"]);
    let (status, err) = post(addr, "/v1/completions", &body);
    assert_eq!(
        (status, &err["error"]["param"]),
        (400, &json!("stop")),
        "{err}"
    );
    assert_drains(addr);
}

#[test]
fn tokenize_and_detokenize_agree_with_generation() {
    let t = start(128, 64);
    let addr = t.server.addr;
    let tokens = ok(
        addr,
        "/tokenize",
        json!({"model": MODEL, "prompt": "hello world"}),
    );
    assert_eq!(tokens["count"], tokens["tokens"].as_array().unwrap().len());
    assert!(tokens["max_model_len"].as_u64().unwrap() > 0);
    let generated = ok(
        addr,
        "/v1/completions",
        completion(json!("hello world"), json!({"max_tokens": 1})),
    );
    assert_eq!(generated["usage"]["prompt_tokens"], tokens["count"]);
    let text = ok(addr, "/detokenize", json!({"tokens": tokens["tokens"]}));
    assert_eq!(text["prompt"], "hello world");

    let messages =
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]);
    let chat_tokens = ok(addr, "/tokenize", json!({"messages": messages}));
    let chat = ok(
        addr,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": messages, "max_tokens": 1}),
    );
    assert_eq!(chat["usage"]["prompt_tokens"], chat_tokens["count"]);
    let without_turn = ok(
        addr,
        "/tokenize",
        json!({"messages": messages, "add_generation_prompt": false}),
    );
    assert!(without_turn["count"].as_u64() < chat_tokens["count"].as_u64());

    for (path, body, param) in [
        (
            "/tokenize",
            json!({"prompt": "x", "foo": 1}),
            Value::from("foo"),
        ),
        (
            "/tokenize",
            json!({"prompt": "x", "messages": messages}),
            Value::Null,
        ),
        (
            "/detokenize",
            json!({"tokens": [1, 100000]}),
            Value::from("tokens"),
        ),
        (
            "/detokenize",
            json!({"tokens": "1 2"}),
            Value::from("tokens"),
        ),
    ] {
        let (status, err) = post(addr, path, &body);
        assert_eq!(
            (status, &err["error"]["param"]),
            (400, &param),
            "{body}: {err}"
        );
    }
    let (status, _) = post(addr, "/tokenize", &json!({"model": "other", "prompt": "x"}));
    assert_eq!(status, 404);
    // Behind the API key like /v1/*.
    let (status, _) = http(addr, "POST", "/tokenize", None, br#"{"prompt": "x"}"#);
    assert_eq!(status, 401);
    let (status, _) = http(
        addr,
        "POST",
        "/detokenize",
        Some("wrong"),
        br#"{"tokens": [1]}"#,
    );
    assert_eq!(status, 401);
}
