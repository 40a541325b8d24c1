//! Log-probabilities in OpenAI's two shapes: the completions endpoint's legacy object
//! (parallel lists `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and the chat
//! endpoint's list of entries (`{token, logprob, bytes, top_logprobs}`).

use serde_json::{json, Map, Value};

use crate::engine::logprobs::TokenLogprob;
use crate::model::Tokenizer;

/// What JSON cannot carry (a token the distribution rules out, at a tiny temperature)
/// is reported as vLLM reports it.
const NEG_INF_LOGPROB: f32 = -9999.0;

fn finite(lp: f32) -> f32 {
    if lp.is_finite() {
        lp
    } else {
        NEG_INF_LOGPROB
    }
}

/// One token of a response with its log-probability: `None` for a prompt's first token,
/// which nothing predicts.
pub type Scored<'a> = (u32, Option<&'a TokenLogprob>);

/// A token's text: its bytes, a piece of a character shown as U+FFFD.
fn text(tok: &Tokenizer, id: u32) -> String {
    String::from_utf8_lossy(&tok.token_bytes(id)).into_owned()
}

/// The completions object for `tokens`, whose text starts `offset` characters into the
/// choice's text; also the offset just past them (where the next chunk's tokens start).
/// `top_logprobs` holds the most likely tokens and the token itself (OpenAI: up to
/// `logprobs + 1` entries).
pub fn completion(tok: &Tokenizer, tokens: &[Scored], mut offset: usize) -> (Value, usize) {
    let (mut texts, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for &(id, scored) in tokens {
        let t = text(tok, id);
        offsets.push(offset);
        offset += t.chars().count();
        texts.push(t);
        match scored {
            None => {
                lps.push(Value::Null);
                tops.push(Value::Null);
            }
            Some(s) => {
                lps.push(json!(finite(s.logprob)));
                let mut top = Map::new();
                for &(alt, lp) in s.top.iter().chain([(s.token, s.logprob)].iter()) {
                    top.entry(text(tok, alt)).or_insert(json!(finite(lp)));
                }
                tops.push(Value::Object(top));
            }
        }
    }
    let v = json!({
        "tokens": texts,
        "token_logprobs": lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    });
    (v, offset)
}

/// The chat object for the output tokens' log-probabilities.
pub fn chat(tok: &Tokenizer, tokens: &[&TokenLogprob]) -> Value {
    let entry = |id: u32, lp: f32| {
        let bytes = tok.token_bytes(id);
        json!({
            "token": String::from_utf8_lossy(&bytes),
            "logprob": finite(lp),
            "bytes": bytes,
        })
    };
    let content: Vec<Value> = tokens
        .iter()
        .map(|s| {
            let mut e = entry(s.token, s.logprob);
            e["top_logprobs"] = s.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}
