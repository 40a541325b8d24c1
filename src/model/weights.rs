//! Weight loading: Hugging Face safetensors (single file or sharded) and GGUF, kept in
//! their stored precision (bf16/f16 safetensors and GGUF blocks memory-mapped where the
//! file allows), or widened once to f32 in the reference mode (`WeightDtype::F32`).
//! Q/K/V and gate/up are fused as row segments of one `Weight`, without copying.

use super::mapped::ModelMap;
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use indicatif::{ProgressBar, ProgressStyle};

use super::config::{Arch, ModelConfig};
use super::{files, gguf_header};
use crate::device::cpu::fused::StoredRows;
use crate::device::cpu::ops::{ActivationMode, Q8Part, WeightRows};
use crate::device::cpu::packed::{self, Packed};
use crate::device::cpu::quant::{self, Format};
use crate::errors;

/// How the CPU holds the weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum WeightDtype {
    /// As stored in the file (bf16, f16, GGUF blocks), computed on as stored.
    #[default]
    Stored,
    /// Widened once to f32 at load: the reference mode.
    F32,
    /// As stored, and (CPU) every matmul on Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K
    /// rows quantises its input
    /// activations per block of 32 (two 8-bit planes, 15 bits) and runs integer dot
    /// products on rows repacked at load: faster, still batch-invariant, but NOT bitwise
    /// equal to `stored` (agreement is measured, docs/cpu.md).
    Q8,
}

impl WeightDtype {
    /// Its name in flags and reports (`--dtype`'s value).
    pub const fn name(self) -> &'static str {
        match self {
            WeightDtype::Stored => "stored",
            WeightDtype::F32 => "f32",
            WeightDtype::Q8 => "q8",
        }
    }
}

/// A weight matrix's row-major shape: `out_features` rows of `in_features` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatShape {
    pub out_features: usize,
    pub in_features: usize,
}

/// Stored bytes: a range of a memory-mapped file, or owned.
enum Bytes {
    Mapped {
        map: Arc<ModelMap>,
        range: Range<usize>,
    },
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped { map, range } => &map[range.clone()],
            Bytes::Owned(v) => v,
        }
    }

    /// Bytes in memory now: owned bytes all; mapped ones by the pages the kernel holds
    /// (`mincore`), counted whole (a page shared with a neighbour counts for both).
    fn resident(&self) -> usize {
        let Bytes::Mapped { map, range } = self else {
            return self.as_slice().len();
        };
        if range.is_empty() {
            return 0;
        }
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
        let base = map.as_ptr() as usize; // page-aligned: mmap returns page-aligned maps
        let start = (base + range.start) / page * page;
        let end = base + range.end;
        let pages = (end - start).div_ceil(page);
        let mut vec = vec![0u8; pages];
        // SAFETY: [start, start + pages·page) lies inside the live map (its end rounded up
        // to the page, which the map covers); `vec` has one byte per page.
        let rc =
            unsafe { libc::mincore(start as *mut libc::c_void, pages * page, vec.as_mut_ptr()) };
        if rc != 0 {
            return range.len(); // unknown: count it all
        }
        let in_core = vec.iter().filter(|&&b| b & 1 == 1).count();
        (in_core * page).min(range.len())
    }

    /// Hands mapped pages already read back to the kernel (they stay in the page cache):
    /// after a repack nothing reads them, and they would count in this process's memory
    /// beside the copy. A page shared with a neighbouring tensor is read again from the
    /// cache if that one needs it (the map is read-only, so nothing is lost).
    fn release(&self) {
        let Bytes::Mapped { map, range } = self else {
            return;
        };
        if range.is_empty() {
            return;
        }
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
        let base = map.as_ptr() as usize; // page-aligned: mmap returns page-aligned maps
        let start = (base + range.start) / page * page;
        let len = base + range.end - start;
        // SAFETY: [start, start + len) lies inside the live, read-only map; dropping its
        // pages only makes the next read (if any) fault them in from the file again.
        unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_DONTNEED) };
    }
}

/// Consecutive rows of a weight in one format.
enum Segment {
    F32 {
        rows: usize,
        data: Vec<f32>,
    }, // [rows, cols]
    Stored {
        rows: usize,
        format: Format,
        bytes: Bytes,
    },
    /// Rows of a format with an integer kernel repacked at load for the `q8` mode (owned; the
    /// same values: `packed.rs`).
    Packed(Packed),
}

impl Segment {
    fn rows(&self) -> usize {
        match self {
            Segment::F32 { rows, .. } | Segment::Stored { rows, .. } => *rows,
            Segment::Packed(p) => p.rows(),
        }
    }

    fn format(&self) -> Format {
        match self {
            Segment::F32 { .. } => Format::F32,
            Segment::Stored { format, .. } => *format,
            Segment::Packed(p) => p.format(),
        }
    }

    /// Row `r` (of this segment) as f32 into `out[cols]`.
    fn row_f32(&self, r: usize, out: &mut [f32]) {
        let cols = out.len();
        match self {
            Segment::F32 { data, .. } => out.copy_from_slice(&data[r * cols..(r + 1) * cols]),
            Segment::Stored { format, bytes, .. } => {
                let rb = format.row_bytes(cols).expect("checked at construction");
                quant::dequantize(*format, &bytes.as_slice()[r * rb..(r + 1) * rb], out);
            }
            Segment::Packed(p) => quant::dequantize(p.format(), &unpacked_row(p, r, cols), out),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Segment::F32 { data, .. } => 4 * data.len(),
            Segment::Stored { bytes, .. } => bytes.as_slice().len(),
            Segment::Packed(p) => p.bytes(),
        }
    }

    fn resident(&self) -> usize {
        match self {
            Segment::F32 { data, .. } => 4 * data.len(),
            Segment::Stored { bytes, .. } => bytes.resident(),
            Segment::Packed(p) => p.bytes(),
        }
    }
}

/// Row `r` of a repacked segment of `cols`-value rows, as stored.
fn unpacked_row(p: &Packed, r: usize, cols: usize) -> Vec<u8> {
    let mut row = vec![0u8; p.format().row_bytes(cols).expect("checked at construction")];
    p.unpack_row(r, &mut row);
    row
}

/// A weight matrix `[out_features, in_features]` held as stored: one or more row segments
/// (a fused matrix keeps each part's format), each f32, 16-bit or GGUF blocks.
pub struct Weight {
    cols: usize,
    segments: Vec<Segment>,
    /// How `linear` treats the inputs this weight multiplies.
    acts: ActivationMode,
}

impl Weight {
    /// An f32 matrix `data[shape]`.
    pub fn f32(data: Vec<f32>, shape: MatShape) -> Self {
        assert_eq!(data.len(), shape.out_features * shape.in_features);
        Self {
            cols: shape.in_features,
            segments: vec![Segment::F32 {
                rows: shape.out_features,
                data,
            }],
            acts: ActivationMode::F32,
        }
    }

    /// `shape` in `format` from `bytes` (whole rows of whole blocks).
    fn stored(format: Format, bytes: Bytes, shape: MatShape) -> Result<Self> {
        let MatShape {
            out_features: rows,
            in_features: cols,
        } = shape;
        let Some(rb) = format.row_bytes(cols) else {
            bail!(
                "rows of {cols} values are not whole {}-value blocks of {format}",
                format.block_elems()
            );
        };
        if rows.checked_mul(rb) != Some(bytes.as_slice().len()) {
            bail!(
                "{} bytes are not {rows} rows of {cols} {format} values",
                bytes.as_slice().len()
            );
        }
        Ok(Self {
            cols,
            segments: vec![Segment::Stored {
                rows,
                format,
                bytes,
            }],
            acts: ActivationMode::F32,
        })
    }

    pub fn shape(&self) -> MatShape {
        MatShape {
            out_features: self.segments.iter().map(Segment::rows).sum(),
            in_features: self.cols,
        }
    }

    /// The rows of `parts` in order, as one matrix (no copy: each part stays a segment).
    fn concat(parts: Vec<Weight>) -> Self {
        let cols = parts[0].cols;
        assert!(
            parts.iter().all(|p| p.cols == cols),
            "concat: widths differ"
        );
        let acts = parts[0].acts;
        assert!(
            parts.iter().all(|p| p.acts == acts),
            "concat: activation modes differ"
        );
        Self {
            cols,
            segments: parts.into_iter().flat_map(|p| p.segments).collect(),
            acts,
        }
    }

