//! Weight loading: Hugging Face safetensors (single file or sharded) and GGUF, widened
//! once to f32 and fused for the forward pass (QKV into one matrix, gate/up into one).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use indicatif::{ProgressBar, ProgressStyle};

use super::config::{Arch, ModelConfig};
use super::{files, gguf_header};
use crate::errors;

/// One decoder layer's weights, row-major `[out, in]` as Hugging Face stores them.
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,      // [hidden]
    pub wqkv: Vec<f32>,           // [q_dim + 2 * kv_dim, hidden]  rows: q, then k, then v
    pub bqkv: Option<Vec<f32>>,   // [q_dim + 2 * kv_dim]
    pub q_norm: Option<Vec<f32>>, // [head_dim] (Qwen3)
    pub k_norm: Option<Vec<f32>>, // [head_dim] (Qwen3)
    pub wo: Vec<f32>,             // [hidden, q_dim]
    pub mlp_norm: Vec<f32>,       // [hidden]
    pub w_gate_up: Vec<f32>,      // [2 * inter, hidden]  rows: gate, then up
    pub w_down: Vec<f32>,         // [hidden, inter]
}

pub struct ModelWeights {
    pub embed: Vec<f32>, // [vocab, hidden]
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,      // [hidden]
    pub lm_head: Option<Vec<f32>>, // [vocab, hidden]; None = tied to `embed`
}

impl ModelWeights {
    pub fn lm_head(&self) -> &[f32] {
        self.lm_head.as_deref().unwrap_or(&self.embed)
    }
}

/// A named-tensor store that yields f32 data with its shape (outermost dim first).
trait TensorSource {
    fn has(&self, name: &str) -> bool;
    /// The stored shape (outermost dim first), read from the header without loading data.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    fn load(&mut self, name: &str) -> Result<(Vec<usize>, Vec<f32>)>;
}

/// Tensor names of one checkpoint family.
struct Names {
    embed: &'static str,
    final_norm: &'static str,
    lm_head: &'static str,
    layer: fn(usize, &str) -> String,
}

const HF_NAMES: Names = Names {
    embed: "model.embed_tokens.weight",
    final_norm: "model.norm.weight",
    lm_head: "lm_head.weight",
    layer: |i, part| {
        let p = match part {
            "q" => "self_attn.q_proj.weight",
            "k" => "self_attn.k_proj.weight",
            "v" => "self_attn.v_proj.weight",
            "q_bias" => "self_attn.q_proj.bias",
            "k_bias" => "self_attn.k_proj.bias",
            "v_bias" => "self_attn.v_proj.bias",
            "o" => "self_attn.o_proj.weight",
            "q_norm" => "self_attn.q_norm.weight",
            "k_norm" => "self_attn.k_norm.weight",
            "attn_norm" => "input_layernorm.weight",
            "mlp_norm" => "post_attention_layernorm.weight",
            "gate" => "mlp.gate_proj.weight",
            "up" => "mlp.up_proj.weight",
            "down" => "mlp.down_proj.weight",
            _ => unreachable!("unknown weight part {part}"),
        };
        format!("model.layers.{i}.{p}")
    },
};

const GGUF_NAMES: Names = Names {
    embed: "token_embd.weight",
    final_norm: "output_norm.weight",
    lm_head: "output.weight",
    layer: |i, part| {
        let p = match part {
            "q" => "attn_q.weight",
            "k" => "attn_k.weight",
            "v" => "attn_v.weight",
            "q_bias" => "attn_q.bias",
            "k_bias" => "attn_k.bias",
            "v_bias" => "attn_v.bias",
            "o" => "attn_output.weight",
            "q_norm" => "attn_q_norm.weight",
            "k_norm" => "attn_k_norm.weight",
            "attn_norm" => "attn_norm.weight",
            "mlp_norm" => "ffn_norm.weight",
            "gate" => "ffn_gate.weight",
            "up" => "ffn_up.weight",
            "down" => "ffn_down.weight",
            _ => unreachable!("unknown weight part {part}"),
        };
        format!("blk.{i}.{p}")
    },
};

