//! Decoder-only transformer (Llama, Qwen2/3, Gemma 3, gpt-oss, Qwen3.5) with an explicit
//! layer loop over the KV seam.

pub mod config;
pub mod cuda;
pub mod delta_net;
pub mod files;
mod gguf_header;
pub mod mapped;
pub mod moe;
pub mod op_times;
pub mod random;
pub mod template;
pub mod tokenizer;
pub mod weights;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use crate::device::cpu::ops::{
    self, AttnHeads, AttnSeq, ContiguousRows, KvLayout, PagedRows, RingRows,
};
use crate::device::KvElem;
use crate::kv::{KvCache, LayerKv, LayerSlot, NewRow, Query};
pub use config::{Arch, LayerKind, MlpAct, ModelConfig};
use op_times::{timed, Op};
pub use tokenizer::Tokenizer;
use weights::{Mlp, ModelWeights, WeightDtype};

/// Rows of the MLP processed at once in prefill, so the `[rows, 2 * inter]` activation
/// stays bounded however long the prompt is.
const MLP_CHUNK: usize = 1024;

/// One sequence of a batched forward over a page pool.
#[derive(Clone, Copy, Debug)]
pub struct BatchSeq<'a> {
    pub tokens: &'a [u32],
    /// Absolute position of `tokens[0]`.
    pub pos0: usize,
    /// Page of each of its blocks, covering positions `0..pos0 + tokens.len()`.
    pub pages: &'a [u32],
    /// With a window pool (`PagePool::num_window_pages`), the sliding-window layers' page
    /// of each block (blocks before the call's window name the pool's null page, never
    /// read); empty without one: those layers use `pages`.
    pub window_pages: &'a [u32],
    /// Which of its rows' logits are wanted.
    pub logits: WantLogits,
    /// Its recurrent-state slot in the pool (`KvCache::layer_state`); ignored by a model
    /// without state layers.
    pub state_slot: usize,
}

/// Which rows of a sequence's call give logits: the forward answers `[rows, vocab]`,
/// row-major — none, its last token's (`[1, vocab]`: the next token's distribution), or
/// every token's in order (prompt log-probabilities: row `j` scores token `j + 1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WantLogits {
    Last,
    Every,
    No,
}

impl WantLogits {
    /// The call's rows (of `tokens` tokens) whose logits are wanted, as offsets.
    pub fn rows(self, tokens: usize) -> std::ops::Range<usize> {
        match self {
            WantLogits::No => 0..0,
            WantLogits::Last => tokens.saturating_sub(1)..tokens,
            WantLogits::Every => 0..tokens,
        }
    }
}

/// Every layer's K and V page pools, `[num_pages, block_size, kv_heads, head_dim]` each,
/// through the KV seam: `begin_layer` returns the whole pool of a layer, and each
/// sequence's block table says which pages are its. With a window pool the sliding-window
/// layers' pools are `[num_window_pages, ...]`, addressed by `BatchSeq::window_pages`.
pub trait PagePool<T = f32>: KvCache<T> {
    fn block_size(&self) -> usize;
    fn num_pages(&self) -> usize;
    /// Pages of the sliding-window layers' own pool (its null page included), if any.
    fn num_window_pages(&self) -> Option<usize> {
        None
    }
}