    /// The rows in `parts` equal runs, each its own matrix (no copy of mapped bytes): a
    /// stack of experts `[experts, out, in]` as one weight per expert. Every part starts
    /// inside one segment (a loaded tensor has one).
    fn split_rows(self, parts: usize) -> Vec<Weight> {
        let rows = self.shape().out_features;
        assert!(
            parts > 0 && rows.is_multiple_of(parts),
            "split_rows: {rows} rows in {parts} parts"
        );
        let (n, cols, acts) = (rows / parts, self.cols, self.acts);
        let [segment] = <[Segment; 1]>::try_from(self.segments)
            .ok()
            .expect("split_rows: one segment");
        let part = |p: usize| -> Segment {
            match &segment {
                Segment::F32 { data, .. } => Segment::F32 {
                    rows: n,
                    data: data[p * n * cols..(p + 1) * n * cols].to_vec(),
                },
                Segment::Stored { format, bytes, .. } => {
                    let rb = format.row_bytes(cols).expect("checked at construction");
                    let (a, b) = (p * n * rb, (p + 1) * n * rb);
                    let bytes = match bytes {
                        Bytes::Mapped { map, range } => Bytes::Mapped {
                            map: Arc::clone(map),
                            range: range.start + a..range.start + b,
                        },
                        Bytes::Owned(v) => Bytes::Owned(v[a..b].to_vec()),
                    };
                    Segment::Stored {
                        rows: n,
                        format: *format,
                        bytes,
                    }
                }
                Segment::Packed(_) => unreachable!("split_rows on a freshly loaded weight"),
            }
        };
        (0..parts)
            .map(|p| Weight {
                cols,
                segments: vec![part(p)],
                acts,
            })
            .collect()
    }

    /// Row `r` as f32 into `out[in_features]` (the embedding gather).
    pub fn row_f32(&self, mut r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols, "row_f32: out is not one row");
        for s in &self.segments {
            if r < s.rows() {
                return s.row_f32(r, out);
            }
            r -= s.rows();
        }
        panic!("row_f32: row out of range");
    }

    /// The whole matrix in f32, `[out_features, in_features]`.
    pub fn to_f32(&self) -> Vec<f32> {
        let n = self.shape().out_features;
        let mut out = vec![0.0f32; n * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols.max(1)).enumerate() {
            self.row_f32(r, row);
        }
        out
    }

    /// The whole matrix in f32, held so (the reference mode).
    pub fn widened(&self) -> Self {
        Self::f32(self.to_f32(), self.shape())
    }

    /// The same rows, with `linear` treating its inputs as `acts`.
    pub fn with_activations(mut self, acts: ActivationMode) -> Self {
        self.acts = acts;
        self
    }

    /// The matrix rounded to bf16, row by row (no f32 copy of the whole tensor): bf16
    /// segments are copied as they are.
    pub fn to_bf16_bits(&self) -> Vec<u16> {
        let shape = self.shape();
        let mut out = Vec::with_capacity(shape.out_features * self.cols);
        let mut row = vec![0.0f32; self.cols];
        for s in &self.segments {
            if let Segment::Stored {
                format: Format::Bf16,
                bytes,
                ..
            } = s
            {
                let b = bytes.as_slice();
                out.extend(b.chunks_exact(2).map(|x| u16::from_le_bytes([x[0], x[1]])));
                continue;
            }
            for r in 0..s.rows() {
                s.row_f32(r, &mut row);
                out.extend(row.iter().map(|&x| crate::device::bf16::f32_to_bf16(x)));
            }
        }
        out
    }

    /// Bytes held (mapped or owned).
    pub fn bytes(&self) -> usize {
        self.segments.iter().map(Segment::bytes).sum()
    }

    /// Bytes in memory now (mapped pages not yet read, or evicted, do not count).
    pub fn resident_bytes(&self) -> usize {
        self.segments.iter().map(Segment::resident).sum()
    }

    /// Each segment's format and its bytes.
    pub fn formats(&self) -> impl Iterator<Item = (Format, usize)> + '_ {
        self.segments.iter().map(|s| (s.format(), s.bytes()))
    }

    /// Feeds the format and stored bytes of every segment (a fingerprint of the values).
    pub fn hash_into(&self, crc: &mut crc32fast::Hasher) {
        for s in &self.segments {
            crc.update(s.format().name().as_bytes());
            match s {
                // SAFETY: f32 has no padding; viewing its bytes is sound.
                Segment::F32 { data, .. } => crc.update(unsafe {
                    std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), data.len() * 4)
                }),
                Segment::Stored { bytes, .. } => crc.update(bytes.as_slice()),
                // The stored bytes, so a repack leaves the fingerprint of the values alone.
                Segment::Packed(p) => {
                    for r in 0..p.rows() {
                        crc.update(&unpacked_row(p, r, self.cols));
                    }
                }
            }
        }
        // The q8 mode computes other K/V from the same weights: not the same model.
        if self.acts == ActivationMode::Q8 {
            crc.update(b"activations: q8");
        }
    }

    /// Repacks every segment of a format with an integer kernel (`packed::supports`)
    /// and releases the mapped pages the repack read. Memory: the copy (the stored size);
    /// the file's pages leave this process. Other segments stay as they are.
    pub fn repack_for_q8(&mut self) {
        for s in &mut self.segments {
            if let Segment::Stored {
                rows,
                format,
                bytes,
            } = s
            {
                if packed::supports(*format) {
                    let p = Packed::pack(*format, bytes.as_slice(), *rows, self.cols);
                    bytes.release();
                    *s = Segment::Packed(p);
                }
            }
        }
    }

    /// A single-segment weight with its rows reordered: row `dst` is row `src_of(dst)`.
    fn permuted_rows(&self, src_of: impl Fn(usize) -> usize) -> Self {
        let [seg] = self.segments.as_slice() else {
            unreachable!("permuted_rows: a loaded tensor is one segment");
        };
        let (rows, cols) = (seg.rows(), self.cols);
        let segment = match seg {
            Segment::F32 { data, .. } => Segment::F32 {
                rows,
                data: (0..rows)
                    .flat_map(|d| &data[src_of(d) * cols..(src_of(d) + 1) * cols])
                    .copied()
                    .collect(),
            },
            Segment::Packed(_) => {
                unreachable!("permuted_rows: rows are unpermuted before a repack")
            }
            Segment::Stored { format, bytes, .. } => {
                let rb = format.row_bytes(cols).expect("checked at construction");
                let b = bytes.as_slice();
                Segment::Stored {
                    rows,
                    format: *format,
                    bytes: Bytes::Owned(
                        (0..rows)
                            .flat_map(|d| &b[src_of(d) * rb..(src_of(d) + 1) * rb])
                            .copied()
                            .collect(),
                    ),
                }
            }
        };
        Self {
            cols,
            segments: vec![segment],
            acts: self.acts,
        }
    }
}

impl WeightRows for Weight {
    fn out_in(&self) -> (usize, usize) {
        (self.shape().out_features, self.cols)
    }

    fn rows_f32<'s>(&'s self, rows: Range<usize>, scratch: &'s mut Vec<f32>) -> &'s [f32] {
        // Borrow when the rows lie in one f32 segment.
        let mut first = rows.start;
        for s in &self.segments {
            if first < s.rows() {
                if let Segment::F32 { rows: n, data } = s {
                    if first + rows.len() <= *n {
                        return &data[first * self.cols..(first + rows.len()) * self.cols];
                    }
                }
                break;
            }
            first -= s.rows();
        }
        scratch.resize(rows.len() * self.cols, 0.0);
        for (r, out) in rows.zip(scratch.chunks_exact_mut(self.cols)) {
            self.row_f32(r, out);
        }
        scratch
    }

    fn stored_rows(&self, rows: Range<usize>) -> Option<StoredRows<'_>> {
        let mut first = rows.start;
        for s in &self.segments {
            if first < s.rows() {
                let Segment::Stored {
                    rows: n,
                    format,
                    bytes,
                } = s
                else {
                    return None;
                };
                if first + rows.len() > *n {
                    return None; // spans two parts: the tile path reads it
                }
                let rb = format
                    .row_bytes(self.cols)
                    .expect("checked at construction");
                return Some(StoredRows {
                    format: *format,
                    bytes: &bytes.as_slice()[first * rb..(first + rows.len()) * rb],
                    cols: self.cols,
                });
            }
            first -= s.rows();
        }
        None
    }

    fn activations(&self) -> ActivationMode {
        self.acts
    }

    fn q8_parts(&self) -> Vec<Q8Part<'_>> {
        let mut first = 0;
        self.segments
            .iter()
            .map(|s| {
                let rows = first..first + s.rows();
                first = rows.end;
                let packed = match s {
                    Segment::Packed(p) => Some(p.as_rows()),
                    _ => None,
                };
                Q8Part { rows, packed }
            })
            .collect()
    }
}

/// One decoder layer's weights, row-major `[out, in]` as Hugging Face stores them.
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,      // [hidden]
    pub wqkv: Weight,             // [q_dim + 2 * kv_dim, hidden]  rows: q, then k, then v
    pub bqkv: Option<Vec<f32>>,   // [q_dim + 2 * kv_dim]
    pub q_norm: Option<Vec<f32>>, // [head_dim] (Qwen3)
    pub k_norm: Option<Vec<f32>>, // [head_dim] (Qwen3)
    pub wo: Weight,               // [hidden, q_dim]
    pub bo: Option<Vec<f32>>,     // [hidden] (gpt-oss)
    /// The attention sinks' logits, `[num_heads]` (gpt-oss).
    pub sinks: Option<Vec<f32>>,
    pub mlp_norm: Vec<f32>, // [hidden]
    pub mlp: Mlp,
    /// Gemma's sandwich norms on the attention and MLP outputs, `[hidden]` each.
    pub post_norms: Option<(Vec<f32>, Vec<f32>)>,
    /// A state layer's recurrence (`LayerKind::State`); its `wqkv` is then the fused input
    /// projection `[q | k | v | z | b | a]` (`DeltaShape::proj_width` rows) and `wo` the
    /// `out_proj` `[hidden, v_heads · dv]`. An attention layer's `wqkv` rows are
    /// `[q | k | v]`, then with `attn_output_gate` the per-head gates `[heads · head_dim]`.
    pub delta: Option<DeltaWeights>,
}

