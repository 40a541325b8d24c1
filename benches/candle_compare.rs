//! strata vs candle-transformers' `llama` on the same f32 SmolLM2-135M weights, side by
//! side in one run with the same thread count: prefill tokens/s at 1,024 and 4,096
//! prompt tokens, decode tokens/s at 1,024 and 4,096 context, and the ratios.
//!
//! `cargo bench --bench candle_compare` (model: models/fetch.sh). Each figure is the best
//! of `REPEATS` runs, strata and candle interleaved, so a noisy neighbour hurts both alike.
//! candle prefills in chunks of 512 (its best setting); strata prefills the whole prompt.

use std::collections::HashMap;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama;
use rand::{rngs::StdRng, Rng, SeedableRng};
use strata::kv::ContiguousKv;
use strata::model::Model;

const REPEATS: usize = 2;
const DECODE_STEPS: usize = 32;
const CANDLE_CHUNK: usize = 512;

/// candle tensors with HF names, split back out of strata's fused matrices.
fn candle_weights(m: &Model) -> HashMap<String, Tensor> {
    let c = &m.cfg;
    let (h, q, kv, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let dev = Device::Cpu;
    let t = |data: &[f32], shape: &[usize]| Tensor::from_slice(data, shape, &dev).unwrap();
    let mut w = HashMap::new();
    w.insert(
        "model.embed_tokens.weight".into(),
        t(&m.weights.embed.to_f32(), &[c.vocab_size, h]),
    );
    w.insert("model.norm.weight".into(), t(&m.weights.final_norm, &[h]));
    for (i, l) in m.weights.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let (gate_up, down) = l.mlp.dense().expect("candle's llama has no experts");
        let (wqkv, w_gate_up) = (l.wqkv.to_f32(), gate_up.to_f32());
        w.insert(
            format!("{p}.self_attn.q_proj.weight"),
            t(&wqkv[..q * h], &[q, h]),
        );
        w.insert(
            format!("{p}.self_attn.k_proj.weight"),
            t(&wqkv[q * h..(q + kv) * h], &[kv, h]),
        );
        w.insert(
            format!("{p}.self_attn.v_proj.weight"),
            t(&wqkv[(q + kv) * h..], &[kv, h]),
        );
        w.insert(
            format!("{p}.self_attn.o_proj.weight"),
            t(&l.wo.to_f32(), &[h, q]),
        );
        w.insert(format!("{p}.input_layernorm.weight"), t(&l.attn_norm, &[h]));
        w.insert(
            format!("{p}.post_attention_layernorm.weight"),
            t(&l.mlp_norm, &[h]),
        );
        w.insert(
            format!("{p}.mlp.gate_proj.weight"),
            t(&w_gate_up[..inter * h], &[inter, h]),
        );
        w.insert(
            format!("{p}.mlp.up_proj.weight"),
            t(&w_gate_up[inter * h..], &[inter, h]),
        );
        w.insert(
            format!("{p}.mlp.down_proj.weight"),
            t(&down.to_f32(), &[h, inter]),
        );
    }
    w
}

struct Timing {
    prefill_tps: f64,
    decode_tps: f64,
}

fn run_strata(m: &std::sync::Arc<Model>, prompt: &[u32]) -> Timing {
    let c = &m.cfg;
    let mut kv = ContiguousKv::new(
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        prompt.len() + DECODE_STEPS + 1,
    );
    let t0 = Instant::now();
    let mut logits = m.forward(prompt, 0, &mut kv).unwrap();
    let prefill = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for i in 0..DECODE_STEPS {
        let next = strata::engine::sampler::argmax(&logits);
        logits = m.forward(&[next], prompt.len() + i, &mut kv).unwrap();
    }
    let decode = t1.elapsed().as_secs_f64();
    Timing {
        prefill_tps: prompt.len() as f64 / prefill,
        decode_tps: DECODE_STEPS as f64 / decode,
    }
}