/// Loads and checks every tensor the config calls for, fusing as it goes.
fn build(
    cfg: &mut ModelConfig,
    src: &mut dyn TensorSource,
    names: &Names,
    progress: bool,
) -> Result<ModelWeights> {
    let (h, q, kv, inter) = (
        cfg.hidden_size,
        cfg.q_dim(),
        cfg.kv_dim(),
        cfg.intermediate_size,
    );
    // The layer count comes from the file: check the last layer exists before anything is
    // sized by it (a huge count would otherwise reach the allocator first).
    let last_layer = (names.layer)(cfg.num_layers - 1, "q");
    if !src.has(&last_layer) {
        bail!(
            "the config names {} layers but the weights have no `{last_layer}`",
            cfg.num_layers
        );
    }
    let per_layer = 9 + 2 * cfg.qk_norm as usize;
    let bar = progress_bar(progress, (cfg.num_layers * per_layer + 3) as u64);
    let has_lm_head = src.has(names.lm_head);
    let mut get = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
        let Some(got) = src.shape(name) else {
            bail!("missing tensor `{name}` in the weights");
        };
        // Checked before the data is read, so a wrong tensor costs nothing to refuse.
        if got != shape {
            bail!("tensor `{name}` has shape {got:?}, expected {shape:?}");
        }
        let (got, data) = src.load(name).with_context(|| format!("tensor `{name}`"))?;
        if got != shape || data.len() != shape.iter().product::<usize>() {
            bail!("tensor `{name}` has shape {got:?}, expected {shape:?}");
        }
        bar.inc(1);
        Ok(data)
    };
    let embed = get(names.embed, &[cfg.vocab_size, h])?;
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let n = |p: &str| (names.layer)(i, p);
        let mut wqkv = get(&n("q"), &[q, h])?;
        wqkv.extend(get(&n("k"), &[kv, h])?);
        wqkv.extend(get(&n("v"), &[kv, h])?);
        let bqkv = if cfg.attention_bias {
            let mut b = get(&n("q_bias"), &[q])?;
            b.extend(get(&n("k_bias"), &[kv])?);
            b.extend(get(&n("v_bias"), &[kv])?);
            Some(b)
        } else {
            None
        };
        let (q_norm, k_norm) = if cfg.qk_norm {
            (
                Some(get(&n("q_norm"), &[cfg.head_dim])?),
                Some(get(&n("k_norm"), &[cfg.head_dim])?),
            )
        } else {
            (None, None)
        };
        let mut w_gate_up = get(&n("gate"), &[inter, h])?;
        w_gate_up.extend(get(&n("up"), &[inter, h])?);
        layers.push(LayerWeights {
            attn_norm: get(&n("attn_norm"), &[h])?,
            wqkv,
            bqkv,
            q_norm,
            k_norm,
            wo: get(&n("o"), &[h, q])?,
            mlp_norm: get(&n("mlp_norm"), &[h])?,
            w_gate_up,
            w_down: get(&n("down"), &[h, inter])?,
        });
    }
    let final_norm = get(names.final_norm, &[h])?;
    // A checkpoint without an lm_head ties it to the embedding, whatever the config says.
    let lm_head = if !cfg.tie_word_embeddings && has_lm_head {
        Some(get(names.lm_head, &[cfg.vocab_size, h])?)
    } else {
        cfg.tie_word_embeddings = true;
        None
    };
    bar.finish_and_clear();
    Ok(ModelWeights {
        embed,
        layers,
        final_norm,
        lm_head,
    })
}

fn progress_bar(show: bool, len: u64) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("loading weights {bar:40} {pos}/{len} tensors [{elapsed}]")
            .expect("static progress template"),
    );
    bar
}

// ---------------------------------------------------------------------------------------
// safetensors

struct SafetensorsSource {
    /// One memory map per shard file.
    files: Vec<(PathBuf, memmap2::Mmap)>,
    /// Tensor name → index into `files`.
    index: HashMap<String, usize>,
}

