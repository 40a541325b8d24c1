//! Weights in their stored precision vs the f32 reference mode, side by side in one run
//! (`cargo bench --bench weights`): SmolLM2-135M as its Q4_1 GGUF (stored, and widened to
//! f32) and as a bf16 safetensors copy written from it; 2 threads. Each configuration runs
//! in its own child process so its peak RSS (`VmHWM`) is its own. Then the CUDA path's host
//! side for a Qwen3-4B-shaped random bf16 checkpoint: the per-tensor bf16 conversion runs
//! into a sink (no GPU needed) and the host's peak RSS is compared with the file's size.
//!
//! Environment: `STRATA_BENCH_CTX` = "1024,4096" (decode contexts), `STRATA_BENCH_STEPS` = 16
//! (decode steps at each; tokens/s is one over the median step), `STRATA_BENCH_QWEN_LAYERS` = 36 (fewer to fit a small disk; 0 skips that run).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};
use strata::device::bf16::f32_to_bf16;
use strata::device::cpu::ops::ActivationMode;
use strata::kv::ContiguousKv;
use strata::model::random::Shape;
use strata::model::weights::{self, GgufFile, Weight, WeightDtype};
use strata::model::{Model, ModelConfig};

const CHILD: &str = "STRATA_BENCH_WEIGHTS_CHILD";
const PREFILL_CHUNK: usize = 512;

fn main() {
    // As `strata` does at start (peak RSS is what this bench reports).
    strata::engine::return_large_buffers_to_the_system();
    // As `strata generate` runs: this thread is one of the two compute threads.
    rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .use_current_thread()
        .build_global()
        .unwrap();
    if let Ok(job) = std::env::var(CHILD) {
        let out = match job.as_str() {
            "cuda-host" => cuda_host(&qwen_dir()),
            "decode-interleaved" => decode_interleaved(),
            "decode-interleaved-kv" => decode_interleaved_kv(),
            mode => run_mode(mode),
        };
        println!("{out}");
        return;
    }
    let gguf = gguf_path();
    let st = bf16_dir();
    if !st.join("model.safetensors").exists() {
        eprintln!("writing the bf16 safetensors copy to {}", st.display());
        write_bf16_copy(&gguf, &st);
    }
    let mut rows = Vec::new();
    for mode in ["gguf-f32", "gguf-stored", "bf16-stored"] {
        eprintln!("running {mode}");
        rows.push((mode, child(mode)));
    }
    report(&rows, &gguf, &st);
    eprintln!("running decode-interleaved");
    let d = child("decode-interleaved");
    println!();
    println!(
        "decode interleaved in one process, f32 and stored steps alternating ({} steps each at {} context, median step): f32 {:.1} tok/s, stored {:.1} tok/s = {:.2}×",
        d["steps"],
        d["context"],
        d["f32_tps"].as_f64().unwrap(),
        d["stored_tps"].as_f64().unwrap(),
        d["stored_tps"].as_f64().unwrap() / d["f32_tps"].as_f64().unwrap()
    );
    println!(
        "q8 mode in the same steps: {:.1} tok/s = {:.2}× stored; its rows as stored (not repacked): {:.1} tok/s",
        d["q8_tps"].as_f64().unwrap(),
        d["q8_tps"].as_f64().unwrap() / d["stored_tps"].as_f64().unwrap(),
        d["q8_unpacked_tps"].as_f64().unwrap(),
    );
    if qwen_shape().layers == 0 {
        return; // the CUDA host-side run skipped
    }
    let q = qwen_dir();
    if !q.join("model.safetensors").exists() {
        eprintln!(
            "writing the random Qwen3-4B-shaped bf16 checkpoint to {}",
            q.display()
        );
        write_qwen_random(&q);
    }
    eprintln!("running cuda-host");
    let c = child("cuda-host");
    let file = c["file_bytes"].as_f64().unwrap();
    let peak = c["peak_rss_bytes"].as_f64().unwrap();
    println!();
    println!(
        "CUDA host side, Qwen3-4B shape ({} layers), bf16 safetensors {:.0} MiB: load + per-tensor bf16 conversion {:.1} s, peak host RSS {:.0} MiB = {:.2}× the file (goal ≤ 1.2×)",
        c["layers"],
        file / MIB,
        c["secs"].as_f64().unwrap(),
        peak / MIB,
        peak / file
    );
}