/// Errors unless every sequence of a batched forward has tokens inside the vocabulary and
/// pages (of the pool's block size, inside its pools) covering its positions.
pub fn check_batch<T>(
    cfg: &ModelConfig,
    seqs: &[BatchSeq<'_>],
    pool: &dyn PagePool<T>,
) -> Result<()> {
    if seqs.is_empty() {
        bail!("forward_batch called with no sequences");
    }
    let block_size = pool.block_size();
    let window = pool.num_window_pages();
    for (i, s) in seqs.iter().enumerate() {
        if s.tokens.is_empty() {
            bail!("sequence {i} of the batch has no tokens");
        }
        check_ids(cfg, s.tokens)?;
        let end = s.pos0 + s.tokens.len();
        let tables = [(s.pages, Some(pool.num_pages())), (s.window_pages, window)];
        for (table, num_pages) in tables {
            let Some(num_pages) = num_pages else {
                if !table.is_empty() {
                    bail!("sequence {i}: window pages for a pool without a window pool");
                }
                continue;
            };
            if table.len() * block_size < end {
                bail!(
                    "sequence {i}: {} pages of {block_size} do not cover {end} positions",
                    table.len()
                );
            }
            if let Some(&p) = table.iter().find(|&&p| p as usize >= num_pages) {
                bail!("sequence {i}: page {p} is outside its pool ({num_pages} pages)");
            }
        }
    }
    Ok(())
}

/// Errors unless every token id is inside the vocabulary.
pub fn check_ids(cfg: &ModelConfig, tokens: &[u32]) -> Result<()> {
    let vocab = cfg.vocab_size;
    if let Some(&id) = tokens.iter().find(|&&id| id as usize >= vocab) {
        bail!("token id {id} is outside the vocabulary ({vocab})");
    }
    Ok(())
}

pub struct Model {
    pub cfg: ModelConfig,
    pub weights: ModelWeights,
    /// The distinct RoPEs' inverse frequencies, `[head_dim / 2]` each (full layers', a
    /// window's), and which one each layer uses.
    inv_freq: Vec<Vec<f32>>,
    layer_rope: Vec<usize>,
}

/// The default model, downloaded by `models/fetch.sh`.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The one resolution of the model path for every binary and subcommand: `--model`, else
/// `$STRATA_MODEL`, else the default model in ./models or in the checkout the running
/// binary was built in.
pub fn resolve(arg: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(p) = arg.or_else(|| std::env::var_os("STRATA_MODEL").map(PathBuf::from)) {
        return Ok(p);
    }
    let mut candidates = vec![PathBuf::from(DEFAULT_MODEL)];
    if let Ok(exe) = std::env::current_exe() {
        // target/{release,debug}/<binary> → the checkout's models/
        if let Some(root) = exe.parent().and_then(Path::parent).and_then(Path::parent) {
            candidates.push(root.join(DEFAULT_MODEL));
        }
    }
    candidates
        .into_iter()
        .find(|p| p.exists())
        .context("no --model given and the default model is missing: run `models/fetch.sh` to download SmolLM2-135M-Instruct")
}

/// A model file or directory, resolved to its format.
pub enum ModelSource {
    Gguf(PathBuf),
    HfDir(PathBuf),
}

impl ModelSource {
    pub fn detect(path: &Path) -> Result<Self> {
        let Ok(meta) = std::fs::metadata(path) else {
            bail!("model not found: {}", path.display());
        };
        if meta.is_dir() {
            if !files::exists(&path.join("config.json")) {
                bail!("{}: a model directory needs config.json", path.display());
            }
            return Ok(Self::HfDir(path.to_path_buf()));
        }
        // A FIFO or a device would block or never end: only regular files are models.
        if !meta.is_file() {
            bail!(
                "{}: not a regular file or a model directory",
                path.display()
            );
        }
        Ok(Self::Gguf(path.to_path_buf()))
    }
}

/// The configuration in an open GGUF file's metadata.
fn gguf_config(gguf: &weights::GgufFile, path: &Path) -> Result<ModelConfig> {
    ModelConfig::from_gguf(&gguf.content.metadata).with_context(|| format!("{}", path.display()))
}

/// The configuration in a Hugging Face directory's config.json.
fn hf_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join("config.json");
    let text = files::read_text(&path)?;
    ModelConfig::from_hf_json(&text).with_context(|| format!("{}", path.display()))
}

impl Model {
    pub fn new(cfg: ModelConfig, weights: ModelWeights) -> Self {
        let (inv_freq, layer_rope) = config::distinct_ropes(&cfg);
        Self {
            cfg,
            weights,
            inv_freq,
            layer_rope,
        }
    }

    /// Loads weights (as stored) and tokenizer from a GGUF file or a Hugging Face directory.
    pub fn load(path: &Path, progress: bool) -> Result<(Arc<Self>, Tokenizer)> {
        Self::load_as(path, progress, WeightDtype::Stored)
    }

