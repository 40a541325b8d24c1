//! Log-probabilities (issue 61): the serving engine's prompt and sampled-token
//! log-probabilities against a teacher-forced reference (one forward over the whole
//! sequence, log softmax written out here); bitwise the same alone, in a batch of 16,
//! under preemption (offload and recomputation) and after a prefix-cache hit; and the
//! server's two response shapes, whole and streamed, against the same reference on the
//! default model in the f32 reference mode.

mod common;
mod live_server;

use std::sync::Arc;

use common::{scratch_dir, serve_config, serve_requests, TinySpec};
use live_server::Server;
use serde_json::{json, Value};
use strata::device::KvDtype;
use strata::engine::logprobs::TokenLogprob;
use strata::engine::SamplingParams;
use strata::kv::ContiguousKv;
use strata::model::Model;
use strata::serve::{Engine, NewLogprobs, RequestParams};

/// `log softmax(row / t)` in f64, written independently of the engine's.
fn log_softmax(row: &[f32], t: f64) -> Vec<f64> {
    let scaled: Vec<f64> = row.iter().map(|&x| x as f64 / t).collect();
    let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = scaled.iter().map(|x| (x - max).exp()).sum();
    scaled.iter().map(|x| x - max - z.ln()).collect()
}

/// Teacher forcing: the logits `[vocab]` of every position of `tokens`, one forward over
/// a contiguous f32 cache.
fn teacher_forced(model: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    let c = &model.cfg;
    let mut kv = ContiguousKv::new(c.num_layers, c.num_kv_heads, c.head_dim, tokens.len());
    model.forward_rows(tokens, 0, &mut kv).unwrap()
}

/// Checks `got` (scoring `tokens[from..]`) against the reference at temperature `t`:
/// each token's log-probability, and the top alternatives (ids in order, values).
fn check_against(
    rows: &[Vec<f32>],
    tokens: &[u32],
    from: usize,
    got: &[TokenLogprob],
    t: f64,
    tol: f64,
) {
    assert_eq!(got.len(), tokens.len() - from, "one entry per scored token");
    for (i, g) in got.iter().enumerate() {
        let pos = from + i;
        assert_eq!(g.token, tokens[pos], "position {pos}");
        let want = log_softmax(&rows[pos - 1], t);
        let d = (g.logprob as f64 - want[tokens[pos] as usize]).abs();
        assert!(
            d <= tol,
            "position {pos}: {} vs {} ",
            g.logprob,
            want[tokens[pos] as usize]
        );
        let mut order: Vec<usize> = (0..want.len()).collect();
        order.sort_by(|&a, &b| want[b].total_cmp(&want[a]).then(a.cmp(&b)));
        for (k, &(id, lp)) in g.top.iter().enumerate() {
            // A near-tie may swap places between two computations: compare the values.
            assert!(
                (lp as f64 - want[order[k]]).abs() <= tol,
                "position {pos}, alternative {k}: id {id} {lp} vs id {} {}",
                order[k],
                want[order[k]]
            );
            assert!((lp as f64 - want[id as usize]).abs() <= tol);
        }
    }
}

fn tiny_model(name: &str) -> Arc<Model> {
    let dir = scratch_dir(name);
    TinySpec::llama().write(&dir, 11);
    Model::load(&dir, false).unwrap().0
}

fn engine(model: &Arc<Model>, gpu_blocks: usize, cpu_blocks: usize) -> Engine {
    let cfg = serve_config(KvDtype::F32, gpu_blocks, cpu_blocks, false);
    Engine::new(Arc::clone(model), cfg).unwrap()
}

/// Runs the requests together: each one's output tokens and log-probabilities.
fn run(
    e: &mut Engine,
    prompts: &[Vec<u32>],
    params: &[RequestParams],
) -> Vec<(Vec<u32>, NewLogprobs)> {
    e.generate_recorded(prompts, params).unwrap()
}

fn with_logprobs(mut params: Vec<RequestParams>, temperature: f32) -> Vec<RequestParams> {
    for (i, p) in params.iter_mut().enumerate() {
        p.logprobs = Some(i % 4 + 1);
        p.prompt_logprobs = Some(i % 3);
        p.sampling = SamplingParams {
            temperature,
            seed: i as u64,
            ..Default::default()
        };
    }
    params
}

#[test]
fn engine_logprobs_equal_a_teacher_forced_reference() {
    let model = tiny_model("logprobs-reference");
    let (prompts, params) = serve_requests(3, 6, 0);
    for t in [0.0f32, 0.7] {
        let params = with_logprobs(params.clone(), t);
        let out = run(&mut engine(&model, 256, 0), &prompts, &params);
        let tt = if t == 0.0 { 1.0 } else { t as f64 };
        for ((p, r), (output, lp)) in prompts.iter().zip(&params).zip(&out) {
            let mut all = p.clone();
            all.extend(output);
            let rows = teacher_forced(&model, &all);
            let prompt = lp.prompt.as_ref().expect("prompt logprobs given");
            check_against(&rows, p, 1, prompt, tt, 1e-4);
            assert!(prompt
                .iter()
                .all(|e| e.top.len() == r.prompt_logprobs.unwrap()));
            check_against(&rows, &all, p.len(), &lp.sampled, tt, 1e-4);
            assert!(lp
                .sampled
                .iter()
                .all(|e| e.top.len() == r.logprobs.unwrap()));
        }
    }
}

