//! Token in, token out (what a framework in front of strata speaks, docs/server.md):
//! `/v1/completions` takes token ids as the prompt and gives the same greedy output as the
//! text they encode; `return_token_ids` returns the prompt's and the output's ids, whole
//! and streamed; ids outside the vocabulary and malformed prompts are 400s; `/v1/models`
//! reports the KV geometry; the model card's tokenizer.json encodes as strata does; and
//! the vLLM-named metrics count prefix-cache queries, hits and finished requests.

mod common;
mod live_server;

use live_server::Server;
use serde_json::{json, Value};

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list of ids: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn completion(server: &Server, prompt: Value, extra: Value) -> Value {
    let mut body = json!({"model": server.model_name, "prompt": prompt, "max_tokens": 12,
                          "temperature": 0});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let r = server.post_json("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

#[test]
fn token_id_prompts_and_return_token_ids_whole_and_streamed() {
    let server = Server::start(&common::require_default_model(), &[]);
    let text = "The capital of France is";
    let by_text = completion(&server, json!(text), json!({"return_token_ids": true}));
    let choice = &by_text["choices"][0];
    let prompt_ids = ids(&choice["prompt_token_ids"]);
    let out_ids = ids(&choice["token_ids"]);
    assert_eq!(
        prompt_ids.len() as u64,
        by_text["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    assert_eq!(
        out_ids.len() as u64,
        by_text["usage"]["completion_tokens"].as_u64().unwrap()
    );

    // The same ids as the prompt: the same greedy output, no BOS or anything added.
    let by_ids = completion(
        &server,
        json!(prompt_ids),
        json!({"return_token_ids": true}),
    );
    assert_eq!(by_ids["choices"][0]["text"], choice["text"]);
    assert_eq!(ids(&by_ids["choices"][0]["token_ids"]), out_ids);
    assert_eq!(ids(&by_ids["choices"][0]["prompt_token_ids"]), prompt_ids);
    // A list of one list of ids is one prompt too; without the flag, no ids come back.
    let nested = completion(&server, json!([prompt_ids]), json!({}));
    assert_eq!(nested["choices"][0]["text"], choice["text"]);
    assert!(nested["choices"][0].get("token_ids").is_none(), "{nested}");

    // Streamed: the first chunk carries the prompt's ids, every chunk its new output ids.
    let r = server.post_json(
        "/v1/completions",
        &json!({"model": server.model_name, "prompt": prompt_ids, "max_tokens": 12,
                "temperature": 0, "stream": true, "return_token_ids": true}),
    );
    assert_eq!(r.status, 200);
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let (mut streamed_ids, mut streamed_text) = (Vec::new(), String::new());
    for (i, c) in chunks.iter().enumerate() {
        let ch = &c["choices"][0];
        assert_eq!(
            ch.get("prompt_token_ids").is_some(),
            i == 0,
            "chunk {i}: {c}"
        );
        streamed_ids.extend(ids(&ch["token_ids"]));
        streamed_text.push_str(ch["text"].as_str().unwrap());
    }
    assert_eq!(
        ids(&chunks[0]["choices"][0]["prompt_token_ids"]),
        prompt_ids
    );
    assert_eq!(streamed_ids, out_ids);
    assert_eq!(streamed_text, choice["text"].as_str().unwrap());
    assert!(!chunks.last().unwrap()["choices"][0]["finish_reason"].is_null());

    // Chat puts the prompt's ids at the top level, as vLLM does.
    let r = server.post_json(
        "/v1/chat/completions",
        &json!({"model": server.model_name, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "Hi"}], "return_token_ids": true}),
    );
    let chat = r.json();
    assert!(!ids(&chat["prompt_token_ids"]).is_empty(), "{chat}");
    assert_eq!(
        ids(&chat["choices"][0]["token_ids"]).len() as u64,
        chat["usage"]["completion_tokens"].as_u64().unwrap()
    );
}

#[test]
fn bad_token_id_prompts_are_400s_naming_the_prompt() {
    let server = Server::start(&common::require_default_model(), &[]);
    let vocab = 49152; // SmolLM2
    for (prompt, says) in [
        (json!([1, vocab]), "0..49152"),
        (json!([1, -3]), "0..49152"),
        (json!([1, 2.5]), "0..49152"),
        (json!([]), "empty"),
        (json!([[1, 2], [3]]), "only one prompt"),
        (json!(12), "must be a string"),
        (json!({"ids": [1]}), "must be a string"),
    ] {
        let r = server.post_json(
            "/v1/completions",
            &json!({"model": server.model_name, "prompt": prompt, "max_tokens": 2}),
        );
        let message = r.expect_error(400);
        assert!(message.contains(says), "{prompt}: {message}");
        assert_eq!(r.json()["error"]["param"], "prompt", "{prompt}");
    }
    // The server keeps serving.
    let ok = completion(&server, json!([1, 2, 3]), json!({}));
    assert!(ok["choices"][0]["text"].is_string());
}

#[test]
fn models_card_and_vllm_metrics_describe_the_server() {
    let server = Server::start(&common::require_default_model(), &[]);
    let m = server.get("/v1/models").json();
    let info = &m["data"][0];
    assert_eq!(info["max_model_len"], 1024);
    assert_eq!(info["kv_cache_block_size"], 16);
    assert_eq!(info["num_gpu_blocks"], 256);
    assert_eq!(info["max_num_seqs"], 16);
    assert_eq!(
        info["device"], "cpu",
        "what a framework registering it reports"
    );
    assert!(
        info["kv_events"].is_null(),
        "no --kv-events-endpoint: {info}"
    );

    // The model card's tokenizer.json, read by Hugging Face's own tokenizer library,
    // encodes text to the ids strata uses.
    let card = server.get("/v1/strata/model_card").json();
    let files = &card["files"];
    let hf: tokenizers::Tokenizer = files["tokenizer.json"].to_string().parse().unwrap();
    let text = "Hello world 12345, <|im_start|>user ünïcödé";
    let by_text = completion(&server, json!(text), json!({"return_token_ids": true}));
    let strata_ids = ids(&by_text["choices"][0]["prompt_token_ids"]);
    assert_eq!(hf.encode(text, true).unwrap().get_ids(), &strata_ids[..]);
    assert!(files["tokenizer_config.json"]["chat_template"].is_string());
    assert_eq!(files["tokenizer_config.json"]["eos_token"], "<|im_end|>");
    assert_eq!(files["config.json"]["max_position_embeddings"], 1024);
    assert_eq!(files["config.json"]["eos_token_id"], json!([2]));

    // A 130-token prompt sent twice: the second hits its 8 full blocks (128 tokens) and
    // computes the last 2 positions in one step.
    let prompt: Vec<u32> = (100..100 + 130).collect();
    completion(&server, json!(prompt), json!({"max_tokens": 1}));
    let before = server.metrics();
    completion(&server, json!(prompt), json!({"max_tokens": 1}));
    let after = server.metrics();
    let delta = |name: &str| after[&server.vllm(name)] - before[&server.vllm(name)];
    assert_eq!(delta("vllm:prefix_cache_queries_total"), 130.0);
    assert_eq!(delta("vllm:prefix_cache_hits_total"), 128.0);
    assert_eq!(delta("vllm:prompt_tokens_total"), 130.0);
    let length = format!(
        "vllm:request_success_total{{model_name=\"{}\",engine=\"0\",finished_reason=\"length\"}}",
        server.model_name
    );
    assert_eq!(after[&length] - before[&length], 1.0);
    assert_eq!(
        after[&server.vllm("vllm:e2e_request_latency_seconds_count")]
            - before[&server.vllm("vllm:e2e_request_latency_seconds_count")],
        1.0
    );
    // vLLM's per-request histograms: one more sample each, the request's own counts.
    for phase in ["queue", "prefill", "decode", "inference"] {
        let name = format!("vllm:request_{phase}_time_seconds_count");
        assert_eq!(delta(&name), 1.0, "{name}");
    }
    assert_eq!(delta("vllm:request_prompt_tokens_sum"), 130.0);
    assert_eq!(delta("vllm:request_generation_tokens_sum"), 1.0);
    assert_eq!(delta("vllm:request_params_max_tokens_sum"), 1.0);
    assert_eq!(delta("vllm:iteration_tokens_total_count"), 1.0);
    assert_eq!(delta("vllm:iteration_tokens_total_sum"), 2.0);
    let info = after
        .keys()
        .find(|k| k.starts_with("vllm:cache_config_info{"))
        .expect("vllm:cache_config_info");
    assert!(
        info.contains("block_size=\"16\"") && info.contains("num_gpu_blocks=\"256\""),
        "{info}"
    );
    assert_eq!(after[info], 1.0);
}