    /// `load`, holding the weights as `dtype`.
    pub fn load_as(
        path: &Path,
        progress: bool,
        dtype: WeightDtype,
    ) -> Result<(Arc<Self>, Tokenizer)> {
        match ModelSource::detect(path)? {
            ModelSource::Gguf(p) => {
                let mut gguf = weights::GgufFile::open(&p)?;
                let mut cfg = gguf_config(&gguf, &p)?;
                let tok = Tokenizer::from_gguf(&gguf.content.metadata)
                    .with_context(|| format!("{}", p.display()))?;
                let mut w = weights::load_gguf(&mut gguf, &mut cfg, progress, dtype)
                    .with_context(|| format!("{}", p.display()))?;
                if dtype == WeightDtype::Q8 {
                    w.to_q8_mode();
                }
                if cfg.eos_token_ids.is_empty() {
                    cfg.eos_token_ids = tok.eos_token_ids.clone();
                }
                Ok((Arc::new(Self::new(cfg, w)), tok))
            }
            ModelSource::HfDir(dir) => {
                let mut cfg = hf_config(&dir)?;
                let tok = Tokenizer::from_hf_dir(&dir, &cfg.eos_token_ids, cfg.vocab_size)?;
                cfg.eos_token_ids = tok.eos_token_ids.clone();
                let gen_path = dir.join("generation_config.json");
                if files::exists(&gen_path) {
                    let text = files::read_text(&gen_path)?;
                    let v: serde_json::Value = serde_json::from_str(&text)
                        .with_context(|| format!("malformed {}", gen_path.display()))?;
                    cfg.generation = config::GenerationDefaults::from_json(&v)
                        .with_context(|| format!("{}", gen_path.display()))?;
                }
                let mut w = weights::load_safetensors(&dir, &mut cfg, progress)
                    .with_context(|| format!("{}", dir.display()))?;
                match dtype {
                    WeightDtype::F32 => w.widen(),
                    WeightDtype::Q8 => w.to_q8_mode(),
                    WeightDtype::Stored => {}
                }
                Ok((Arc::new(Self::new(cfg, w)), tok))
            }
        }
    }

    /// A Hugging Face directory's config and weights (as stored), without a tokenizer: for
    /// checks that feed token ids (transformers' random test checkpoints ship none).
    pub fn load_untokenized(dir: &Path) -> Result<Arc<Self>> {
        let mut cfg = hf_config(dir)?;
        let w = weights::load_safetensors(dir, &mut cfg, false)
            .with_context(|| format!("{}", dir.display()))?;
        Ok(Arc::new(Self::new(cfg, w)))
    }

    /// The configuration of the model at `path` without its weights or tokenizer (a GGUF
    /// file's header, a directory's config.json): what `serve` checks its flags against
    /// before it binds the port.
    pub fn peek_config(path: &Path) -> Result<ModelConfig> {
        match ModelSource::detect(path)? {
            ModelSource::Gguf(p) => gguf_config(&weights::GgufFile::open(&p)?, &p),
            ModelSource::HfDir(dir) => hf_config(&dir),
        }
    }

    /// Bytes of weights held, as stored (memory-mapped or owned).
    pub fn weight_bytes(&self) -> usize {
        self.weights.bytes()
    }

    /// Runs `tokens` at positions `pos0..` through every layer, storing their K/V through
    /// `kv` (in its element `T`: the activations are f32, the cache rounds them), and
    /// returns the logits `[vocab]` of the last token.
    pub fn forward<T: KvElem>(
        &self,
        tokens: &[u32],
        pos0: usize,
        kv: &mut dyn KvCache<T>,
    ) -> Result<Vec<f32>> {
        let (a, t) = self.steps(tokens, pos0, kv, |_, _| {})?;
        Ok(self.head(&a, &[t - 1]).remove(0))
    }

    /// `step` over `tokens` in steps of at most `kv.max_step_tokens()` (one, unless a
    /// sliding-window ring bounds them), calling `each` with every step's activations and
    /// tokens; returns the last step's.
    fn steps<T: KvElem>(
        &self,
        tokens: &[u32],
        pos0: usize,
        kv: &mut dyn KvCache<T>,
        mut each: impl FnMut(&Activations, usize),
    ) -> Result<(Activations, usize)> {
        if tokens.is_empty() {
            bail!("forward called with no tokens");
        }
        let n = kv.max_step_tokens().max(1);
        let mut chunks = tokens.chunks(n).enumerate().peekable();
        loop {
            let (i, chunk) = chunks.next().expect("at least one chunk");
            let a = self.step(chunk, pos0 + i * n, kv)?;
            each(&a, chunk.len());
            if chunks.peek().is_none() {
                return Ok((a, chunk.len()));
            }
        }
    }