#[test]
fn logprobs_are_bitwise_the_same_alone_batched_preempted_and_after_a_prefix_hit() {
    let model = tiny_model("logprobs-invariance");
    // 16 requests sharing a 24-token prefix (so later ones would hit the prefix cache).
    let (prompts, params) = serve_requests(5, 16, 24);
    for t in [0.0f32, 0.8] {
        let params = with_logprobs(params.clone(), t);
        let alone: Vec<_> = prompts
            .iter()
            .zip(&params)
            .map(|(p, r)| {
                let mut e = engine(&model, 256, 0);
                run(&mut e, std::slice::from_ref(p), std::slice::from_ref(r)).remove(0)
            })
            .collect();
        let batched = run(&mut engine(&model, 256, 0), &prompts, &params);
        assert_eq!(batched, alone, "T={t}: a batch of 16 against each alone");
        // A pool far below the working set: preemption to host memory, and (no host
        // blocks) by recomputation.
        for cpu in [256, 0] {
            let mut e = engine(&model, 40, cpu);
            let squeezed = run(&mut e, &prompts, &params);
            assert!(e.stats().sched.preemptions > 0, "no preemption happened");
            assert_eq!(squeezed, alone, "T={t}, host blocks {cpu}");
        }
        // The same requests again on a warm engine: their prompts are in the prefix
        // cache, which requests for prompt log-probabilities must not take.
        let mut e = engine(&model, 256, 0);
        run(&mut e, &prompts, &params);
        let hits = e.stats().sched.prefix_hit_blocks;
        let again = run(&mut e, &prompts, &params);
        assert_eq!(again, alone, "T={t}: on a warm prefix cache");
        assert_eq!(
            e.stats().sched.prefix_hit_blocks,
            hits,
            "took cached blocks"
        );
        // Without prompt log-probabilities the cache serves them (the check above bites).
        let plain: Vec<RequestParams> = params
            .iter()
            .map(|r| RequestParams {
                prompt_logprobs: None,
                ..r.clone()
            })
            .collect();
        run(&mut e, &prompts, &plain);
        assert!(
            e.stats().sched.prefix_hit_blocks > hits,
            "the cache never hit"
        );
    }
}

// ---- The server, on the default model in the f32 reference mode. ----