impl SafetensorsSource {
    fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let shard_names: Vec<String> = if files::exists(&index_path) {
            let text = files::read_text(&index_path)?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("malformed {}", index_path.display()))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .with_context(|| format!("{} has no weight_map", index_path.display()))?;
            let mut shards: Vec<String> = map
                .values()
                .filter_map(|s| s.as_str().map(String::from))
                .collect();
            shards.sort();
            shards.dedup();
            shards
        } else if files::exists(&dir.join("model.safetensors")) {
            vec!["model.safetensors".to_string()]
        } else {
            bail!(
                "no model.safetensors or model.safetensors.index.json in {}",
                dir.display()
            );
        };
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for name in shard_names {
            let path = dir.join(&name);
            // A shard name is untrusted: it must stay inside the model directory.
            if Path::new(&name)
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
            {
                bail!(
                    "{}: shard name {name:?} is not a file name inside the model directory",
                    index_path.display()
                );
            }
            let file = files::open_regular(&path)?;
            // SAFETY: the map is read-only; a file changed under us mid-load is the user's
            // problem, as with every memory-mapped weight loader.
            let mmap = unsafe { memmap2::Mmap::map(&file) }
                .with_context(|| format!("mapping {}", path.display()))?;
            let st = safetensors::SafeTensors::deserialize(&mmap).map_err(|e| {
                anyhow::anyhow!("{}: invalid safetensors file: {e}", path.display())
            })?;
            for (tname, _) in st.tensors() {
                index.insert(tname, files.len());
            }
            files.push((path, mmap));
        }
        Ok(Self { files, index })
    }
}

impl TensorSource for SafetensorsSource {
    fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let (_, mmap) = &self.files[*self.index.get(name)?];
        let st = safetensors::SafeTensors::deserialize(mmap).ok()?;
        Some(st.tensor(name).ok()?.shape().to_vec())
    }

    fn load(&mut self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let (path, mmap) = &self.files[self.index[name]];
        let st = safetensors::SafeTensors::deserialize(mmap)
            .map_err(|e| anyhow::anyhow!("{}: invalid safetensors file: {e}", path.display()))?;
        let view = st.tensor(name).map_err(|e| anyhow::anyhow!("{e}"))?;
        let bytes = view.data();
        let data: Vec<f32> = match view.dtype() {
            safetensors::Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            safetensors::Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            safetensors::Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => bail!("unsupported dtype {other:?} (supported: f32, bf16, f16)"),
        };
        Ok((view.shape().to_vec(), data))
    }
}

// ---------------------------------------------------------------------------------------
// GGUF

pub struct GgufFile {
    pub content: gguf_file::Content,
    file: std::fs::File,
    path: PathBuf,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let mut file = files::open_regular(path)?;
        let mut magic = [0u8; 4];
        use std::io::Read;
        if file.read_exact(&mut magic).is_err() || &magic != b"GGUF" {
            bail!("{}: not a GGUF file (bad magic)", path.display());
        }
        use std::io::Seek;
        file.rewind()?;
        // candle's reader divides by the alignment: refuse zero before it runs.
        if gguf_header::alignment(&mut file) == Some(0) {
            bail!(
                "{}: invalid GGUF file: general.alignment is 0",
                path.display()
            );
        }
        file.rewind()?;
        let content = gguf_file::Content::read(&mut file).map_err(|e| {
            anyhow::anyhow!(
                "{}: invalid GGUF file: {}",
                path.display(),
                errors::candle(e)
            )
        })?;
        let len = file.metadata()?.len();
        check_tensor_layout(&content, len)
            .with_context(|| format!("{}: invalid GGUF file", path.display()))?;
        Ok(Self {
            content,
            file,
            path: path.to_path_buf(),
        })
    }
}