    /// `forward`, returning the logits `[vocab]` of every token, in order: sparse decode's
    /// verify step (each row's are bitwise those a one-token step at its position gives:
    /// every kernel is batch-invariant).
    pub fn forward_rows<T: KvElem>(
        &self,
        tokens: &[u32],
        pos0: usize,
        kv: &mut dyn KvCache<T>,
    ) -> Result<Vec<Vec<f32>>> {
        let mut logits = Vec::with_capacity(tokens.len());
        self.steps(tokens, pos0, kv, |a, t| {
            logits.extend(self.head(a, &(0..t).collect::<Vec<_>>()))
        })?;
        Ok(logits)
    }

    /// One sequence's step over `kv`: the activations after the final norm.
    fn step<T: KvElem>(
        &self,
        tokens: &[u32],
        pos0: usize,
        kv: &mut dyn KvCache<T>,
    ) -> Result<Activations> {
        let t = tokens.len();
        if t == 0 {
            bail!("forward called with no tokens");
        }
        check_ids(&self.cfg, tokens)?;
        kv.begin_step(pos0, t)?;
        let seq = AttnSeq {
            row0: 0,
            tokens: t,
            pos0,
            kv: ContiguousRows {
                row: self.cfg.kv_dim(),
            },
        };
        let positions: Vec<usize> = (pos0..pos0 + t).collect();
        self.run_layers(tokens, &positions, &[seq], None, &[0], kv)
    }