fn post(server: &Server, path: &str, body: Value) -> Value {
    let r = server.post_json(path, &body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// The streamed chunks' `data:` payloads (without `[DONE]`).
fn stream(server: &Server, path: &str, mut body: Value) -> Vec<Value> {
    body["stream"] = json!(true);
    let r = server.post_json(path, &body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.sse_data()
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// Token ids of `texts` under the model's tokenizer, each text one token.
fn ids_of(tok: &strata::model::Tokenizer, texts: &[Value]) -> Vec<u32> {
    texts
        .iter()
        .map(|t| {
            let t = t.as_str().unwrap();
            tok.token_to_id(&t.replace(' ', "Ġ").replace('\n', "Ċ"))
                .unwrap_or_else(|| panic!("no token {t:?}"))
        })
        .collect()
}

#[test]
fn server_logprobs_match_the_teacher_forced_reference_whole_and_streamed() {
    let path = common::require_default_model();
    let server = Server::start(&path, &["--dtype", "f32", "--kv-dtype", "f32"]);
    let (model, tok) = Model::load(&path, false).unwrap(); // stored: bitwise the f32 mode
    let m = server.model_name.clone();
    let prompt_text = "The quick brown fox jumps over the lazy dog. The capital of France is";
    let prompt = tok.encode(prompt_text, true).unwrap();

    // Completions, echo: the prompt scored from its second token, then 6 new tokens.
    let body = json!({
        "model": m, "prompt": prompt_text, "max_tokens": 6, "temperature": 0,
        "logprobs": 3, "echo": true, "return_token_ids": true,
    });
    let v = post(&server, "/v1/completions", body.clone());
    let choice = &v["choices"][0];
    let output: Vec<u32> = serde_json::from_value(choice["token_ids"].clone()).unwrap();
    let mut all = prompt.clone();
    all.extend(&output);
    let rows = teacher_forced(&model, &all);
    let lp = &choice["logprobs"];
    let lps = lp["token_logprobs"].as_array().unwrap();
    assert_eq!(lps.len(), all.len(), "{lp}");
    assert!(lps[0].is_null() && lp["top_logprobs"][0].is_null());
    assert_eq!(ids_of(&tok, lp["tokens"].as_array().unwrap()), all);
    let texts: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(
        texts.concat(),
        choice["text"].as_str().unwrap(),
        "tokens spell the text"
    );
    let mut offset = 0;
    for (i, t) in texts.iter().enumerate() {
        assert_eq!(lp["text_offset"][i], json!(offset));
        offset += t.chars().count();
    }
    for pos in 1..all.len() {
        let want = log_softmax(&rows[pos - 1], 1.0);
        let got = lps[pos].as_f64().unwrap();
        assert!(
            (got - want[all[pos] as usize]).abs() <= 1e-4,
            "position {pos}: {got}"
        );
        let top = lp["top_logprobs"][pos].as_object().unwrap();
        // The 3 most likely and the token itself: 3 or 4 entries, each its reference value.
        let mut order: Vec<usize> = (0..want.len()).collect();
        order.sort_by(|&a, &b| want[b].total_cmp(&want[a]));
        let mut expect: Vec<usize> = order[..3].to_vec();
        if !expect.contains(&(all[pos] as usize)) {
            expect.push(all[pos] as usize);
        }
        assert_eq!(top.len(), expect.len(), "position {pos}: {top:?}");
        for id in expect {
            let key = String::from_utf8_lossy(&tok.token_bytes(id as u32)).into_owned();
            let got = top[&key].as_f64().unwrap();
            assert!((got - want[id]).abs() <= 1e-4, "position {pos}, {key:?}");
        }
    }

    // The same request streamed: the chunks' lists joined are the whole response's.
    let chunks = stream(&server, "/v1/completions", body);
    let mut joined =
        json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
    for c in &chunks {
        let l = &c["choices"][0]["logprobs"];
        if l.is_null() {
            continue;
        }
        for k in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            let items = l[k].as_array().unwrap().clone();
            joined[k].as_array_mut().unwrap().extend(items);
        }
    }
    assert_eq!(&joined, lp, "streamed against whole");

    // The prompt alone (max_tokens 0), given as token ids: the same prompt scores.
    let v = post(
        &server,
        "/v1/completions",
        json!({"model": m, "prompt": prompt, "max_tokens": 0, "logprobs": 1, "echo": true}),
    );
    let c = &v["choices"][0];
    assert_eq!(
        c["logprobs"]["token_logprobs"].as_array().unwrap()[..],
        lps[..prompt.len()]
    );
    assert_eq!(v["usage"]["completion_tokens"], json!(0));

    // Chat: the sampled tokens' log-probabilities with 2 alternatives, at a temperature
    // (the distribution sampled from), whole and streamed.
    let chat = json!({
        "model": m, "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 8, "temperature": 0.7, "seed": 5, "logprobs": true, "top_logprobs": 2,
        "return_token_ids": true,
    });
    let v = post(&server, "/v1/chat/completions", chat.clone());
    let output: Vec<u32> = serde_json::from_value(v["choices"][0]["token_ids"].clone()).unwrap();
    let mut all: Vec<u32> = serde_json::from_value(v["prompt_token_ids"].clone()).unwrap();
    let from = all.len();
    all.extend(&output);
    let rows = teacher_forced(&model, &all);
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), output.len());
    for (i, e) in content.iter().enumerate() {
        let pos = from + i;
        let want = log_softmax(&rows[pos - 1], 0.7);
        let bytes: Vec<u8> = serde_json::from_value(e["bytes"].clone()).unwrap();
        assert_eq!(bytes, tok.token_bytes(all[pos]));
        let got = e["logprob"].as_f64().unwrap();
        assert!(
            (got - want[all[pos] as usize]).abs() <= 1e-4,
            "chat token {i}: {got}"
        );
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        let mut order: Vec<usize> = (0..want.len()).collect();
        order.sort_by(|&a, &b| want[b].total_cmp(&want[a]));
        for (k, alt) in top.iter().enumerate() {
            assert!((alt["logprob"].as_f64().unwrap() - want[order[k]]).abs() <= 1e-4);
        }
    }
    let streamed: Vec<Value> = stream(&server, "/v1/chat/completions", chat)
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&streamed, content, "streamed chat against whole");
}

#[test]
fn token_bytes_spell_every_text_byte_for_byte() {
    let path = common::require_default_model();
    let (_, tok) = Model::load(&path, false).unwrap();
    for text in [
        "plain ascii, with  spaces\nand lines",
        "café, naïve — “quotes” 😀🎉 日本語のテキスト",
        "<|im_start|>user\nhi<|im_end|>",
    ] {
        let ids = tok.encode(text, false).unwrap();
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| tok.token_bytes(id)).collect();
        assert_eq!(String::from_utf8(bytes).unwrap(), text);
    }
    assert!(tok.token_bytes(u32::MAX).is_empty());
}