/// A Gated DeltaNet layer's parameters beside its projections (`model::delta_net`).
pub struct DeltaWeights {
    pub conv: Vec<f32>, // [conv_channels, kernel]  the depthwise causal conv's taps
    /// `A = −exp(A_log)` per value head: how fast each head's state decays.
    pub decay_rate: Vec<f32>, // [v_heads]
    pub dt_bias: Vec<f32>, // [v_heads]
    pub norm: Vec<f32>, // [dv]  the gated RMSNorm's weight (plain, not 1 + w)
}

/// A layer's feed-forward block.
pub enum Mlp {
    /// One gated MLP for every token.
    Dense {
        gate_up: Weight, // [2 * inter, hidden]  rows: gate, then up
        down: Weight,    // [hidden, inter]
    },
    /// A router choosing `Moe::top_k` experts per token (`ModelConfig::moe`).
    Experts(Experts),
}

/// A mixture of experts: the router and every expert, each a gated MLP with biases.
pub struct Experts {
    pub router: Weight,                // [num_experts, hidden]
    pub router_bias: Option<Vec<f32>>, // [num_experts] (gpt-oss)
    pub experts: Vec<Expert>,
    /// Qwen3.5 MoE: an expert every token runs, scaled by σ(`gate` · x).
    pub shared: Option<SharedExpert>,
}

pub struct Expert {
    pub gate_up: Weight,                // [2 * inter, hidden]  rows: gate, then up
    pub gate_up_bias: Option<Vec<f32>>, // [2 * inter] (gpt-oss)
    pub down: Weight,                   // [hidden, inter]
    pub down_bias: Option<Vec<f32>>,    // [hidden] (gpt-oss)
}

/// A mixture's shared expert: a gated SwiGLU MLP and the gate of its output.
pub struct SharedExpert {
    pub gate_up: Weight, // [2 * shared_inter, hidden]  rows: gate, then up
    pub down: Weight,    // [hidden, shared_inter]
    pub gate: Weight,    // [1, hidden]
}

impl Mlp {
    /// A dense MLP's gate/up and down matrices (`None` for experts).
    pub fn dense(&self) -> Option<(&Weight, &Weight)> {
        match self {
            Mlp::Dense { gate_up, down } => Some((gate_up, down)),
            Mlp::Experts(_) => None,
        }
    }

    /// Its matrices: gate/up then down (the router first, then each expert's).
    pub fn matrices(&self) -> Vec<&Weight> {
        match self {
            Mlp::Dense { gate_up, down } => vec![gate_up, down],
            Mlp::Experts(x) => std::iter::once(&x.router)
                .chain(x.experts.iter().flat_map(|e| [&e.gate_up, &e.down]))
                .chain(x.shared.iter().flat_map(|s| [&s.gate_up, &s.down, &s.gate]))
                .collect(),
        }
    }

    fn matrices_mut(&mut self) -> Vec<&mut Weight> {
        match self {
            Mlp::Dense { gate_up, down } => vec![gate_up, down],
            Mlp::Experts(x) => std::iter::once(&mut x.router)
                .chain(
                    x.experts
                        .iter_mut()
                        .flat_map(|e| [&mut e.gate_up, &mut e.down]),
                )
                .chain(
                    x.shared
                        .iter_mut()
                        .flat_map(|s| [&mut s.gate_up, &mut s.down, &mut s.gate]),
                )
                .collect(),
        }
    }

    /// Its f32 vectors (the biases of a mixture of experts).
    fn vectors(&self) -> Vec<&Vec<f32>> {
        match self {
            Mlp::Dense { .. } => vec![],
            Mlp::Experts(x) => x
                .router_bias
                .iter()
                .chain(
                    x.experts
                        .iter()
                        .flat_map(|e| e.gate_up_bias.iter().chain(&e.down_bias)),
                )
                .collect(),
        }
    }

    /// Bytes held: its matrices as stored and its f32 vectors.
    pub fn bytes(&self) -> usize {
        self.matrices()
            .into_iter()
            .map(Weight::bytes)
            .sum::<usize>()
            + self
                .vectors()
                .into_iter()
                .map(|v| 4 * v.len())
                .sum::<usize>()
    }

    /// Bytes one token reads in its gate/up step (a router's included) and in its down
    /// step: all of a dense MLP; of experts, `top_k` experts' share.
    pub fn token_op_bytes(&self, top_k: usize) -> (usize, usize) {
        match self {
            Mlp::Dense { gate_up, down } => (gate_up.bytes(), down.bytes()),
            Mlp::Experts(x) => {
                let share = |f: fn(&Expert) -> usize| {
                    x.experts.iter().map(f).sum::<usize>() * top_k / x.experts.len().max(1)
                };
                let len = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, Vec::len);
                // The shared expert: every token reads all of it.
                let (shared_gu, shared_down) = x.shared.as_ref().map_or((0, 0), |s| {
                    (s.gate_up.bytes() + s.gate.bytes(), s.down.bytes())
                });
                (
                    x.router.bytes()
                        + 4 * len(&x.router_bias)
                        + share(|e| {
                            e.gate_up.bytes() + 4 * e.gate_up_bias.as_ref().map_or(0, Vec::len)
                        })
                        + shared_gu,
                    share(|e| e.down.bytes() + 4 * e.down_bias.as_ref().map_or(0, Vec::len))
                        + shared_down,
                )
            }
        }
    }

    /// Bytes of it one token reads: all of a dense MLP; of experts, the router and `top_k`
    /// experts' share.
    pub fn token_read_bytes(&self, top_k: usize) -> usize {
        let (gate_up, down) = self.token_op_bytes(top_k);
        gate_up + down
    }
}

pub struct ModelWeights {
    pub embed: Weight, // [vocab, hidden]
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,    // [hidden]
    pub lm_head: Option<Weight>, // [vocab, hidden]; None = tied to `embed`
}