    /// One forward over a batch of sequences (decode rows and prefill chunks alike), each
    /// storing its new K/V into and attending over its own pages; the weights are read once
    /// for the whole batch. Returns the logits `[rows, vocab]` each sequence asked for
    /// (`WantLogits`; `None` for none). Every kernel is batch-invariant, so each sequence's logits are bitwise
    /// those of `forward` over a contiguous cache, whatever else is in the batch.
    pub fn forward_batch<T: KvElem>(
        &self,
        seqs: &[BatchSeq<'_>],
        pool: &mut dyn PagePool<T>,
    ) -> Result<Vec<Option<Vec<f32>>>> {
        let cfg = &self.cfg;
        let bs = pool.block_size();
        check_batch(cfg, seqs, pool)?;
        let window_pool = pool.num_window_pages().is_some();
        let (mut attn_seqs, mut window_seqs) = (Vec::new(), Vec::new());
        let (mut tokens, mut positions) = (Vec::new(), Vec::new());
        for s in seqs {
            let end = s.pos0 + s.tokens.len();
            let on = |pages| AttnSeq {
                row0: tokens.len(),
                tokens: s.tokens.len(),
                pos0: s.pos0,
                kv: PagedRows {
                    pages,
                    block_size: bs,
                    row: cfg.kv_dim(),
                },
            };
            attn_seqs.push(on(s.pages));
            if window_pool {
                window_seqs.push(on(s.window_pages));
            }
            tokens.extend_from_slice(s.tokens);
            positions.extend(s.pos0..end);
        }
        let window_seqs = window_pool.then_some(&window_seqs[..]);
        let slots: Vec<usize> = seqs.iter().map(|s| s.state_slot).collect();
        let a = self.run_layers(&tokens, &positions, &attn_seqs, window_seqs, &slots, pool)?;
        let rows: Vec<usize> = attn_seqs
            .iter()
            .zip(seqs)
            .flat_map(|(a, s)| s.logits.rows(a.tokens).map(move |r| a.row0 + r))
            .collect();
        let mut logits = self.head(&a, &rows).into_iter();
        Ok(seqs
            .iter()
            .map(|s| {
                let n = s.logits.rows(s.tokens.len()).len();
                (n > 0).then(|| logits.by_ref().take(n).flatten().collect())
            })
            .collect())
    }

    /// Embedding, then every layer over the KV seam: layer `l` pulls its K/V from `kv`,
    /// runs here (the CPU device's compute stream is the calling thread) and hands the
    /// slot back. Returns the activations, the final norm in `hn`. `window_seqs`: the same
    /// sequences over a window pool's pages, for the sliding-window layers; `state_slots`:
    /// each sequence's recurrent-state slot, for the state layers.
    fn run_layers<T: KvElem, L: KvLayout>(
        &self,
        tokens: &[u32],
        positions: &[usize],
        full_seqs: &[AttnSeq<L>],
        window_seqs: Option<&[AttnSeq<L>]>,
        state_slots: &[usize],
        kv: &mut dyn KvCache<T>,
    ) -> Result<Activations> {
        if self.cfg.has_state_layers() {
            for (s, &slot) in full_seqs.iter().zip(state_slots) {
                kv.begin_state(slot, s.pos0, s.tokens)?;
            }
        }
        let kvd = self.cfg.kv_dim();
        // Elements of K (and of V) the step addresses: its last row's end, in any sequence.
        let need = |seqs: &[AttnSeq<L>]| {
            seqs.iter()
                .map(|s| s.kv.row_offset(s.pos0 + s.tokens - 1) + kvd)
                .max()
                .unwrap_or(0)
        };
        let mut a = Activations::new(&self.cfg, tokens.len());
        self.embed(tokens, positions, &mut a);
        for l in 0..self.cfg.num_layers {
            if let Some(shape) = self.cfg.state(l) {
                // The schedule still sees the layer (an offload engine's slots turn over),
                // but a state layer's memory is its recurrent state, not the slot.
                kv.begin_layer(l)?;
                self.state_layer(l, shape, &mut a, full_seqs, state_slots, kv)?;
                self.finish_layer(l, &mut a)?;
                kv.end_layer(l)?;
                continue;
            }
            let seqs = match (window_seqs, self.cfg.window(l)) {
                (Some(w), Some(_)) => w,
                _ => full_seqs,
            };
            let slot = kv.begin_layer(l)?;
            if slot.ring {
                // A ring addresses by position modulo its rows, whatever the layout.
                let (Some(w), [s]) = (self.cfg.window(l), seqs) else {
                    bail!("layer {l}: a ring slot needs a sliding-window layer and one sequence");
                };
                if slot.rows + 1 < w + s.tokens {
                    bail!(
                        "layer {l}: a step of {} tokens overruns its ring of {} rows (window {w})",
                        s.tokens,
                        slot.rows
                    );
                }
                let ring = RingRows {
                    row: kvd,
                    rows: slot.rows,
                };
                let ring = [AttnSeq {
                    row0: s.row0,
                    tokens: s.tokens,
                    pos0: s.pos0,
                    kv: ring,
                }];
                self.layer_on_slot(l, &mut a, slot, &ring, kv)?;
            } else {
                let need = need(seqs);
                if slot.rows * kvd < need {
                    bail!(
                        "layer {l}: the step addresses {} KV rows, its slot holds {}",
                        need / kvd,
                        slot.rows
                    );
                }
                self.layer_on_slot(l, &mut a, slot, seqs, kv)?;
            }
        }
        Ok(a)
    }

    /// Layer `l` on the slot `begin_layer` gave, then `end_layer`.
    fn layer_on_slot<T: KvElem, L: KvLayout>(
        &self,
        l: usize,
        a: &mut Activations,
        slot: LayerSlot<T>,
        seqs: &[AttnSeq<L>],
        kv: &mut dyn KvCache<T>,
    ) -> Result<()> {
        // SAFETY: the slot is this (compute) thread's until `end_layer` below, which is
        // called after the layer's work has run.
        let lkv = unsafe { LayerKv::from_slot(slot, self.cfg.kv_dim()) };
        // A sparse cache scores pages with the query in its own element, as the CUDA model
        // hands it over: rounded like the keys it is scored against.
        let mut select = |q: &[f32]| {
            let q: Vec<T> = q.iter().map(|&x| T::from_f32(x)).collect(); // [heads, head_dim]
            kv.select_rows(l, Query::from(&q[..]))
        };
        self.layer(l, a, lkv, seqs, &mut select)?;
        kv.end_layer(l)
    }

    /// Embedding gather and the first layer's input norm; `positions[t]` of each row.
    fn embed(&self, tokens: &[u32], positions: &[usize], a: &mut Activations) {
        let (w, h) = (&self.weights, self.cfg.hidden_size);
        for (row, &id) in a.x.chunks_exact_mut(h).zip(tokens) {
            w.embed.row_f32(id as usize, row);
            if let Some(s) = self.cfg.embed_scale {
                row.iter_mut().for_each(|x| *x *= s);
            }
        }
        ops::rms_norm(
            &a.x,
            &w.layers[0].attn_norm,
            self.cfg.rms_norm_eps,
            &mut a.hn,
        );
        a.rope = self
            .inv_freq
            .iter()
            .map(|f| ops::rope_tables_at(f, positions))
            .collect();
    }

    /// One decoder layer: reads `a.hn` (normalised input), updates the residual `a.x`, and
    /// leaves the next layer's normalised input in `a.hn`. `select` hands the query to the
    /// cache (`KvCache::select_rows`: sparse decode picks the rows to attend from it).
    fn layer<T: KvElem, L: KvLayout>(
        &self,
        l: usize,
        a: &mut Activations,
        kv: LayerKv<'_, T>,
        seqs: &[AttnSeq<L>],
        select: &mut dyn FnMut(&[f32]) -> Result<Option<NewRow>>,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let lw = &self.weights.layers[l];
        let t = a.t;
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let qkv_dim = cfg.attn_qkv_dim();
        let eps = cfg.rms_norm_eps;
        // 1. Fused QKV projection (and the output gates).
        timed(Op::Qkv, || {
            ops::linear_weight(
                &a.hn,
                &lw.wqkv,
                lw.bqkv.as_deref(),
                &mut a.qkv[..t * qkv_dim],
                t,
            )
        });
        // 2. Qwen3: per-head RMSNorm of q and k, before RoPE.
        if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
            ops::head_rms_norm(&mut a.qkv, t, cfg.num_heads, cfg.head_dim, qkv_dim, qn, eps);
            ops::head_rms_norm(
                &mut a.qkv[qd..],
                t,
                cfg.num_kv_heads,
                cfg.head_dim,
                qkv_dim,
                kn,
                eps,
            );
        }
        // 3. RoPE on q and k (the layer's own: a window may have its own base).
        let (cos, sin) = &a.rope[self.layer_rope[l]];
        ops::rope(
            &mut a.qkv,
            t,
            cfg.num_heads,
            cfg.head_dim,
            qkv_dim,
            cos,
            sin,
        );
        ops::rope(
            &mut a.qkv[qd..],
            t,
            cfg.num_kv_heads,
            cfg.head_dim,
            qkv_dim,
            cos,
            sin,
        );
        for (dst, src) in a.q.chunks_exact_mut(qd).zip(a.qkv.chunks_exact(qkv_dim)) {
            dst.copy_from_slice(&src[..qd]);
        }
        // 4. Store the new K/V and attend over everything up to them (or, in sparse
        //    decode, over the rows the cache chose from the query).
        timed(Op::Attention, || -> Result<()> {
            let last_query = &a.q[(t - 1) * qd..t * qd];
            match select(last_query)? {
                None => self.store_and_attend(l, a, kv, seqs),
                Some(new_row) => {
                    if seqs.len() != 1 || t != 1 {
                        bail!("sparse decode attends one sequence's one new token, got {} sequences of {t} rows", seqs.len());
                    }
                    let seq = AttnSeq {
                        row0: 0,
                        tokens: 1,
                        pos0: new_row.0,
                        kv: ContiguousRows { row: kvd },
                    };
                    self.store_and_attend(l, a, kv, &[seq]);
                }
            }
            Ok(())
        })?;
        // Qwen3.5: each head's output times σ(its gate).
        if cfg.attn_output_gate {
            for (o, row) in a
                .attn
                .chunks_exact_mut(qd)
                .zip(a.qkv.chunks_exact(qkv_dim))
                .take(t)
            {
                let gate = &row[qd + 2 * kvd..];
                o.iter_mut()
                    .zip(gate)
                    .for_each(|(o, g)| *o *= ops::sigmoid(*g));
            }
        }
        self.finish_layer(l, a)
    }