const MIB: f64 = 1024.0 * 1024.0;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn gguf_path() -> PathBuf {
    root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn bf16_dir() -> PathBuf {
    root().join("target/bench-weights/smollm2-bf16")
}

fn qwen_dir() -> PathBuf {
    root().join("target/bench-weights/qwen3-4b-bf16")
}

fn env_or(key: &str, default: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| default.to_string())
}

fn child(job: &str) -> Value {
    let out = Command::new(std::env::current_exe().unwrap())
        .env(CHILD, job)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{job} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    serde_json::from_str(text.lines().last().unwrap()).unwrap()
}

fn peak_rss() -> f64 {
    strata::engine::peak_rss_bytes().unwrap() as f64
}

/// The model's config, read from the GGUF (the bf16 copy has the same).
fn gguf_config() -> ModelConfig {
    let g = GgufFile::open(&gguf_path()).unwrap();
    ModelConfig::from_gguf(&g.content.metadata).unwrap()
}

/// Loads one configuration, prefills the first context, decodes, extends to the next
/// context, decodes again; reports tokens/s, weight bytes and peak RSS.
fn run_mode(mode: &str) -> Value {
    let t0 = Instant::now();
    let model: Arc<Model> = match mode {
        "gguf-f32" => {
            Model::load_as(&gguf_path(), false, WeightDtype::F32)
                .unwrap()
                .0
        }
        "gguf-stored" => Model::load(&gguf_path(), false).unwrap().0,
        "bf16-stored" => {
            let mut cfg = gguf_config();
            let w = weights::load_safetensors(&bf16_dir(), &mut cfg, false).unwrap();
            Arc::new(Model::new(cfg, w))
        }
        other => panic!("unknown mode {other}"),
    };
    let load_s = t0.elapsed().as_secs_f64();
    let c = &model.cfg;
    let ctxs: Vec<usize> = env_or("STRATA_BENCH_CTX", "1024,4096")
        .split(',')
        .map(|x| x.parse().unwrap())
        .collect();
    let steps: usize = env_or("STRATA_BENCH_STEPS", "16").parse().unwrap();
    let last = *ctxs.last().unwrap();
    let cap = last + steps * ctxs.len();
    let mut kv = ContiguousKv::new(c.num_layers, c.num_kv_heads, c.head_dim, cap);
    let kv_bytes = 2 * c.num_layers * c.kv_dim() * cap * 4;
    // Fixed pseudo-random token ids, the same in every configuration.
    let toks: Vec<u32> = (0..cap)
        .map(|i| 100 + (i as u64 * 2_654_435_761 % (c.vocab_size as u64 - 100)) as u32)
        .collect();
    let (mut pos, mut fed) = (0, 0);
    let mut res = json!({ "mode": mode, "load_s": load_s, "kv_bytes": kv_bytes });
    for (i, &ctx) in ctxs.iter().enumerate() {
        // Prefill in chunks of PREFILL_CHUNK (as `strata serve` does), so activations stay
        // bounded and peak RSS is the weights + KV + a fixed overhead.
        let t = Instant::now();
        let n = ctx - pos;
        let mut logits = Vec::new();
        for chunk in toks[fed..fed + n].chunks(PREFILL_CHUNK) {
            logits = model.forward(chunk, pos, &mut kv).unwrap();
            pos += chunk.len();
        }
        let prefill = n as f64 / t.elapsed().as_secs_f64();
        fed += n;
        let mut greedy = Vec::new();
        let mut step_s = Vec::new();
        for _ in 0..steps {
            let next = argmax(&logits);
            greedy.push(next);
            let t = Instant::now();
            logits = model.forward(&[next], pos, &mut kv).unwrap();
            step_s.push(t.elapsed().as_secs_f64());
            pos += 1;
        }
        // The median step: on a shared machine a few steps descheduled for a while would
        // otherwise decide the mean.
        step_s.sort_by(f64::total_cmp);
        let decode = 1.0 / step_s[step_s.len() / 2];
        res[format!("prefill_tps_{i}")] = json!(prefill);
        res[format!("decode_tps_{ctx}")] = json!(decode);
        res[format!("greedy_{ctx}")] = json!(greedy);
    }
    res["matvec_ms"] = matvec_ms(&model);
    res["weights_bytes"] = json!(model.weight_bytes());
    res["weights_resident_bytes"] = json!(model.weights.resident_bytes());
    res["peak_rss_bytes"] = json!(peak_rss());
    res
}