impl ModelWeights {
    pub fn lm_head(&self) -> &Weight {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Every matrix (the tied head once).
    pub fn matrices(&self) -> impl Iterator<Item = &Weight> {
        std::iter::once(&self.embed)
            .chain(self.lm_head.as_ref())
            .chain(
                self.layers
                    .iter()
                    .flat_map(|l| [&l.wqkv, &l.wo].into_iter().chain(l.mlp.matrices())),
            )
    }

    /// Every f32 vector (norms, biases).
    pub fn vectors(&self) -> impl Iterator<Item = &Vec<f32>> {
        std::iter::once(&self.final_norm).chain(self.layers.iter().flat_map(|l| {
            [&l.attn_norm, &l.mlp_norm]
                .into_iter()
                .chain(
                    [&l.bqkv, &l.q_norm, &l.k_norm, &l.bo, &l.sinks]
                        .into_iter()
                        .flatten(),
                )
                .chain(l.post_norms.iter().flat_map(|(a, m)| [a, m]))
                .chain(
                    l.delta
                        .iter()
                        .flat_map(|d| [&d.conv, &d.decay_rate, &d.dt_bias, &d.norm]),
                )
                .chain(l.mlp.vectors())
        }))
    }

    /// Bytes of weights held, as stored (mapped or owned).
    pub fn bytes(&self) -> usize {
        self.matrices().map(Weight::bytes).sum::<usize>()
            + self.vectors().map(|v| 4 * v.len()).sum::<usize>()
    }

    /// Bytes of weights one decode token reads: every matrix and vector, except that an
    /// embedding table apart from the head contributes only the row it gathers, and a
    /// mixture of experts only its router and `top_k` experts' share (`Mlp::token_read_bytes`).
    pub fn decode_read_bytes(&self, top_k: usize) -> usize {
        // Experts a token does not choose (none of a dense MLP's bytes).
        let unread: usize = self
            .layers
            .iter()
            .map(|l| l.mlp.bytes() - l.mlp.token_read_bytes(top_k))
            .sum();
        let all = self.bytes() - unread;
        match &self.lm_head {
            None => all,
            Some(_) => {
                let embed = self.embed.bytes();
                all - embed + embed / self.embed.shape().out_features.max(1)
            }
        }
    }

    /// Bytes of weights in memory now (see `Weight::resident_bytes`).
    pub fn resident_bytes(&self) -> usize {
        self.matrices().map(Weight::resident_bytes).sum::<usize>()
            + self.vectors().map(|v| 4 * v.len()).sum::<usize>()
    }

    /// Every matrix widened to f32 (the reference mode; exact for every stored format).
    pub fn widen(&mut self) {
        for w in self.matrices_mut() {
            *w = w.widened();
        }
    }

    /// Every matrix's inputs treated as `acts` by `linear`.
    pub fn set_activations(&mut self, acts: ActivationMode) {
        for w in self.matrices_mut() {
            w.acts = acts;
        }
    }

    /// The `q8` mode: inputs quantised to two 8-bit planes (`ActivationMode::Q8`) and every
    /// matrix of a format with an integer kernel repacked for it (`Weight::repack_for_q8`).
    pub fn to_q8_mode(&mut self) {
        self.set_activations(ActivationMode::Q8);
        for w in self.matrices_mut() {
            w.repack_for_q8();
        }
    }

    /// Bytes of weights repacked at load (`Weight::repack_for_q8`), owned.
    pub fn repacked_bytes(&self) -> usize {
        self.matrices()
            .flat_map(|w| &w.segments)
            .filter(|s| matches!(s, Segment::Packed(_)))
            .map(Segment::bytes)
            .sum()
    }

    fn matrices_mut(&mut self) -> impl Iterator<Item = &mut Weight> {
        std::iter::once(&mut self.embed)
            .chain(self.lm_head.as_mut())
            .chain(self.layers.iter_mut().flat_map(|l| {
                [&mut l.wqkv, &mut l.wo]
                    .into_iter()
                    .chain(l.mlp.matrices_mut())
            }))
    }

    /// The load line: bytes held per format, and any repacking.
    pub fn describe(&self) -> String {
        let mut by: Vec<(Format, usize)> = Vec::new();
        for (f, b) in self.matrices().flat_map(Weight::formats) {
            match by.iter_mut().find(|(g, _)| *g == f) {
                Some((_, n)) => *n += b,
                None => by.push((f, b)),
            }
        }
        let vec_bytes: usize = self.vectors().map(|v| 4 * v.len()).sum();
        let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
        let parts: Vec<String> = by
            .iter()
            .map(|(f, b)| format!("{f} {:.1}", mib(*b)))
            .chain(std::iter::once(format!(
                "f32 vectors {:.1}",
                mib(vec_bytes)
            )))
            .collect();
        let mut line = format!(
            "weights: {:.1} MiB held ({} MiB)",
            mib(self.bytes()),
            parts.join(", ")
        );
        let repacked = self.repacked_bytes();
        if repacked > 0 {
            line += &format!(
                "; {:.1} MiB of it repacked for the integer kernels (owned, the file's pages released)",
                mib(repacked)
            );
        }
        line
    }
}

/// A loaded tensor: its shape (outermost dim first) and data as stored.
struct Loaded {
    shape: Vec<usize>,
    weight: Weight,
}

/// A named-tensor store that yields tensors as stored, with their shape (outermost dim
/// first); a tensor's rows are its innermost dim.
trait TensorSource {
    fn has(&self, name: &str) -> bool;
    /// The stored shape (outermost dim first), read from the header without loading data.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    fn load(&mut self, name: &str) -> Result<Loaded>;
}

/// `[outer dims.., inner]` as a matrix of `inner`-wide rows (a vector is one row).
fn mat_shape(shape: &[usize]) -> MatShape {
    let in_features = shape.last().copied().unwrap_or(1);
    MatShape {
        out_features: shape[..shape.len().saturating_sub(1)].iter().product(),
        in_features,
    }
}

/// A layer's tensor name from its index and part (`"q"`, `"mlp_norm"`, ...).
type LayerName = Box<dyn Fn(usize, &str) -> String>;

/// Tensor names of one checkpoint family.
struct Names {
    embed: String,
    final_norm: String,
    lm_head: String,
    layer: LayerName,
    /// Added to every norm weight as read: Gemma's Hugging Face checkpoints store `w` for a
    /// norm that scales by `1 + w` (its GGUF converter adds the 1 itself).
    norm_offset: f32,
    /// How a mixture of experts stores its experts.
    experts: ExpertLayout,
    /// Which converter wrote the tensors (their forms beyond the names).
    layout: Layout,
}

/// The two writers of checkpoints, where they store a tensor in different forms.
#[derive(Clone, Copy, PartialEq)]
enum Layout {
    /// Hugging Face's: a Gated DeltaNet's `A_log` (its decay rate is `−exp(A_log)`), its
    /// conv kernel `[channels, 1, kernel]`, the shared expert's gate `[1, hidden]`.
    Hf,
    /// llama.cpp's: `ssm_a` holds `−exp(A_log)` itself, the conv kernel `[channels,
    /// kernel]`, the shared expert's gate `[hidden]`.
    Gguf,
}

/// How a checkpoint family stores a mixture of experts' weights.
#[derive(Clone, Copy, PartialEq)]
enum ExpertLayout {
    /// transformers' gpt-oss: `gate_up_proj[e]` `[hidden, 2 * inter]` (x @ W), gate and up
    /// interleaved by column, its bias likewise; `down_proj[e]` `[inter, hidden]`.
    HfFusedTransposed,
    /// llama.cpp's: `ffn_{gate,up}_exps` `[experts, inter, hidden]`, `ffn_down_exps`
    /// `[experts, hidden, inter]` (each expert's rows as a dense layer's), biases
    /// `[experts, out]`.
    Split,
    /// Qwen's checkpoints: `experts.{x}.{gate,up,down}_proj.weight` per expert (a dense
    /// layer's each), no biases; a shared expert and its gate.
    PerExpert,
}

/// A Hugging Face checkpoint's names under `prefix` (`model.`, or a multimodal Gemma 3's
/// `model.language_model.` / `language_model.model.`); Gemma 3 names its norms its own way.
/// `zero_centred`: the norms hold `w` and scale by `1 + w` (Gemma 3, Qwen3.5).
fn hf_names(prefix: &str, head: &str, arch: Arch) -> Names {
    let gemma = arch == Arch::Gemma3;
    let qwen = arch == Arch::Qwen35;
    let zero_centred = gemma || qwen;
    let prefix = prefix.to_string();
    Names {
        embed: format!("{prefix}embed_tokens.weight"),
        final_norm: format!("{prefix}norm.weight"),
        lm_head: head.to_string(),
        layer: Box::new(move |i, part| {
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
                "mlp_norm" if gemma => "pre_feedforward_layernorm.weight",
                "mlp_norm" => "post_attention_layernorm.weight",
                "post_attn_norm" => "post_attention_layernorm.weight",
                "post_mlp_norm" => "post_feedforward_layernorm.weight",
                "gate" => "mlp.gate_proj.weight",
                "up" => "mlp.up_proj.weight",
                "down" => "mlp.down_proj.weight",
                "o_bias" => "self_attn.o_proj.bias",
                "sinks" => "self_attn.sinks",
                "router" if qwen => "mlp.gate.weight",
                "router" => "mlp.router.weight",
                "experts" => "mlp.experts",
                "shared_gate" => "mlp.shared_expert.gate_proj.weight",
                "shared_up" => "mlp.shared_expert.up_proj.weight",
                "shared_down" => "mlp.shared_expert.down_proj.weight",
                "shared_expert_gate" => "mlp.shared_expert_gate.weight",
                "router_bias" => "mlp.router.bias",
                "experts_gate_up" => "mlp.experts.gate_up_proj",
                "experts_gate_up_bias" => "mlp.experts.gate_up_proj_bias",
                "experts_down" => "mlp.experts.down_proj",
                "experts_down_bias" => "mlp.experts.down_proj_bias",
                "lin_qkv" => "linear_attn.in_proj_qkv.weight",
                "lin_z" => "linear_attn.in_proj_z.weight",
                "lin_b" => "linear_attn.in_proj_b.weight",
                "lin_a" => "linear_attn.in_proj_a.weight",
                "lin_conv" => "linear_attn.conv1d.weight",
                "lin_a_log" => "linear_attn.A_log",
                "lin_dt_bias" => "linear_attn.dt_bias",
                "lin_norm" => "linear_attn.norm.weight",
                "lin_out" => "linear_attn.out_proj.weight",
                _ => unreachable!("unknown weight part {part}"),
            };
            format!("{prefix}layers.{i}.{p}")
        }),
        norm_offset: if zero_centred { 1.0 } else { 0.0 },
        experts: if qwen {
            ExpertLayout::PerExpert
        } else {
            ExpertLayout::HfFusedTransposed
        },
        layout: Layout::Hf,
    }
}