    /// A state layer's token mixer: the fused projection `[q | k | v | z | b | a]`, then
    /// each sequence's rows in order through its recurrence (the causal conv, the gates,
    /// the gated delta rule, the gated norm), each from and into its state slot; leaves
    /// `[t, v_heads · dv]` in `a.attn` for `out_proj`.
    fn state_layer<T: KvElem, L: KvLayout>(
        &self,
        l: usize,
        s: delta_net::DeltaShape,
        a: &mut Activations,
        seqs: &[AttnSeq<L>],
        state_slots: &[usize],
        kv: &mut dyn KvCache<T>,
    ) -> Result<()> {
        let lw = &self.weights.layers[l];
        let d = lw
            .delta
            .as_ref()
            .context("a state layer without its recurrence's weights")?;
        let t = a.t;
        let (width, c, vd, nv) = (
            s.proj_width(),
            s.conv_channels(),
            s.v_heads * s.dv,
            s.v_heads,
        );
        let kd = s.k_heads * s.dk;
        timed(Op::Qkv, || {
            ops::linear_weight(&a.hn, &lw.wqkv, None, &mut a.qkv[..t * width], t)
        });
        timed(Op::Attention, || -> Result<()> {
            let mut conv = vec![0.0f32; c];
            let (mut g, mut beta) = (vec![0.0f32; nv], vec![0.0f32; nv]);
            let mut out = vec![0.0f32; vd];
            for (seq, &slot) in seqs.iter().zip(state_slots) {
                // SAFETY: the CPU device's caches keep states in host memory; the layer
                // (begun by the caller) has this sequence's state to itself until its end.
                let state = unsafe { kv.layer_state(l, slot)?.as_host_mut() };
                let (tail, matrix) = state.split_at_mut(s.conv_tail_len());
                for r in seq.row0..seq.row0 + seq.tokens {
                    let row = &a.qkv[r * width..(r + 1) * width]; // [q | k | v | z | b | a]
                    let (qkv, rest) = row.split_at(c);
                    let (z, rest) = rest.split_at(vd);
                    let (b, a_in) = rest.split_at(nv);
                    delta_net::conv_step(s, tail, qkv, &d.conv, &mut conv);
                    delta_net::gates(a_in, b, &d.decay_rate, &d.dt_bias, &mut g, &mut beta);
                    let (q, kv_part) = conv.split_at(kd);
                    let (k, v) = kv_part.split_at(kd);
                    delta_net::delta_step(s, matrix, q, k, v, &g, &beta, &mut out);
                    let o = &mut a.attn[r * vd..(r + 1) * vd];
                    delta_net::gated_rms_norm(&out, z, &d.norm, self.cfg.rms_norm_eps, o);
                }
            }
            Ok(())
        })
    }