/// Where a decode step's matrix time goes: one m = 1 `linear` per matrix kind over every
/// layer (as a decode step reads them), and the lm_head; best of 5 passes, in ms.
fn matvec_ms(model: &Model) -> Value {
    let w = &model.weights;
    let kinds: [(&str, Vec<&Weight>); 5] = [
        ("qkv", w.layers.iter().map(|l| &l.wqkv).collect()),
        ("o", w.layers.iter().map(|l| &l.wo).collect()),
        ("gate_up", w.layers.iter().map(|l| dense(l).0).collect()),
        ("down", w.layers.iter().map(|l| dense(l).1).collect()),
        ("lm_head", vec![w.lm_head()]),
    ];
    let mut res = json!({});
    for (name, mats) in kinds {
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t = Instant::now();
            for m in &mats {
                let s = m.shape();
                let x: Vec<f32> = (0..s.in_features).map(|i| (i % 7) as f32 - 3.0).collect();
                let mut out = vec![0.0f32; s.out_features];
                strata::device::cpu::ops::linear_weight(&x, *m, None, &mut out, 1);
            }
            best = best.min(t.elapsed().as_secs_f64() * 1e3);
        }
        res[name] = json!(best);
    }
    res
}

/// The decode ratio with the machine's load shared fairly: the Q4_1 GGUF stored, widened
/// to f32, in the q8 mode (8-bit activations, integer dots on the rows repacked at load)
/// and in the q8 mode on the rows as stored (the kernels before the repack) in one process,
/// all prefilled to the first context, then decode steps alternating between them (the
/// same tokens: the stored mode's greedy choice); tokens/s from each one's median step.
fn decode_interleaved() -> Value {
    let (ctx, steps) = interleaved_shape();
    let models = [
        Model::load_as(&gguf_path(), false, WeightDtype::F32)
            .unwrap()
            .0,
        Model::load(&gguf_path(), false).unwrap().0,
        Model::load_as(&gguf_path(), false, WeightDtype::Q8)
            .unwrap()
            .0,
        q8_unpacked(),
    ];
    let c = &models[0].cfg;
    let toks: Vec<u32> = (0..ctx).map(|i| 100 + (i as u32 * 7919) % 40000).collect();
    let mut state: Vec<(ContiguousKv, Vec<f32>)> = models
        .iter()
        .map(|m| {
            let mut kv = ContiguousKv::new(c.num_layers, c.num_kv_heads, c.head_dim, ctx + steps);
            let mut logits = Vec::new();
            for (i, chunk) in toks.chunks(PREFILL_CHUNK).enumerate() {
                logits = m.forward(chunk, i * PREFILL_CHUNK, &mut kv).unwrap();
            }
            (kv, logits)
        })
        .collect();
    let mut step_s = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    for s in 0..steps {
        let next = argmax(&state[1].1);
        for (i, m) in models.iter().enumerate() {
            let (kv, logits) = &mut state[i];
            let t = Instant::now();
            *logits = m.forward(&[next], ctx + s, kv).unwrap();
            step_s[i].push(t.elapsed().as_secs_f64());
        }
        assert_eq!(state[0].1, state[1].1, "stored and f32 logits differ");
        assert_eq!(
            state[2].1, state[3].1,
            "repacked and unpacked q8 logits differ"
        );
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    json!({
        "context": ctx,
        "steps": steps,
        "f32_tps": 1.0 / median(&mut step_s[0]),
        "stored_tps": 1.0 / median(&mut step_s[1]),
        "q8_tps": 1.0 / median(&mut step_s[2]),
        "q8_unpacked_tps": 1.0 / median(&mut step_s[3]),
    })
}

/// The KV element's decode cost with the machine's load shared fairly (issue 33): the
/// stored Q4_1 GGUF with its KV in f32, bf16 and f16, in one process, each prefilled to
/// `STRATA_BENCH_CTX`, then decode steps alternating between them on the same tokens (the
/// f32 cache's greedy choice); tokens/s from each one's median step, and its range.
/// (`STRATA_BENCH_WEIGHTS_CHILD=decode-interleaved-kv cargo bench --bench weights`.)
fn decode_interleaved_kv() -> Value {
    use strata::device::{KvDtype, KvElem};
    /// One cache being decoded: its forward step.
    type Step = Box<dyn FnMut(u32, usize) -> Vec<f32>>;
    fn cache<T: KvElem>(m: Arc<Model>, toks: &[u32], cap: usize) -> (Step, Vec<f32>) {
        let c = &m.cfg;
        let mut kv = ContiguousKv::<T>::of(c.num_layers, c.num_kv_heads, c.head_dim, cap);
        let mut logits = Vec::new();
        for (i, chunk) in toks.chunks(PREFILL_CHUNK).enumerate() {
            logits = m.forward(chunk, i * PREFILL_CHUNK, &mut kv).unwrap();
        }
        let step = move |t: u32, pos: usize| m.forward(&[t], pos, &mut kv).unwrap();
        (Box::new(step), logits)
    }
    let (ctx, steps) = interleaved_shape();
    let model = Model::load(&gguf_path(), false).unwrap().0;
    let toks: Vec<u32> = (0..ctx).map(|i| 100 + (i as u32 * 7919) % 40000).collect();
    let dtypes = [KvDtype::F32, KvDtype::Bf16, KvDtype::F16];
    let mut state: Vec<(Step, Vec<f32>)> = dtypes
        .iter()
        .map(|&d| strata::with_kv_elem!(d, T => cache::<T>(model.clone(), &toks, ctx + steps)))
        .collect();
    let mut step_s = vec![Vec::new(); dtypes.len()];
    for s in 0..steps {
        let next = argmax(&state[0].1);
        // Rotate who goes first, so no element always runs after the same one.
        for k in 0..dtypes.len() {
            let i = (s + k) % dtypes.len();
            let (step, logits) = &mut state[i];
            let t = Instant::now();
            *logits = step(next, ctx + s);
            step_s[i].push(t.elapsed().as_secs_f64());
        }
    }
    let mut out = json!({ "context": ctx, "steps": steps });
    for (d, v) in dtypes.iter().zip(&mut step_s) {
        v.sort_by(f64::total_cmp);
        out[format!("{d}_tps")] = json!(1.0 / v[v.len() / 2]);
        out[format!("{d}_tps_range")] = json!([1.0 / v[v.len() - 1], 1.0 / v[0]]);
    }
    out
}

/// The interleaved modes' context (the first of `STRATA_BENCH_CTX`) and decode steps.
fn interleaved_shape() -> (usize, usize) {
    let ctx = env_or("STRATA_BENCH_CTX", "1024");
    let ctx = ctx.split(',').next().unwrap().parse().unwrap();
    (ctx, env_or("STRATA_BENCH_STEPS", "16").parse().unwrap())
}

/// The q8 mode without the repack: its integer kernels read the rows as stored.
fn q8_unpacked() -> Arc<Model> {
    let mut g = GgufFile::open(&gguf_path()).unwrap();
    let mut cfg = ModelConfig::from_gguf(&g.content.metadata).unwrap();
    let mut w = weights::load_gguf(&mut g, &mut cfg, false, WeightDtype::Q8).unwrap();
    w.set_activations(ActivationMode::Q8);
    Arc::new(Model::new(cfg, w))
}

fn argmax(x: &[f32]) -> u32 {
    (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b }) as u32
}