/// llama.cpp's names; gpt-oss's and Qwen3.5's MLP input norm is their
/// `post_attention_norm`.
fn gguf_names(arch: Arch) -> Names {
    let post_attn_is_mlp_norm = matches!(arch, Arch::GptOss | Arch::Qwen35);
    Names {
        embed: "token_embd.weight".into(),
        final_norm: "output_norm.weight".into(),
        lm_head: "output.weight".into(),
        layer: Box::new(move |i, part| {
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
                "mlp_norm" if post_attn_is_mlp_norm => "post_attention_norm.weight",
                "mlp_norm" => "ffn_norm.weight",
                "post_attn_norm" => "post_attention_norm.weight",
                "post_mlp_norm" => "post_ffw_norm.weight",
                "gate" => "ffn_gate.weight",
                "up" => "ffn_up.weight",
                "down" => "ffn_down.weight",
                "o_bias" => "attn_output.bias",
                "sinks" => "attn_sinks.weight",
                "router" => "ffn_gate_inp.weight",
                "router_bias" => "ffn_gate_inp.bias",
                "experts_gate" => "ffn_gate_exps.weight",
                "experts_up" => "ffn_up_exps.weight",
                "experts_down" => "ffn_down_exps.weight",
                "experts_gate_bias" => "ffn_gate_exps.bias",
                "experts_up_bias" => "ffn_up_exps.bias",
                "experts_down_bias" => "ffn_down_exps.bias",
                "shared_gate" => "ffn_gate_shexp.weight",
                "shared_up" => "ffn_up_shexp.weight",
                "shared_down" => "ffn_down_shexp.weight",
                "shared_expert_gate" => "ffn_gate_inp_shexp.weight",
                "lin_qkv" => "attn_qkv.weight",
                "lin_z" => "attn_gate.weight",
                "lin_b" => "ssm_beta.weight",
                "lin_a" => "ssm_alpha.weight",
                "lin_conv" => "ssm_conv1d.weight",
                "lin_decay" => "ssm_a",
                "lin_dt_bias" => "ssm_dt.bias",
                "lin_norm" => "ssm_norm.weight",
                "lin_out" => "ssm_out.weight",
                _ => unreachable!("unknown weight part {part}"),
            };
            format!("blk.{i}.{p}")
        }),
        norm_offset: 0.0,
        experts: ExpertLayout::Split,
        layout: Layout::Gguf,
    }
}

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
    let last_layer = (names.layer)(cfg.num_layers - 1, "attn_norm");
    if !src.has(&last_layer) {
        bail!(
            "the config names {} layers but the weights have no `{last_layer}`",
            cfg.num_layers
        );
    }
    let per_layer = 9
        + 2 * cfg.qk_norm as usize
        + 2 * cfg.sandwich_norms as usize
        + 3 * cfg.attention_bias as usize
        + cfg.out_bias as usize
        + cfg.attn_sinks as usize
        + 3 * cfg.moe.is_some() as usize;
    let bar = progress_bar(progress, (cfg.num_layers * per_layer + 3) as u64);
    let has_lm_head = src.has(&names.lm_head);
    let hf_experts = names.experts == ExpertLayout::HfFusedTransposed;
    if cfg.moe.is_some()
        && hf_experts
        && src.has(&format!("{}_blocks", (names.layer)(0, "experts_gate_up")))
    {
        bail!("the experts are stored as MXFP4 (`*_blocks`, `*_scales`), which is not supported yet: use a bf16 checkpoint (transformers' `Mxfp4Config(dequantize=True)` writes one)");
    }
    let mut get = |name: &str, shape: &[usize]| -> Result<Weight> {
        let Some(got) = src.shape(name) else {
            bail!("missing tensor `{name}` in the weights");
        };
        // Checked before the data is read, so a wrong tensor costs nothing to refuse.
        if got != shape {
            bail!("tensor `{name}` has shape {got:?}, expected {shape:?}");
        }
        let loaded = src.load(name).with_context(|| format!("tensor `{name}`"))?;
        if loaded.shape != shape || loaded.weight.shape() != mat_shape(shape) {
            bail!(
                "tensor `{name}` has shape {:?}, expected {shape:?}",
                loaded.shape
            );
        }
        bar.inc(1);
        Ok(loaded.weight)
    };
    let embed = get(&names.embed, &[cfg.vocab_size, h])?;
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let n = |p: &str| (names.layer)(i, p);
        // A vector as stored, plus `offset` (a norm's `norm_offset`).
        let mut vector = |p: &str, len: usize, offset: f32| {
            get(&n(p), &[len]).map(|w| w.to_f32().into_iter().map(|x| x + offset).collect())
        };
        let off = names.norm_offset;
        let state = cfg.state(i);
        let bqkv = if cfg.attention_bias && state.is_none() {
            let mut b: Vec<f32> = vector("q_bias", q, 0.0)?;
            b.extend(vector("k_bias", kv, 0.0)?);
            b.extend(vector("v_bias", kv, 0.0)?);
            Some(b)
        } else {
            None
        };
        let (q_norm, k_norm) = if cfg.qk_norm && state.is_none() {
            (
                Some(vector("q_norm", cfg.head_dim, off)?),
                Some(vector("k_norm", cfg.head_dim, off)?),
            )
        } else {
            (None, None)
        };
        let attn_norm = vector("attn_norm", h, off)?;
        let mlp_norm = vector("mlp_norm", h, off)?;
        let post_norms = if cfg.sandwich_norms {
            Some((
                vector("post_attn_norm", h, off)?,
                vector("post_mlp_norm", h, off)?,
            ))
        } else {
            None
        };
        let bo = match cfg.out_bias && state.is_none() {
            true => Some(vector("o_bias", h, 0.0)?),
            false => None,
        };
        let sinks = match cfg.attn_sinks && state.is_none() {
            true => Some(vector("sinks", cfg.num_heads, 0.0)?),
            false => None,
        };
        let mut delta = match state {
            Some(s) => Some(DeltaWeights {
                decay_rate: match names.layout {
                    Layout::Hf => {
                        let a_log: Vec<f32> = vector("lin_a_log", s.v_heads, 0.0)?;
                        a_log.into_iter().map(|x| -x.exp()).collect()
                    }
                    Layout::Gguf => vector("lin_decay", s.v_heads, 0.0)?,
                },
                dt_bias: vector("lin_dt_bias", s.v_heads, 0.0)?,
                norm: vector("lin_norm", s.dv, 0.0)?,
                conv: Vec::new(), // read below, once `vector` is done
            }),
            None => None,
        };
        let router_bias = match cfg.moe {
            Some(moe) if moe.biases => Some(vector("router_bias", moe.num_experts, 0.0)?),
            _ => None,
        };
        if let (Some(d), Some(s)) = (delta.as_mut(), state) {
            let (c, k) = (s.conv_channels(), s.kernel);
            let shape = match names.layout {
                Layout::Hf => vec![c, 1, k],
                Layout::Gguf => vec![c, k],
            };
            d.conv = get(&n("lin_conv"), &shape)?.to_f32();
        }
        let (wqkv, wo) = match state {
            Some(s) => (
                Weight::concat(vec![
                    get(&n("lin_qkv"), &[s.conv_channels(), h])?,
                    get(&n("lin_z"), &[s.v_heads * s.dv, h])?,
                    get(&n("lin_b"), &[s.v_heads, h])?,
                    get(&n("lin_a"), &[s.v_heads, h])?,
                ]),
                get(&n("lin_out"), &[h, s.v_heads * s.dv])?,
            ),
            None if cfg.attn_output_gate => {
                // The file holds `[q | gate]` per head: de-interleaved into all the q
                // heads, then k and v, then all the gates.
                let parts = get(&n("q"), &[2 * q, h])?.split_rows(2 * cfg.num_heads);
                let (mut qs, mut gates) = (Vec::new(), Vec::new());
                for (j, part) in parts.into_iter().enumerate() {
                    if j % 2 == 0 {
                        qs.push(part)
                    } else {
                        gates.push(part)
                    }
                }
                qs.push(get(&n("k"), &[kv, h])?);
                qs.push(get(&n("v"), &[kv, h])?);
                qs.extend(gates);
                (Weight::concat(qs), get(&n("o"), &[h, q])?)
            }
            None => (
                Weight::concat(vec![
                    get(&n("q"), &[q, h])?,
                    get(&n("k"), &[kv, h])?,
                    get(&n("v"), &[kv, h])?,
                ]),
                get(&n("o"), &[h, q])?,
            ),
        };
        let mlp = match cfg.moe {
            None => Mlp::Dense {
                gate_up: Weight::concat(vec![
                    get(&n("gate"), &[inter, h])?,
                    get(&n("up"), &[inter, h])?,
                ]),
                down: get(&n("down"), &[h, inter])?,
            },
            Some(moe) => {
                let e = moe.num_experts;
                let router = get(&n("router"), &[e, h])?;
                let shared = match moe.shared_intermediate {
                    Some(si) => Some(SharedExpert {
                        gate_up: Weight::concat(vec![
                            get(&n("shared_gate"), &[si, h])?,
                            get(&n("shared_up"), &[si, h])?,
                        ]),
                        down: get(&n("shared_down"), &[h, si])?,
                        gate: match names.layout {
                            Layout::Hf => get(&n("shared_expert_gate"), &[1, h])?,
                            Layout::Gguf => get(&n("shared_expert_gate"), &[h])?,
                        },
                    }),
                    None => None,
                };
                let experts = match names.experts {
                    ExpertLayout::PerExpert => {
                        let at = |x: usize, p: &str| format!("{}.{x}.{p}", n("experts"));
                        (0..e)
                            .map(|x| -> Result<Expert> {
                                Ok(Expert {
                                    gate_up: Weight::concat(vec![
                                        get(&at(x, "gate_proj.weight"), &[inter, h])?,
                                        get(&at(x, "up_proj.weight"), &[inter, h])?,
                                    ]),
                                    gate_up_bias: None,
                                    down: get(&at(x, "down_proj.weight"), &[h, inter])?,
                                    down_bias: None,
                                })
                            })
                            .collect::<Result<Vec<_>>>()?
                    }
                    ExpertLayout::HfFusedTransposed => {
                        let gate_up = get(&n("experts_gate_up"), &[e, h, 2 * inter])?.to_f32();
                        let gate_up_bias =
                            get(&n("experts_gate_up_bias"), &[e, 2 * inter])?.to_f32();
                        let down = get(&n("experts_down"), &[e, inter, h])?.to_f32();
                        let down_bias = get(&n("experts_down_bias"), &[e, h])?.to_f32();
                        hf_fused_experts(e, h, inter, &gate_up, &gate_up_bias, &down, &down_bias)
                    }
                    ExpertLayout::Split => {
                        let gate = get(&n("experts_gate"), &[e, inter, h])?.split_rows(e);
                        let up = get(&n("experts_up"), &[e, inter, h])?.split_rows(e);
                        let down = get(&n("experts_down"), &[e, h, inter])?.split_rows(e);
                        // [e, inter] twice and [e, h], or none.
                        let biases = match moe.biases {
                            true => Some((
                                get(&n("experts_gate_bias"), &[e, inter])?.to_f32(),
                                get(&n("experts_up_bias"), &[e, inter])?.to_f32(),
                                get(&n("experts_down_bias"), &[e, h])?.to_f32(),
                            )),
                            false => None,
                        };
                        gate.into_iter()
                            .zip(up)
                            .zip(down)
                            .enumerate()
                            .map(|(x, ((g, u), d))| Expert {
                                gate_up: Weight::concat(vec![g, u]),
                                gate_up_bias: biases.as_ref().map(|(gb, ub, _)| {
                                    [gb, ub]
                                        .iter()
                                        .flat_map(|b| &b[x * inter..][..inter])
                                        .copied()
                                        .collect()
                                }),
                                down: d,
                                down_bias: biases
                                    .as_ref()
                                    .map(|(_, _, db)| db[x * h..][..h].to_vec()),
                            })
                            .collect()
                    }
                };
                Mlp::Experts(Experts {
                    router,
                    router_bias,
                    experts,
                    shared,
                })
            }
        };
        layers.push(LayerWeights {
            attn_norm,
            wqkv,
            bqkv,
            q_norm,
            k_norm,
            wo,
            bo,
            sinks,
            mlp_norm,
            mlp,
            post_norms,
            delta,
        });
    }
    let final_norm = get(&names.final_norm, &[h])?
        .to_f32()
        .into_iter()
        .map(|x| x + names.norm_offset)
        .collect();
    // A checkpoint without an lm_head ties it to the embedding, whatever the config says.
    let lm_head = if !cfg.tie_word_embeddings && has_lm_head {
        Some(get(&names.lm_head, &[cfg.vocab_size, h])?)
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

/// transformers' gpt-oss experts (`ExpertLayout::HfFusedTransposed`, all f32) as `e`
/// experts with rows `[gate | up]` and `[hidden, inter]` down matrices.
fn hf_fused_experts(
    e: usize,
    h: usize,
    inter: usize,
    gate_up: &[f32],      // [e, h, 2 * inter]
    gate_up_bias: &[f32], // [e, 2 * inter]
    down: &[f32],         // [e, inter, h]
    down_bias: &[f32],    // [e, h]
) -> Vec<Expert> {
    // Output row r of [gate | up]: gate j is column 2j, up j column 2j + 1.
    let col = |r: usize| {
        if r < inter {
            2 * r
        } else {
            2 * (r - inter) + 1
        }
    };
    (0..e)
        .map(|x| {
            let gu = &gate_up[x * h * 2 * inter..][..h * 2 * inter];
            let gub = &gate_up_bias[x * 2 * inter..][..2 * inter];
            let d = &down[x * inter * h..][..inter * h];
            let gate_up: Vec<f32> = (0..2 * inter)
                .flat_map(|r| (0..h).map(move |c| gu[c * 2 * inter + col(r)]))
                .collect();
            let down: Vec<f32> = (0..h)
                .flat_map(|r| (0..inter).map(move |c| d[c * h + r]))
                .collect();
            let shape = |out_features, in_features| MatShape {
                out_features,
                in_features,
            };
            Expert {
                gate_up: Weight::f32(gate_up, shape(2 * inter, h)),
                gate_up_bias: Some((0..2 * inter).map(|r| gub[col(r)]).collect()),
                down: Weight::f32(down, shape(h, inter)),
                down_bias: Some(down_bias[x * h..][..h].to_vec()),
            }
        })
        .collect()
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
    files: Vec<(PathBuf, Arc<ModelMap>)>,
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
            // Truncation underneath is survivable (`mapped`).
            let mmap =
                ModelMap::map(&file).with_context(|| format!("mapping {}", path.display()))?;
            let st = safetensors::SafeTensors::deserialize(&mmap).map_err(|e| {
                anyhow::anyhow!("{}: invalid safetensors file: {e}", path.display())
            })?;
            for (tname, _) in st.tensors() {
                index.insert(tname, files.len());
            }
            files.push((path, Arc::new(mmap)));
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

    fn load(&mut self, name: &str) -> Result<Loaded> {
        let (path, mmap) = &self.files[self.index[name]];
        let st = safetensors::SafeTensors::deserialize(mmap)
            .map_err(|e| anyhow::anyhow!("{}: invalid safetensors file: {e}", path.display()))?;
        let view = st.tensor(name).map_err(|e| anyhow::anyhow!("{e}"))?;
        let bytes = view.data();
        let shape = view.shape().to_vec();
        let mat = mat_shape(&shape);
        // 16-bit data stays in the map; f32 is copied out (the map need not be 4-aligned).
        let mapped = |format| {
            let start = bytes.as_ptr() as usize - mmap.as_ptr() as usize;
            let range = start..start + bytes.len();
            Weight::stored(
                format,
                Bytes::Mapped {
                    map: Arc::clone(mmap),
                    range,
                },
                mat,
            )
        };
        let weight = match view.dtype() {
            safetensors::Dtype::F32 => Weight::f32(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
                mat,
            ),
            safetensors::Dtype::BF16 => mapped(Format::Bf16)?,
            safetensors::Dtype::F16 => mapped(Format::F16)?,
            other => bail!("unsupported dtype {other:?} (supported: f32, bf16, f16)"),
        };
        Ok(Loaded { shape, weight })
    }
}

// ---------------------------------------------------------------------------------------
// GGUF

/// A GGUF file's header: its metadata (candle's values) and its tensor table.
pub struct GgufContent {
    pub metadata: std::collections::HashMap<String, gguf_file::Value>,
    pub tensors: std::collections::HashMap<String, GgufTensor>,
    /// Where tensor data starts in the file (tensor offsets are relative to it).
    pub tensor_data_offset: u64,
}

/// One entry of the tensor table.
pub struct GgufTensor {
    /// Dimensions outermost first (rows, then columns: GGUF's order reversed).
    pub shape: Vec<usize>,
    pub format: Format,
    /// Bytes from `tensor_data_offset`.
    pub offset: u64,
}

/// Most dimensions a GGUF tensor has (ggml's `GGML_MAX_DIMS`).
const MAX_TENSOR_DIMS: u32 = 4;

pub struct GgufFile {
    pub content: GgufContent,
    /// The whole file, mapped: tensors in a format with a kernel are used in place.
    map: Arc<ModelMap>,
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
        let len = file.metadata()?.len();
        let content = read_gguf_header(&mut file, len)
            .map_err(|e| anyhow::anyhow!("{}: invalid GGUF file: {e:#}", path.display()))?;
        // Truncation underneath is survivable (`mapped`).
        let map = ModelMap::map(&file).with_context(|| format!("mapping {}", path.display()))?;
        Ok(Self {
            content,
            map: Arc::new(map),
            path: path.to_path_buf(),
        })
    }
}