    /// The rest of layer `l` after its token mixer left `[t, mixer width]` in `a.attn`:
    /// output projection, (Gemma: its norm,) residual add, the MLP's input norm, the MLP,
    /// and the next layer's input norm.
    fn finish_layer(&self, l: usize, a: &mut Activations) -> Result<()> {
        let cfg = &self.cfg;
        let lw = &self.weights.layers[l];
        let t = a.t;
        let (h, inter, eps) = (cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps);
        // 5. Output projection, (Gemma: its norm,) residual add, the MLP's input norm.
        let width = lw.wo.shape().in_features;
        timed(Op::OutProj, || {
            ops::linear_weight(
                &a.attn[..t * width],
                &lw.wo,
                lw.bo.as_deref(),
                &mut a.proj,
                t,
            )
        });
        if let Some((post_attn, _)) = &lw.post_norms {
            ops::rms_norm_in_place(&mut a.proj, post_attn, eps);
        }
        ops::add_rms_norm(&mut a.x, &a.proj, &lw.mlp_norm, eps, &mut a.hn);
        // 6. MLP in row chunks; the residual add is fused with the next block's norm.
        let w = &self.weights;
        let next_norm = w.layers.get(l + 1).map_or(&w.final_norm, |n| &n.attn_norm);
        let chunk = a.chunk;
        for r0 in (0..t).step_by(chunk) {
            let n = chunk.min(t - r0);
            let rows = r0 * h..(r0 + n) * h;
            match &lw.mlp {
                Mlp::Dense { gate_up, down } => {
                    timed(Op::GateUp, || {
                        ops::linear_weight(
                            &a.hn[rows.clone()],
                            gate_up,
                            None,
                            &mut a.gu[..n * 2 * inter],
                            n,
                        )
                    });
                    let (gu, act) = (&a.gu[..n * 2 * inter], &mut a.act[..n * inter]);
                    ops::gated_act(cfg.mlp_act, gu, inter, act);
                    timed(Op::Down, || {
                        ops::linear_weight(
                            &a.act[..n * inter],
                            down,
                            None,
                            &mut a.proj[rows.clone()],
                            n,
                        )
                    });
                }
                Mlp::Experts(x) => {
                    let moe = cfg.moe.context("expert weights without a MoE config")?;
                    let x_rows = &a.hn[rows.clone()];
                    moe::forward(x, moe, inter, x_rows, &mut a.proj[rows.clone()], n);
                }
            }
            if let Some((_, post_mlp)) = &lw.post_norms {
                ops::rms_norm_in_place(&mut a.proj[rows.clone()], post_mlp, eps);
            }
            ops::add_rms_norm(
                &mut a.x[rows.clone()],
                &a.proj[rows.clone()],
                next_norm,
                eps,
                &mut a.hn[rows],
            );
        }
        Ok(())
    }

