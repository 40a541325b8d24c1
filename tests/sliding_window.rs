//! Sliding-window layers in the resident cache: `ContiguousKv::for_model` keeps each
//! windowed layer in a ring of its window plus one step (`RING_STEP_TOKENS`), and
//! `Model::forward` cuts a longer prompt into steps that fit it. Tokens and log-prob bits
//! equal the cache that keeps every position (`ContiguousKv::of`), in every KV element,
//! for windows of 1 token to past the prompt and prompts that wrap the ring many times;
//! the ring's memory is its rows, not the context; a rewind deeper than the ring keeps is
//! refused instead of attending overwritten rows.

mod common;

use common::{greedy, random_prompt, KV_DTYPES};
use rand::{rngs::StdRng, SeedableRng};
use strata::engine;
use strata::kv::{ContiguousKv, KvCache, RING_STEP_TOKENS};

fn bits(out: &engine::GenerationOutput) -> (Vec<u32>, Vec<u32>) {
    (out.token_ids.clone(), common::bits(&out.logprobs))
}

#[test]
fn rings_match_the_cache_that_keeps_every_position() {
    let mut rng = StdRng::seed_from_u64(8);
    for window in [1, 20, 300, 2000] {
        let model = common::tiny_gemma3(window);
        let c = &model.cfg;
        for len in [5, 300, 1100] {
            let prompt = random_prompt(&mut rng, len, c.vocab_size);
            let n = 30;
            let cap = len + n;
            for kv in KV_DTYPES {
                let want = bits(&common::generate_plain(
                    &model,
                    kv,
                    &prompt,
                    &greedy(n),
                    cap,
                ));
                strata::with_kv_elem!(kv, T => {
                    let mut ring = ContiguousKv::<T>::for_model(c, cap);
                    let rows = window - 1 + RING_STEP_TOKENS;
                    if rows < cap {
                        assert_eq!(ring.max_step_tokens(), RING_STEP_TOKENS);
                    }
                    let out = engine::generate_with(&model, &mut ring, cap, &prompt, &greedy(n), &mut |_| Ok(()))
                        .unwrap();
                    assert_eq!(bits(&out), want, "window {window} {kv} prompt {len}");
                    // Five windowed layers hold their ring, the full one the context.
                    let elem = std::mem::size_of::<T>();
                    let per_token = 2 * c.kv_dim() * elem;
                    let bound = (cap + 5 * rows.min(cap)) * per_token;
                    assert!(ring.bytes() <= bound, "{} > {bound}", ring.bytes());
                    if rows < cap {
                        // Less than keeping every position (6 layers × cap rows).
                        assert!(ring.bytes() < 6 * cap * per_token);
                    }
                });
            }
        }
    }
}

/// A rewind within the ring's step is fine; deeper, its window's rows are overwritten,
/// and the cache says so.
#[test]
fn a_rewind_past_the_ring_is_refused() {
    let model = common::tiny_gemma3(20);
    let c = &model.cfg;
    let mut kv = ContiguousKv::<f32>::for_model(c, 2000);
    let prompt: Vec<u32> = (0..1000).map(|i| 3 + i % 500).collect();
    model.forward(&prompt, 0, &mut kv).unwrap();
    kv.truncate(1000 - RING_STEP_TOKENS).unwrap();
    model
        .forward(
            &prompt[..RING_STEP_TOKENS],
            1000 - RING_STEP_TOKENS,
            &mut kv,
        )
        .unwrap();
    let err = kv
        .truncate(1000 - RING_STEP_TOKENS - 1)
        .unwrap_err()
        .to_string();
    assert!(err.contains("cannot rewind"), "{err}");
}