/// A GGUF file's header (metadata and tensor table) from `reader` (the whole file,
/// `len` bytes), as `GgufFile::open` reads it: skimmed first for what candle's reader
/// trusts (`gguf_header`), the metadata then read by candle, the tensor table here (its
/// types are strata's formats, IQ4 ones included, which candle does not read), and the
/// table checked against the file's size. Errors say what is wrong, without the file's
/// name.
pub fn read_gguf_header<R: std::io::Read + std::io::Seek>(
    reader: &mut R,
    len: u64,
) -> Result<GgufContent> {
    use std::io::Read;
    reader.rewind()?;
    let skimmed = gguf_header::check(&mut *reader).map_err(|e| anyhow::anyhow!(e))?;
    if skimmed.alignment == Some(0) {
        bail!("general.alignment is 0");
    }
    let Some(metadata_end) = skimmed.metadata_end else {
        // Malformed metadata: candle's reader says where (it bounds lengths by the size).
        reader.rewind()?;
        gguf_file::Content::read(&mut std::io::BufReader::new(&mut *reader))
            .map_err(errors::candle)?;
        bail!("malformed GGUF metadata");
    };
    // candle reads the header and the metadata alone: the same bytes with no tensors
    // (the tensor count, after the magic and the version, zeroed).
    let mut bytes = Vec::new();
    reader.rewind()?;
    (&mut *reader)
        .take(metadata_end)
        .read_to_end(&mut bytes)
        .context("reading the GGUF metadata")?;
    let count_width = if skimmed.wide { 8 } else { 4 };
    bytes[8..8 + count_width].fill(0);
    let metadata = gguf_file::Content::read(&mut std::io::Cursor::new(bytes))
        .map_err(errors::candle)?
        .metadata;
    reader.seek(std::io::SeekFrom::Start(metadata_end))?;
    let mut table = std::io::BufReader::new(&mut *reader);
    let (tensors, table_end) = read_tensor_table(&mut table, &skimmed, metadata_end, len)?;
    let alignment = alignment(&metadata)?;
    let content = GgufContent {
        metadata,
        tensors,
        tensor_data_offset: table_end.div_ceil(alignment) * alignment,
    };
    check_tensor_layout(&content, alignment, len)?;
    Ok(content)
}