fn run_candle(model: &llama::Llama, cfg: &llama::Config, prompt: &[u32]) -> Timing {
    let dev = Device::Cpu;
    let mut cache = llama::Cache::new(true, DType::F32, cfg, &dev).unwrap();
    let t0 = Instant::now();
    let mut logits = None;
    for (i, chunk) in prompt.chunks(CANDLE_CHUNK).enumerate() {
        let x = Tensor::new(chunk, &dev).unwrap().unsqueeze(0).unwrap();
        logits = Some(model.forward(&x, i * CANDLE_CHUNK, &mut cache).unwrap());
    }
    let prefill = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for i in 0..DECODE_STEPS {
        let l: Vec<f32> = logits
            .take()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let next = strata::engine::sampler::argmax(&l);
        let x = Tensor::new(&[next], &dev).unwrap().unsqueeze(0).unwrap();
        logits = Some(model.forward(&x, prompt.len() + i, &mut cache).unwrap());
    }
    let decode = t1.elapsed().as_secs_f64();
    Timing {
        prefill_tps: prompt.len() as f64 / prefill,
        decode_tps: DECODE_STEPS as f64 / decode,
    }
}

fn main() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        eprintln!("{} is missing: run models/fetch.sh", path.display());
        std::process::exit(1);
    }
    // The f32 reference mode: both runtimes read the same f32 weights.
    let (model, _) =
        Model::load_as(&path, false, strata::model::weights::WeightDtype::F32).unwrap();
    let c = &model.cfg;
    let cfg = llama::Config {
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        vocab_size: c.vocab_size,
        num_hidden_layers: c.num_layers,
        num_attention_heads: c.num_heads,
        num_key_value_heads: c.num_kv_heads,
        use_flash_attn: false,
        rms_norm_eps: c.rms_norm_eps as f64,
        rope_theta: c.rope_theta,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: c.max_position_embeddings,
        tie_word_embeddings: true,
    };
    let vb = VarBuilder::from_tensors(candle_weights(&model), DType::F32, &Device::Cpu);
    let reference = llama::Llama::load(vb, &cfg).unwrap();

    println!(
        "threads: {} (rayon; candle and strata share the pool size)",
        rayon::current_num_threads()
    );
    println!(
        "{:<28} {:>12} {:>12} {:>8} {:>8}",
        "", "strata", "candle", "ratio", "goal"
    );
    let mut rng = StdRng::seed_from_u64(0);
    for len in [1024usize, 4096] {
        let prompt: Vec<u32> = (0..len)
            .map(|_| rng.random_range(100..c.vocab_size as u32))
            .collect();
        let (mut s, mut k) = (
            Timing {
                prefill_tps: 0.0,
                decode_tps: 0.0,
            },
            Timing {
                prefill_tps: 0.0,
                decode_tps: 0.0,
            },
        );
        for _ in 0..REPEATS {
            let a = run_strata(&model, &prompt);
            let b = run_candle(&reference, &cfg, &prompt);
            s.prefill_tps = s.prefill_tps.max(a.prefill_tps);
            s.decode_tps = s.decode_tps.max(a.decode_tps);
            k.prefill_tps = k.prefill_tps.max(b.prefill_tps);
            k.decode_tps = k.decode_tps.max(b.decode_tps);
        }
        let decode_goal = if len == 1024 { 1.0 } else { 1.3 };
        for (what, a, b, goal) in [
            (
                format!("prefill tok/s @ {len}"),
                s.prefill_tps,
                k.prefill_tps,
                1.5,
            ),
            (
                format!("decode tok/s @ {len} ctx"),
                s.decode_tps,
                k.decode_tps,
                decode_goal,
            ),
        ] {
            let ratio = a / b;
            let mark = if ratio >= goal { "met" } else { "MISSED" };
            println!("{what:<28} {a:>12.1} {b:>12.1} {ratio:>7.2}x {goal:>5.1}x {mark}");
        }
    }
}