fn report(rows: &[(&str, Value)], gguf: &Path, st: &Path) {
    let size = |p: &Path| std::fs::metadata(p).unwrap().len() as f64;
    let files = [size(gguf), size(gguf), size(&st.join("model.safetensors"))];
    let ctxs: Vec<String> = env_or("STRATA_BENCH_CTX", "1024,4096")
        .split(',')
        .map(String::from)
        .collect();
    let f32_row = &rows[0].1;
    let ratio = |v: &Value, key: &str| v[key].as_f64().unwrap() / f32_row[key].as_f64().unwrap();
    // Prefill of each context from the previous one (the first from 0).
    let spans: Vec<String> = ctxs
        .iter()
        .enumerate()
        .map(|(i, c)| match i {
            0 => format!("@{c}"),
            _ => format!("{}→{c}", ctxs[i - 1]),
        })
        .collect();
    println!(
        "| configuration | weights held MiB | file MiB | peak RSS MiB | goal: file + KV + 120 | {} | {} | greedy = f32 |",
        spans
            .iter()
            .map(|s| format!("prefill tok/s {s} (vs f32)"))
            .collect::<Vec<_>>()
            .join(" | "),
        ctxs.iter()
            .map(|c| format!("decode tok/s @{c} (vs f32)"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!(
        "| --- | ---: | ---: | ---: | ---: |{} --- |",
        " ---: |".repeat(2 * ctxs.len())
    );
    for ((mode, v), file) in rows.iter().zip(files) {
        let kv = v["kv_bytes"].as_f64().unwrap();
        let cell = |k: &str| format!("{:.1} ({:.2}×)", v[k].as_f64().unwrap(), ratio(v, k));
        let prefill: Vec<String> = (0..ctxs.len())
            .map(|i| cell(&format!("prefill_tps_{i}")))
            .collect();
        let decode: Vec<String> = ctxs
            .iter()
            .map(|c| cell(&format!("decode_tps_{c}")))
            .collect();
        let same = ctxs
            .iter()
            .all(|c| v[format!("greedy_{c}")] == f32_row[format!("greedy_{c}")]);
        println!(
            "| {mode} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} | {} |",
            v["weights_bytes"].as_f64().unwrap() / MIB,
            file / MIB,
            v["peak_rss_bytes"].as_f64().unwrap() / MIB,
            (file + kv) / MIB + 120.0,
            prefill.join(" | "),
            decode.join(" | "),
            if same { "yes" } else { "NO" }
        );
    }
    println!();
    let kinds = ["qkv", "o", "gate_up", "down", "lm_head"];
    println!(
        "decode matrix time, ms per token (m = 1, every layer): | configuration | {} | total |",
        kinds.join(" | ")
    );
    for (mode, v) in rows {
        let ms: Vec<f64> = kinds
            .iter()
            .map(|k| v["matvec_ms"][k].as_f64().unwrap())
            .collect();
        let cells: Vec<String> = ms.iter().map(|x| format!("{x:.2}")).collect();
        println!(
            "| {mode} | {} | {:.2} |",
            cells.join(" | "),
            ms.iter().sum::<f64>()
        );
    }
    std::io::stdout().flush().unwrap();
}

// ---------------------------------------------------------------------------------------
// checkpoint writers

/// A safetensors file written tensor by tensor (the data is never all in memory): `tensors`
/// are (name, shape, a function producing its bf16 bits).
type Gen<'a> = Box<dyn Fn() -> Vec<u16> + 'a>;

fn write_safetensors_bf16(path: &Path, tensors: Vec<(String, Vec<usize>, Gen<'_>)>) {
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    for (name, shape, _) in &tensors {
        let n = 2 * shape.iter().product::<usize>();
        header.insert(
            name.clone(),
            json!({ "dtype": "BF16", "shape": shape, "data_offsets": [off, off + n] }),
        );
        off += n;
    }
    let mut h = serde_json::to_vec(&Value::Object(header)).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let tmp = path.with_extension("tmp");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp).unwrap());
    f.write_all(&(h.len() as u64).to_le_bytes()).unwrap();
    f.write_all(&h).unwrap();
    for (_, _, gen) in &tensors {
        let bits = gen();
        let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        f.write_all(&bytes).unwrap();
    }
    f.into_inner().unwrap().sync_all().unwrap();
    std::fs::rename(tmp, path).unwrap();
}

/// The GGUF's values (widened exactly by the f32 mode), rounded to bf16, under HF names.
fn write_bf16_copy(gguf: &Path, dir: &Path) {
    let m = Model::load_as(gguf, false, WeightDtype::F32).unwrap().0;
    let c = &m.cfg;
    let (h, q, kv, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let b = |v: &[f32]| v.iter().map(|&x| f32_to_bf16(x)).collect::<Vec<u16>>();
    let w = &m.weights;
    let mut t: Vec<(String, Vec<usize>, Gen)> = vec![
        (
            "model.embed_tokens.weight".into(),
            vec![c.vocab_size, h],
            Box::new(move || b(&w.embed.to_f32())),
        ),
        (
            "model.norm.weight".into(),
            vec![h],
            Box::new(move || b(&w.final_norm)),
        ),
    ];
    if let Some(head) = &w.lm_head {
        t.push((
            "lm_head.weight".into(),
            vec![c.vocab_size, h],
            Box::new(move || b(&head.to_f32())),
        ));
    }
    // Rows `r` of a matrix, as bf16.
    fn rows(m: &Weight, r: std::ops::Range<usize>) -> Gen<'_> {
        let k = m.shape().in_features;
        Box::new(move || {
            m.to_f32()[r.start * k..r.end * k]
                .iter()
                .map(|&x| f32_to_bf16(x))
                .collect()
        })
    }
    for (i, l) in w.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        for (name, shape, g) in [
            ("self_attn.q_proj", vec![q, h], rows(&l.wqkv, 0..q)),
            ("self_attn.k_proj", vec![kv, h], rows(&l.wqkv, q..q + kv)),
            (
                "self_attn.v_proj",
                vec![kv, h],
                rows(&l.wqkv, q + kv..q + 2 * kv),
            ),
            ("self_attn.o_proj", vec![h, q], rows(&l.wo, 0..h)),
            ("mlp.gate_proj", vec![inter, h], rows(dense(l).0, 0..inter)),
            (
                "mlp.up_proj",
                vec![inter, h],
                rows(dense(l).0, inter..2 * inter),
            ),
            ("mlp.down_proj", vec![h, inter], rows(dense(l).1, 0..h)),
            (
                "input_layernorm",
                vec![h],
                Box::new(move || b(&l.attn_norm)),
            ),
            (
                "post_attention_layernorm",
                vec![h],
                Box::new(move || b(&l.mlp_norm)),
            ),
        ] {
            t.push((format!("{p}.{name}.weight"), shape, g));
        }
    }
    write_safetensors_bf16(&dir.join("model.safetensors"), t);
}

fn qwen_shape() -> Shape {
    let layers = env_or("STRATA_BENCH_QWEN_LAYERS", "36").parse().unwrap();
    Shape {
        layers,
        ..Shape::qwen3_4b()
    }
}

/// Random bf16 values (a cheap hash), Qwen3-4B's tensor names and shapes.
fn write_qwen_random(dir: &Path) {
    let c = qwen_shape().config();
    let (h, q, kv, inter, hd) = (
        c.hidden_size,
        c.q_dim(),
        c.kv_dim(),
        c.intermediate_size,
        c.head_dim,
    );
    let gen = |seed: u64, n: usize, center: f32, scale: f32| -> Gen {
        Box::new(move || {
            (0..n)
                .map(|i| {
                    let u = splitmix(seed << 40 ^ i as u64);
                    let r = (u >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                    f32_to_bf16(center + scale * r)
                })
                .collect()
        })
    };
    let mut t: Vec<(String, Vec<usize>, Gen)> = vec![
        (
            "model.embed_tokens.weight".into(),
            vec![c.vocab_size, h],
            gen(1, c.vocab_size * h, 0.0, 0.1),
        ),
        ("model.norm.weight".into(), vec![h], gen(2, h, 1.0, 0.1)),
    ];
    let mut seed = 3;
    for i in 0..c.num_layers {
        let p = format!("model.layers.{i}");
        for (name, shape, center, scale) in [
            ("self_attn.q_proj.weight", vec![q, h], 0.0, 0.02),
            ("self_attn.k_proj.weight", vec![kv, h], 0.0, 0.02),
            ("self_attn.v_proj.weight", vec![kv, h], 0.0, 0.02),
            ("self_attn.o_proj.weight", vec![h, q], 0.0, 0.02),
            ("self_attn.q_norm.weight", vec![hd], 1.0, 0.1),
            ("self_attn.k_norm.weight", vec![hd], 1.0, 0.1),
            ("mlp.gate_proj.weight", vec![inter, h], 0.0, 0.02),
            ("mlp.up_proj.weight", vec![inter, h], 0.0, 0.02),
            ("mlp.down_proj.weight", vec![h, inter], 0.0, 0.01),
            ("input_layernorm.weight", vec![h], 1.0, 0.1),
            ("post_attention_layernorm.weight", vec![h], 1.0, 0.1),
        ] {
            let n = shape.iter().product();
            t.push((format!("{p}.{name}"), shape, gen(seed, n, center, scale)));
            seed += 1;
        }
    }
    write_safetensors_bf16(&dir.join("model.safetensors"), t);
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The CUDA path's host side: load as stored, convert each tensor to bf16 into a sink.
fn cuda_host(dir: &Path) -> Value {
    let t0 = Instant::now();
    let mut cfg = qwen_shape().config();
    let w = weights::load_safetensors(dir, &mut cfg, false).unwrap();
    let model = Model::new(cfg, w);
    let mut converted = 0usize;
    strata::model::cuda::weights::convert_each(
        &model,
        strata::model::cuda::weights::ExpertPlace::Resident,
        |bits| {
            converted += 2 * bits.len();
            // What an upload reads: touch every element so nothing is optimised away.
            Ok(bits.iter().fold(0u16, |a, &b| a ^ b))
        },
    )
    .unwrap();
    json!({
        "layers": model.cfg.num_layers,
        "file_bytes": std::fs::metadata(dir.join("model.safetensors")).unwrap().len(),
        "converted_bytes": converted,
        "secs": t0.elapsed().as_secs_f64(),
        "peak_rss_bytes": peak_rss(),
    })
}

/// A layer's dense MLP (the benchmarked models have no experts).
fn dense(l: &strata::model::weights::LayerWeights) -> (&Weight, &Weight) {
    l.mlp.dense().expect("a dense MLP")
}