/// Every tensor's data lies inside the file, starts at a multiple of the alignment and
/// overlaps no other tensor; sizes are computed with checked arithmetic (a crafted shape
/// can make the element count wrap).
fn check_tensor_layout(content: &gguf_file::Content, file_len: u64) -> Result<()> {
    let alignment = match content.metadata.get("general.alignment") {
        None => gguf_file::DEFAULT_ALIGNMENT,
        Some(v) => gguf_int(v)
            .filter(|&a| a > 0 && (a as u64).is_power_of_two())
            .map(|a| a as u64)
            .with_context(|| format!("general.alignment must be a power of two, got {v:?}"))?,
    };
    let mut extents = Vec::with_capacity(content.tensor_infos.len());
    for (name, info) in &content.tensor_infos {
        let elems = info
            .shape
            .dims()
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .with_context(|| format!("tensor `{name}`: element count overflows"))?;
        let block = info.ggml_dtype.block_size();
        if !elems.is_multiple_of(block) {
            bail!("tensor `{name}`: {elems} elements is not a multiple of the {block}-element block of {:?}", info.ggml_dtype);
        }
        let bytes = (elems / block)
            .checked_mul(info.ggml_dtype.type_size())
            .with_context(|| format!("tensor `{name}`: byte size overflows"))?
            as u64;
        if !info.offset.is_multiple_of(alignment) {
            bail!(
                "tensor `{name}` starts at offset {} which is not a multiple of the alignment {alignment}",
                info.offset
            );
        }
        let end = content
            .tensor_data_offset
            .checked_add(info.offset)
            .and_then(|s| s.checked_add(bytes))
            .with_context(|| format!("tensor `{name}`: offset overflows"))?;
        if end > file_len {
            bail!("truncated GGUF file: tensor `{name}` ends at byte {end} but the file has {file_len}");
        }
        extents.push((info.offset, info.offset + bytes, name));
    }
    extents.sort();
    for w in extents.windows(2) {
        let ((_, end, a), (start, _, b)) = (w[0], w[1]);
        if start < end {
            bail!("tensors `{a}` and `{b}` overlap");
        }
    }
    Ok(())
}

/// A GGUF integer of the types candle reads `general.alignment` from.
fn gguf_int(v: &gguf_file::Value) -> Option<i64> {
    use gguf_file::Value as V;
    match *v {
        V::U8(x) => Some(x as i64),
        V::U16(x) => Some(x as i64),
        V::U32(x) => Some(x as i64),
        V::I8(x) => Some(x as i64),
        V::I16(x) => Some(x as i64),
        V::I32(x) => Some(x as i64),
        _ => None,
    }
}

struct GgufSource<'a> {
    gguf: &'a mut GgufFile,
    /// llama.cpp stores Llama Q/K rows permuted for interleaved RoPE; we undo it.
    unpermute: bool,
    num_heads: usize,
    num_kv_heads: usize,
}

impl TensorSource for GgufSource<'_> {
    fn has(&self, name: &str) -> bool {
        self.gguf.content.tensor_infos.contains_key(name)
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        Some(
            self.gguf
                .content
                .tensor_infos
                .get(name)?
                .shape
                .dims()
                .to_vec(),
        )
    }

    fn load(&mut self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let g = &mut *self.gguf;
        let qt = g
            .content
            .tensor(&mut g.file, name, &candle_core::Device::Cpu)
            .map_err(|e| anyhow::anyhow!("{}: {}", g.path.display(), errors::candle(e)))?;
        let t = qt
            .dequantize(&candle_core::Device::Cpu)
            .map_err(errors::candle)?;
        let shape = t.dims().to_vec();
        let mut data = t
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(errors::candle)?;
        if self.unpermute && shape.len() == 2 {
            if name.ends_with("attn_q.weight") {
                data = unpermute_rows(&data, self.num_heads, shape[0], shape[1]);
            } else if name.ends_with("attn_k.weight") {
                data = unpermute_rows(&data, self.num_kv_heads, shape[0], shape[1]);
            }
        }
        Ok((shape, data))
    }
}

/// Inverse of llama.cpp's `permute`: within each head, GGUF row `(i, j)` (i < d/2, j < 2)
/// holds Hugging Face row `(j, i)`, i.e. rotary pairs interleaved instead of split in halves.
pub fn unpermute_rows(w: &[f32], heads: usize, rows: usize, cols: usize) -> Vec<f32> {
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![0.0; w.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let src = h * head_dim + i * 2 + j;
                let dst = h * head_dim + j * half + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// Loads weights from a Hugging Face directory; `cfg.tie_word_embeddings` is settled here.
pub fn load_safetensors(dir: &Path, cfg: &mut ModelConfig, progress: bool) -> Result<ModelWeights> {
    let mut src = SafetensorsSource::open(dir)?;
    build(cfg, &mut src, &HF_NAMES, progress)
}

pub fn load_gguf(
    gguf: &mut GgufFile,
    cfg: &mut ModelConfig,
    progress: bool,
) -> Result<ModelWeights> {
    let mut src = GgufSource {
        unpermute: cfg.arch == Arch::Llama,
        num_heads: cfg.num_heads,
        num_kv_heads: cfg.num_kv_heads,
        gguf,
    };
    build(cfg, &mut src, &GGUF_NAMES, progress)
}