/// The tensor table at `start` (after the metadata): each entry a name, its dimensions
/// (innermost first), its GGML type and its data offset. Returns the tensors and where
/// the table ends. Counts and lengths are bounded by the bytes left in the file.
fn read_tensor_table<R: std::io::Read>(
    r: &mut R,
    skimmed: &gguf_header::Skimmed,
    start: u64,
    file_len: u64,
) -> Result<(std::collections::HashMap<String, GgufTensor>, u64)> {
    let wide = skimmed.wide;
    let prefix = if wide { 8 } else { 4 };
    let left = file_len.saturating_sub(start);
    // An entry takes at least a name length, a dimension count, a type and an offset.
    let min_entry = prefix + 4 + 4 + 8;
    if skimmed.tensor_count > left / min_entry {
        bail!(
            "the header declares {} tensors but the {left} bytes after the metadata hold at most {}",
            skimmed.tensor_count,
            left / min_entry
        );
    }
    let at = std::cell::Cell::new(start);
    let mut read = |n: usize| -> Result<Vec<u8>> {
        let mut b = vec![0u8; n];
        r.read_exact(&mut b)
            .map_err(|_| anyhow::anyhow!("truncated GGUF tensor table"))?;
        at.set(at.get() + n as u64);
        Ok(b)
    };
    let int = |b: Vec<u8>| b.iter().rev().fold(0u64, |n, &x| (n << 8) | u64::from(x));
    let mut tensors = std::collections::HashMap::new();
    for _ in 0..skimmed.tensor_count {
        let name_len = int(read(prefix as usize)?);
        if name_len > file_len.saturating_sub(at.get()) {
            bail!("a tensor name of {name_len} bytes runs past the end of the file");
        }
        let name = String::from_utf8(read(name_len as usize)?)
            .map_err(|_| anyhow::anyhow!("a tensor name is not UTF-8"))?;
        let dims = int(read(4)?) as u32;
        if dims > MAX_TENSOR_DIMS {
            bail!("tensor `{name}` has {dims} dimensions (at most {MAX_TENSOR_DIMS})");
        }
        let mut shape = (0..dims)
            .map(|_| Ok(usize::try_from(int(read(prefix as usize)?))?))
            .collect::<Result<Vec<usize>>>()?;
        shape.reverse();
        let ty = int(read(4)?) as u32;
        let format =
            Format::from_ggml_id(ty).map_err(|why| anyhow::anyhow!("tensor `{name}` has {why}"))?;
        let offset = int(read(8)?);
        let tensor = GgufTensor {
            shape,
            format,
            offset,
        };
        if tensors.insert(name.clone(), tensor).is_some() {
            bail!("tensor `{name}` appears twice in the tensor table");
        }
    }
    Ok((tensors, at.get()))
}

/// `general.alignment`: a power of two, 32 when absent.
fn alignment(metadata: &std::collections::HashMap<String, gguf_file::Value>) -> Result<u64> {
    match metadata.get("general.alignment") {
        None => Ok(gguf_file::DEFAULT_ALIGNMENT),
        Some(v) => gguf_int(v)
            .filter(|&a| a > 0 && (a as u64).is_power_of_two())
            .map(|a| a as u64)
            .with_context(|| format!("general.alignment must be a power of two, got {v:?}")),
    }
}

/// Every tensor's data lies inside the file, starts at a multiple of the alignment and
/// overlaps no other tensor; sizes are computed with checked arithmetic (a crafted shape
/// can make the element count wrap).
fn check_tensor_layout(content: &GgufContent, alignment: u64, file_len: u64) -> Result<()> {
    let mut extents = Vec::with_capacity(content.tensors.len());
    for (name, info) in &content.tensors {
        let elems = info
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .with_context(|| format!("tensor `{name}`: element count overflows"))?;
        let block = info.format.block_elems();
        if !elems.is_multiple_of(block) {
            bail!(
                "tensor `{name}`: {elems} elements is not a multiple of the {block}-element block of {}",
                info.format
            );
        }
        let bytes = (elems / block)
            .checked_mul(info.format.block_bytes())
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
    dtype: WeightDtype,
    /// llama.cpp stores Llama Q/K rows permuted for interleaved RoPE; we undo it.
    unpermute: bool,
    num_heads: usize,
    num_kv_heads: usize,
}

impl TensorSource for GgufSource<'_> {
    fn has(&self, name: &str) -> bool {
        self.gguf.content.tensors.contains_key(name)
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        Some(self.gguf.content.tensors.get(name)?.shape.clone())
    }

    fn load(&mut self, name: &str) -> Result<Loaded> {
        let g = &mut *self.gguf;
        let info = &g.content.tensors[name];
        let shape = info.shape.clone();
        let mat = mat_shape(&shape);
        let format = info.format;
        // In place: `check_tensor_layout` proved the range lies inside the file.
        let start = (g.content.tensor_data_offset + info.offset) as usize;
        let row_bytes = format.row_bytes(mat.in_features).with_context(|| {
            format!(
                "{}: tensor `{name}`: rows of {} values are not whole {format} blocks",
                g.path.display(),
                mat.in_features
            )
        })?;
        let len = mat.out_features * row_bytes;
        let bytes = Bytes::Mapped {
            map: Arc::clone(&g.map),
            range: start..start + len,
        };
        let weight = if self.dtype == WeightDtype::F32 || format == Format::F32 {
            // Dequantized once: the f32 reference mode, and f32 tensors. (`quant.rs` gives
            // candle's dequantizer's bits for every format candle reads: tested.)
            let mut data = vec![0f32; mat.out_features * mat.in_features];
            let rows = bytes.as_slice().chunks_exact(row_bytes.max(1));
            for (row, out) in rows.zip(data.chunks_exact_mut(mat.in_features.max(1))) {
                quant::dequantize(format, row, out);
            }
            Weight::f32(data, mat)
        } else {
            Weight::stored(format, bytes, mat)?
        };
        let heads = if !self.unpermute || shape.len() != 2 {
            None
        } else if name.ends_with("attn_q.weight") {
            Some(self.num_heads)
        } else if name.ends_with("attn_k.weight") {
            Some(self.num_kv_heads)
        } else {
            None
        };
        let weight = match heads {
            Some(heads) => {
                let head_dim = shape[0] / heads;
                weight.permuted_rows(|dst| unpermuted_source_row(dst, head_dim))
            }
            None => weight,
        };
        Ok(Loaded { shape, weight })
    }
}

/// The GGUF row that holds Hugging Face row `dst`: the inverse of llama.cpp's `permute`.
/// Within each head, GGUF row `(i, j)` (i < d/2, j < 2) holds Hugging Face row `(j, i)`,
/// i.e. rotary pairs interleaved instead of split in halves.
fn unpermuted_source_row(dst: usize, head_dim: usize) -> usize {
    let half = head_dim / 2;
    let (h, r) = (dst / head_dim, dst % head_dim);
    let (j, i) = (r / half, r % half);
    h * head_dim + i * 2 + j
}

/// Loads weights from a Hugging Face directory; `cfg.tie_word_embeddings` is settled here.
pub fn load_safetensors(dir: &Path, cfg: &mut ModelConfig, progress: bool) -> Result<ModelWeights> {
    let mut src = SafetensorsSource::open(dir)?;
    // Gemma 3's multimodal checkpoints keep the text model under another prefix.
    let (prefix, head) = [
        ("model.", "lm_head.weight"),
        ("model.language_model.", "lm_head.weight"),
        ("language_model.model.", "language_model.lm_head.weight"),
    ]
    .into_iter()
    .find(|(p, _)| src.has(&format!("{p}embed_tokens.weight")))
    .unwrap_or(("model.", "lm_head.weight"));
    let names = hf_names(prefix, head, cfg.arch);
    build(cfg, &mut src, &names, progress)
}