    /// Stores each row's new K/V (in `a.qkv`) at its position, then attends each sequence's
    /// queries over its keys into `a.attn`.
    fn store_and_attend<T: KvElem, L: KvLayout>(
        &self,
        l: usize,
        a: &mut Activations,
        mut kv: LayerKv<'_, T>,
        seqs: &[AttnSeq<L>],
    ) {
        let cfg = &self.cfg;
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let qkv_dim = cfg.attn_qkv_dim();
        for s in seqs {
            for i in 0..s.tokens {
                let src = &a.qkv[(s.row0 + i) * qkv_dim..][..qkv_dim];
                kv.store(
                    s.kv.row_offset(s.pos0 + i),
                    &src[qd..qd + kvd],
                    &src[qd + kvd..qd + 2 * kvd],
                );
            }
        }
        let heads = AttnHeads {
            scale: cfg.layer_attn_scale(l),
            window: cfg.window(l),
            ..AttnHeads::causal(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        };
        let sinks = self.weights.layers[l].sinks.as_deref();
        let out = &mut a.attn[..a.t * cfg.q_dim()]; // [t, heads, head_dim]
        ops::attention_batch(&a.q, kv.read(), out, heads, sinks, seqs);
    }

    /// lm_head on the given rows (`a.hn` already holds the final norm): `[vocab]` each.
    fn head(&self, a: &Activations, rows: &[usize]) -> Vec<Vec<f32>> {
        let (h, vocab) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let x: Vec<f32> = rows
            .iter()
            .flat_map(|&r| &a.hn[r * h..(r + 1) * h])
            .copied()
            .collect(); // [rows, hidden]
        let mut logits = vec![0.0f32; rows.len() * vocab]; // [rows, vocab]
        timed(Op::LmHead, || {
            ops::linear_weight(&x, self.weights.lm_head(), None, &mut logits, rows.len())
        });
        logits.chunks_exact(vocab).map(<[f32]>::to_vec).collect()
    }
}

/// The step's activations ("device memory" of the compute stream), sized for `t` tokens.
struct Activations {
    t: usize,
    chunk: usize,   // MLP rows at once
    x: Vec<f32>,    // [t, hidden] residual stream
    hn: Vec<f32>,   // [t, hidden] normalised input of the next block
    qkv: Vec<f32>,  // [t, q | k | v (| gate)], a state layer's [t, q | k | v | z | b | a]
    q: Vec<f32>,    // [t, heads, head_dim]
    attn: Vec<f32>, // [t, heads, head_dim], a state layer's [t, v_heads, dv]
    proj: Vec<f32>, // [t, hidden]
    gu: Vec<f32>,   // [chunk, gate | up]
    act: Vec<f32>,  // [chunk, inter]
    /// (cos, sin) `[t, head_dim / 2]` each, per distinct RoPE (`Model::inv_freq`).
    rope: Vec<(Vec<f32>, Vec<f32>)>,
}

impl Activations {
    fn new(cfg: &ModelConfig, t: usize) -> Self {
        let (h, qd, inter) = (cfg.hidden_size, cfg.q_dim(), cfg.intermediate_size);
        let chunk = t.min(MLP_CHUNK);
        Self {
            t,
            chunk,
            x: vec![0.0; t * h],
            hn: vec![0.0; t * h],
            qkv: vec![0.0; t * cfg.qkv_width()],
            q: vec![0.0; t * qd],
            attn: vec![0.0; t * cfg.mixer_width()],
            proj: vec![0.0; t * h],
            gu: vec![0.0; chunk * 2 * inter],
            act: vec![0.0; chunk * inter],
            rope: Vec::new(),
        }
    }
}