pub fn load_gguf(
    gguf: &mut GgufFile,
    cfg: &mut ModelConfig,
    progress: bool,
    dtype: WeightDtype,
) -> Result<ModelWeights> {
    let mut src = GgufSource {
        unpermute: cfg.arch == Arch::Llama,
        num_heads: cfg.num_heads,
        num_kv_heads: cfg.num_kv_heads,
        gguf,
        dtype,
    };
    let names = gguf_names(cfg.arch);
    build(cfg, &mut src, &names, progress)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cpu::ops;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// A GGUF whose one tensor has GGML type 16 (IQ2_XXS): the error names the tensor, the
    /// type and what is read.
    #[test]
    fn an_unread_tensor_type_is_named() {
        let mut f = Vec::new();
        f.extend(b"GGUF");
        f.extend(3u32.to_le_bytes());
        f.extend(1u64.to_le_bytes()); // tensors
        f.extend(0u64.to_le_bytes()); // metadata
        f.extend(1u64.to_le_bytes());
        f.extend(b"w");
        f.extend(1u32.to_le_bytes()); // dimensions
        f.extend(32u64.to_le_bytes());
        f.extend(16u32.to_le_bytes()); // IQ2_XXS
        f.extend(0u64.to_le_bytes()); // offset
        f.resize(f.len().next_multiple_of(32) + 18, 0);
        let len = f.len() as u64;
        let Err(err) = read_gguf_header(&mut std::io::Cursor::new(f), len) else {
            panic!("an unread type was read")
        };
        let msg = format!("{err:#}");
        assert!(
            msg.contains("tensor `w` has type IQ2_XXS (GGML type 16)"),
            "{msg}"
        );
        assert!(msg.contains("IQ4_NL, IQ4_XS and MXFP4"), "{msg}");
        assert!(!msg.contains('\n'), "{msg}");
    }

    /// A GGUF written by candle's writer (its own type ids, ggml.h's numbering) with one
    /// tensor of every format candle writes: strata's tensor table reads each one's format,
    /// shape and data exactly as candle holds them.
    #[test]
    fn the_tensor_table_reads_candle_written_types_shapes_and_data() {
        let mut rng = StdRng::seed_from_u64(8);
        let tensors: Vec<(String, QTensor)> = FORMATS
            .iter()
            .map(|(f, t)| {
                let v: Vec<f32> = (0..3 * 512).map(|_| rng.random_range(-1.0..1.0)).collect();
                let x = Tensor::from_vec(v, (3, 512), &Device::Cpu).unwrap();
                (f.to_string(), QTensor::quantize(&x, *t).unwrap())
            })
            .collect();
        let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, q)| (n.as_str(), q)).collect();
        let mut file = std::io::Cursor::new(Vec::new());
        gguf_file::write(&mut file, &[], &refs).unwrap();
        let bytes = file.into_inner();
        let content =
            read_gguf_header(&mut std::io::Cursor::new(&bytes), bytes.len() as u64).unwrap();
        for ((name, q), (format, _)) in tensors.iter().zip(FORMATS) {
            let info = &content.tensors[name];
            assert_eq!(info.format, format, "{name}");
            assert_eq!(info.shape, [3, 512], "{name}");
            let start = (content.tensor_data_offset + info.offset) as usize;
            let data = q.data().unwrap();
            assert_eq!(&bytes[start..start + data.len()], &data[..], "{name}");
        }
    }

    #[test]
    fn weight_dtype_names_are_the_flag_values() {
        use clap::ValueEnum;
        for d in WeightDtype::value_variants() {
            let flag = d.to_possible_value().expect("a value");
            assert_eq!(d.name(), flag.get_name());
        }
    }

    const FORMATS: [(Format, GgmlDType); 12] = [
        (Format::Bf16, GgmlDType::BF16),
        (Format::F16, GgmlDType::F16),
        (Format::Q4_0, GgmlDType::Q4_0),
        (Format::Q4_1, GgmlDType::Q4_1),
        (Format::Q5_0, GgmlDType::Q5_0),
        (Format::Q5_1, GgmlDType::Q5_1),
        (Format::Q8_0, GgmlDType::Q8_0),
        (Format::Q2K, GgmlDType::Q2K),
        (Format::Q3K, GgmlDType::Q3K),
        (Format::Q4K, GgmlDType::Q4K),
        (Format::Q5K, GgmlDType::Q5K),
        (Format::Q6K, GgmlDType::Q6K),
    ];

    /// A random `[rows, cols]` matrix quantized by candle, as our `Weight` and as candle's
    /// dequantized f32 (the independent reference).
    fn quantized(
        rng: &mut StdRng,
        f: (Format, GgmlDType),
        rows: usize,
        cols: usize,
    ) -> (Weight, Vec<f32>) {
        let v: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let t = Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, f.1).unwrap();
        let reference = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let bytes = Bytes::Owned(q.data().unwrap().into_owned());
        let shape = MatShape {
            out_features: rows,
            in_features: cols,
        };
        (Weight::stored(f.0, bytes, shape).unwrap(), reference)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// `linear` over every stored format gives, bitwise, `linear` over candle's
    /// dequantization of the same blocks (tolerance 0: same values, same order), for
    /// batch sizes on and off the register blocks and widths across several row tiles;
    /// and a row's result is the same whatever the batch (m = 1 vs m = 7). A loose f64
    /// check catches a kernel that would be wrong in both.
    #[test]
    fn linear_on_stored_formats_equals_f32_linear_on_their_dequantization() {
        let mut rng = StdRng::seed_from_u64(3);
        let (n, k) = (53, 512); // 53: three 24-row tiles, the last partial
        for f in FORMATS {
            let (w, deq) = quantized(&mut rng, f, n, k);
            assert_eq!(bits(&w.to_f32()), bits(&deq), "{}: dequantization", f.0);
            for m in [1, 2, 5, 7] {
                let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let mut got = vec![0.0; m * n];
                ops::linear_weight(&x, &w, None, &mut got, m);
                let mut want = vec![0.0; m * n];
                ops::linear(&x, &deq, None, &mut want, m, k, n);
                assert_eq!(bits(&got), bits(&want), "{}: m {m}", f.0);
                let mut alone = vec![0.0; n];
                ops::linear_weight(&x[(m - 1) * k..], &w, None, &mut alone, 1);
                assert_eq!(
                    bits(&alone),
                    bits(&got[(m - 1) * n..]),
                    "{}: last row alone",
                    f.0
                );
                let naive: f64 = (0..k).map(|p| x[p] as f64 * deq[p] as f64).sum();
                assert!(
                    (got[0] as f64 - naive).abs() < 1e-3,
                    "{}: {} vs {naive}",
                    f.0,
                    got[0]
                );
            }
        }
    }

    /// A fused matrix whose parts have different formats (as llama.cpp's mixed files have)
    /// reads each row from its own part, across tile boundaries.
    #[test]
    fn fused_parts_of_different_formats_read_as_one_matrix() {
        let mut rng = StdRng::seed_from_u64(4);
        let k = 256;
        let (a, da) = quantized(&mut rng, FORMATS[3], 20, k);
        let (b, db) = quantized(&mut rng, FORMATS[8], 9, k);
        let (c, dc) = quantized(&mut rng, FORMATS[0], 30, k);
        let w = Weight::concat(vec![a, b, c]);
        assert_eq!(
            w.shape(),
            MatShape {
                out_features: 59,
                in_features: k
            }
        );
        let deq: Vec<f32> = [da, db, dc].concat();
        assert_eq!(bits(&w.to_f32()), bits(&deq));
        let x: Vec<f32> = (0..3 * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let (mut got, mut want) = (vec![0.0; 3 * 59], vec![0.0; 3 * 59]);
        ops::linear_weight(&x, &w, None, &mut got, 3);
        ops::linear(&x, &deq, None, &mut want, 3, k, 59);
        assert_eq!(bits(&got), bits(&want));
        let mut row = vec![0.0; k];
        w.row_f32(25, &mut row);
        assert_eq!(bits(&row), bits(&deq[25 * k..26 * k]));
    }

    #[test]
    fn a_row_that_is_not_whole_blocks_is_refused() {
        let shape = MatShape {
            out_features: 2,
            in_features: 48,
        };
        let err = Weight::stored(Format::Q4_1, Bytes::Owned(vec![0; 60]), shape)
            .err()
            .unwrap();
        assert!(
            format!("{err}").contains("not whole 32-value blocks"),
            "{err}"
        );
        let shape = MatShape {
            out_features: 3,
            in_features: 32,
        };
        assert!(Weight::stored(Format::Q4_1, Bytes::Owned(vec![0; 40]), shape).is_err());
    }

    #[test]
    fn bf16_upload_bits_are_the_rounded_values() {
        let mut rng = StdRng::seed_from_u64(6);
        for f in FORMATS {
            let (w, deq) = quantized(&mut rng, f, 3, 256);
            let want: Vec<u16> = deq
                .iter()
                .map(|&x| crate::device::bf16::f32_to_bf16(x))
                .collect();
            assert_eq!(w.to_bf16_bits(), want, "{}", f.0);
        }
    }
}
