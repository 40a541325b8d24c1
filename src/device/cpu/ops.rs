//! CPU compute ops in f32: the reference every CUDA kernel is checked against, and the
//! kernels the CPU device runs. Row-major throughout; shapes are given beside each argument.

use rayon::prelude::*;

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` (+ `bias[n]`): a linear layer with HF `[out, in]` weights.
pub fn linear(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
    m: usize,
    k: usize,
    n: usize,
) {
    debug_assert_eq!(x.len(), m * k);
    debug_assert_eq!(w.len(), n * k);
    debug_assert_eq!(out.len(), m * n);
    if m <= 4 {
        matvec_rows(x, w, out, m, k, n);
    } else {
        let threads = rayon::current_num_threads();
        let par = if threads > 1 {
            gemm::Parallelism::Rayon(threads)
        } else {
            gemm::Parallelism::None
        };
        // SAFETY: the three slices have the lengths asserted above and the strides
        // describe exactly those row-major layouts; `out` does not alias the inputs.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                out.as_mut_ptr(),
                1,
                n as isize,
                false,
                x.as_ptr(),
                1,
                k as isize,
                w.as_ptr(),
                k as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                par,
            );
        }
    }
    if let Some(b) = bias {
        for row in out.chunks_exact_mut(n) {
            for (o, b) in row.iter_mut().zip(b) {
                *o += b;
            }
        }
    }
}

/// Few-row linear (decode): memory-bound, so stream each weight row once for all `m` inputs.
fn matvec_rows(x: &[f32], w: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    const ROWS_PER_TASK: usize = 64;
    let mut tmp = vec![0.0f32; n * m]; // [n, m], transposed into `out` below
    tmp.par_chunks_mut(ROWS_PER_TASK * m)
        .enumerate()
        .for_each(|(c, chunk)| {
            for (r, dst) in chunk.chunks_exact_mut(m).enumerate() {
                let row = &w[(c * ROWS_PER_TASK + r) * k..][..k];
                for (i, d) in dst.iter_mut().enumerate() {
                    *d = dot(row, &x[i * k..(i + 1) * k]);
                }
            }
        });
    for j in 0..n {
        for i in 0..m {
            out[i * n + j] = tmp[j * m + i];
        }
    }
}

/// Dot product with 16 independent accumulators so it vectorizes.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// RMSNorm of each `dim`-wide row: `out = x / sqrt(mean(x²) + eps) * w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let dim = w.len();
    out.par_chunks_mut(dim * 16)
        .zip(x.par_chunks(dim * 16))
        .for_each(|(o, x)| {
            for (o, x) in o.chunks_exact_mut(dim).zip(x.chunks_exact(dim)) {
                rms_norm_row(x, w, eps, o);
            }
        });
}

#[inline]
pub fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss = dot(x, x) / x.len() as f32;
    let scale = 1.0 / (ss + eps).sqrt();
    for ((o, x), w) in out.iter_mut().zip(x).zip(w) {
        *o = x * scale * w;
    }
}

/// Residual add fused with the next RMSNorm: `x += delta; out = rms_norm(x)`.
pub fn add_rms_norm(x: &mut [f32], delta: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let dim = w.len();
    out.par_chunks_mut(dim * 16)
        .zip(x.par_chunks_mut(dim * 16))
        .zip(delta.par_chunks(dim * 16))
        .for_each(|((o, x), d)| {
            for ((o, x), d) in o
                .chunks_exact_mut(dim)
                .zip(x.chunks_exact_mut(dim))
                .zip(d.chunks_exact(dim))
            {
                for (x, d) in x.iter_mut().zip(d) {
                    *x += d;
                }
                rms_norm_row(x, w, eps, o);
            }
        });
}

/// Rotary embedding, NeoX/HF convention (pairs `i` and `i + d/2`), in place on
/// `x[tokens, heads, head_dim]` (rows may be strided by `row_stride`); `cos`/`sin` are
/// `[tokens, head_dim / 2]`.
pub fn rope(
    x: &mut [f32],
    tokens: usize,
    heads: usize,
    head_dim: usize,
    row_stride: usize,
    cos: &[f32],
    sin: &[f32],
) {
    let half = head_dim / 2;
    x.par_chunks_mut(row_stride)
        .take(tokens)
        .enumerate()
        .for_each(|(t, row)| {
            let (c, s) = (
                &cos[t * half..(t + 1) * half],
                &sin[t * half..(t + 1) * half],
            );
            for h in 0..heads {
                let v = &mut row[h * head_dim..(h + 1) * head_dim];
                let (a, b) = v.split_at_mut(half);
                for i in 0..half {
                    let (x0, x1) = (a[i], b[i]);
                    a[i] = x0 * c[i] - x1 * s[i];
                    b[i] = x0 * s[i] + x1 * c[i];
                }
            }
        });
}

/// `cos`, `sin` tables `[positions, head_dim / 2]` for positions `pos0..pos0 + n`.
pub fn rope_tables(inv_freq: &[f32], pos0: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let mut cos = vec![0.0; n * half];
    let mut sin = vec![0.0; n * half];
    for t in 0..n {
        let p = (pos0 + t) as f32;
        for (i, f) in inv_freq.iter().enumerate() {
            let a = p * f;
            cos[t * half + i] = a.cos();
            sin[t * half + i] = a.sin();
        }
    }
    (cos, sin)
}

/// `out[t, i] = silu(gu[t, i]) * gu[t, inter + i]`, with `gu` = `[tokens, 2 * inter]` (gate, up).
pub fn silu_mul(gu: &[f32], inter: usize, out: &mut [f32]) {
    out.par_chunks_mut(inter)
        .zip(gu.par_chunks(2 * inter))
        .for_each(|(o, gu)| {
            let (g, u) = gu.split_at(inter);
            for ((o, g), u) in o.iter_mut().zip(g).zip(u) {
                *o = g / (1.0 + exp_fast(-g)) * u;
            }
        });
}

/// Per-head RMSNorm (Qwen3 q/k norm) on `x[tokens, heads, head_dim]` with row stride `row_stride`.
pub fn head_rms_norm(
    x: &mut [f32],
    tokens: usize,
    heads: usize,
    head_dim: usize,
    row_stride: usize,
    w: &[f32],
    eps: f32,
) {
    x.par_chunks_mut(row_stride).take(tokens).for_each(|row| {
        let mut tmp = vec![0.0f32; head_dim];
        for h in 0..heads {
            let v = &mut row[h * head_dim..(h + 1) * head_dim];
            rms_norm_row(v, w, eps, &mut tmp);
            v.copy_from_slice(&tmp);
        }
    });
}

/// `exp(x)` for `x <= 0` (softmax after subtracting the row max).
#[inline(always)]
pub fn exp_nonpos(x: f32) -> f32 {
    exp_fast(x)
}

/// `exp(x)`, vectorizable: 2ⁿ · e^r with |r| ≤ ln2/2 and a degree-6 polynomial
/// (relative error ≈ 2e-7, at f32 rounding level); saturates outside [-87, 88].
#[inline(always)]
pub fn exp_fast(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two (Cody-Waite) so `n · ln2` stays exact for |n| up to ~128.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2²³: adding it rounds to an integer
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + MAGIC) - MAGIC;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Largest element (−∞ for an empty slice), in 8 lanes so it vectorizes.
#[inline]
fn max_of(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            acc[i] = acc[i].max(c[i]);
        }
    }
    rest.iter()
        .chain(&acc)
        .copied()
        .fold(f32::NEG_INFINITY, f32::max)
}

/// Sum in 8 lanes so it vectorizes.
#[inline]
fn sum_of(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i];
        }
    }
    acc.iter().sum::<f32>() + rest.iter().sum::<f32>()
}

/// Shapes of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub tokens: usize, // new query tokens
    pub pos0: usize,   // absolute position of the first query token
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

const Q_TILE: usize = 32; // query tokens per task (× heads of a KV group)
const K_TILE: usize = 128; // keys per online-softmax step
const DECODE_SPLIT: usize = 512; // keys per task when there are few queries (flash-decoding)

/// Causal GQA attention that never materialises the `tokens × keys` score matrix: each
/// task takes a tile of queries for one KV group and walks key tiles with an online
/// softmax; with few queries the key range is also split and the partials merged.
///
/// `q[tokens, num_heads, head_dim]`; `k`, `v`: `[>= pos0 + tokens, num_kv_heads, head_dim]`
/// (the layer's cache, the new tokens already stored); `out[tokens, num_heads, head_dim]`.
pub fn attention(q: &[f32], k: &[f32], v: &[f32], out: &mut [f32], s: AttnShape) {
    let AttnShape {
        tokens,
        pos0,
        num_heads,
        num_kv_heads,
        head_dim: hd,
    } = s;
    let group = num_heads / num_kv_heads;
    let keys_total = pos0 + tokens;
    let q_tiles = tokens.div_ceil(Q_TILE);
    // Split the key range only when there are too few query tiles to feed the cores.
    let splits = if q_tiles * num_kv_heads >= 4 * rayon::current_num_threads() {
        1
    } else {
        keys_total.div_ceil(DECODE_SPLIT).max(1)
    };
    let tasks: Vec<(usize, usize, usize)> = (0..num_kv_heads)
        .flat_map(|g| (0..q_tiles).flat_map(move |t| (0..splits).map(move |sp| (g, t, sp))))
        .collect();
    // Each task returns its partial (row max, row sum, unnormalised output) per query row.
    let partials: Vec<Partial> = tasks
        .par_iter()
        .map(|&(g, t, sp)| {
            let t0 = t * Q_TILE;
            let nq = Q_TILE.min(tokens - t0);
            let key_end = pos0 + t0 + nq; // exclusive: the last query sees keys < key_end
            let per = keys_total.div_ceil(splits);
            let (ks, ke) = ((sp * per).min(key_end), ((sp + 1) * per).min(key_end));
            attend_tile(q, k, v, s, g, group, t0, nq, ks, ke)
        })
        .collect();
    // Merge the splits of each (group, tile) and normalise into `out`.
    let row_stride = num_heads * hd;
    for (chunk_idx, chunk) in partials.chunks(splits).enumerate() {
        let (g, t, _) = tasks[chunk_idx * splits];
        let t0 = t * Q_TILE;
        let nq = Q_TILE.min(tokens - t0);
        for j in 0..group {
            for i in 0..nq {
                let r = j * nq + i;
                let m = chunk
                    .iter()
                    .map(|p| p.m[r])
                    .fold(f32::NEG_INFINITY, f32::max);
                let dst = &mut out[(t0 + i) * row_stride + (g * group + j) * hd..][..hd];
                dst.fill(0.0);
                let mut l = 0.0;
                for p in chunk {
                    if p.m[r] == f32::NEG_INFINITY {
                        continue;
                    }
                    let w = (p.m[r] - m).exp();
                    l += p.l[r] * w;
                    for (d, o) in dst.iter_mut().zip(&p.o[r * hd..(r + 1) * hd]) {
                        *d += o * w;
                    }
                }
                let inv = 1.0 / l;
                dst.iter_mut().for_each(|d| *d *= inv);
            }
        }
    }
}

struct Partial {
    m: Vec<f32>, // [rows] running max of the scaled scores
    l: Vec<f32>, // [rows] running sum of exp(score - m)
    o: Vec<f32>, // [rows, head_dim] Σ exp(score - m) · v
}

/// One task: rows = the `group` heads × `nq` queries of KV head `g`, keys `ks..ke`.
#[allow(clippy::too_many_arguments)]
fn attend_tile(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: AttnShape,
    g: usize,
    group: usize,
    t0: usize,
    nq: usize,
    ks: usize,
    ke: usize,
) -> Partial {
    let hd = s.head_dim;
    let rows = group * nq;
    let q_stride = s.num_heads * hd;
    let kv_stride = s.num_kv_heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    // qg[rows, hd], row r = j * nq + i: head g*group + j, token t0 + i; pre-scaled.
    let mut qg = vec![0.0f32; rows * hd];
    for j in 0..group {
        for i in 0..nq {
            let src = &q[(t0 + i) * q_stride + (g * group + j) * hd..][..hd];
            for (d, x) in qg[(j * nq + i) * hd..][..hd].iter_mut().zip(src) {
                *d = x * scale;
            }
        }
    }
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut l = vec![0.0f32; rows];
    let mut o = vec![0.0f32; rows * hd];
    let mut sc = vec![0.0f32; rows * K_TILE]; // scores, then probabilities [rows, K_TILE]
    let mut kb = ks;
    while kb < ke {
        let kn = K_TILE.min(ke - kb);
        let kbase = &k[kb * kv_stride + g * hd..];
        let vbase = &v[kb * kv_stride + g * hd..];
        // sc[rows, kn] = qg · K[kb..kb+kn]ᵀ
        // SAFETY: qg is [rows, hd]; K rows are `kv_stride` apart with `hd` valid values
        // each, kn rows from kb; sc has rows × K_TILE ≥ rows × kn entries.
        unsafe {
            gemm::gemm(
                rows,
                kn,
                hd,
                sc.as_mut_ptr(),
                1,
                K_TILE as isize,
                false,
                qg.as_ptr(),
                1,
                hd as isize,
                kbase.as_ptr(),
                kv_stride as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        for j in 0..group {
            for i in 0..nq {
                let r = j * nq + i;
                let row = &mut sc[r * K_TILE..r * K_TILE + kn];
                // Causal: query at position p sees keys <= p.
                let visible = (s.pos0 + t0 + i + 1).saturating_sub(kb).min(kn);
                if visible == 0 {
                    row.fill(0.0);
                    continue;
                }
                let m_new = m[r].max(max_of(&row[..visible]));
                let corr = exp_nonpos(m[r] - m_new);
                // Separate map and sum loops: each vectorizes, a fused one would not.
                for x in row[..visible].iter_mut() {
                    *x = exp_nonpos(*x - m_new);
                }
                let sum = sum_of(&row[..visible]);
                row[visible..].fill(0.0);
                l[r] = l[r] * corr + sum;
                m[r] = m_new;
                if corr != 1.0 {
                    o[r * hd..(r + 1) * hd].iter_mut().for_each(|x| *x *= corr);
                }
            }
        }
        // o[rows, hd] += P[rows, kn] · V[kb..kb+kn]
        // SAFETY: as above, V has the same layout as K.
        unsafe {
            gemm::gemm(
                rows,
                hd,
                kn,
                o.as_mut_ptr(),
                1,
                hd as isize,
                true,
                sc.as_ptr(),
                1,
                K_TILE as isize,
                vbase.as_ptr(),
                1,
                kv_stride as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        kb += kn;
    }
    Partial { m, l, o }
}

/// Reference attention for tests: plain softmax over the full score row.
pub fn attention_naive(q: &[f32], k: &[f32], v: &[f32], s: AttnShape) -> Vec<f32> {
    let hd = s.head_dim;
    let group = s.num_heads / s.num_kv_heads;
    let mut out = vec![0.0; s.tokens * s.num_heads * hd];
    for t in 0..s.tokens {
        let p = s.pos0 + t;
        for h in 0..s.num_heads {
            let g = h / group;
            let qv = &q[(t * s.num_heads + h) * hd..][..hd];
            let scores: Vec<f64> = (0..=p)
                .map(|j| {
                    let kv = &k[(j * s.num_kv_heads + g) * hd..][..hd];
                    qv.iter()
                        .zip(kv)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|x| (x - mx).exp()).collect();
            let sum: f64 = e.iter().sum();
            let o = &mut out[(t * s.num_heads + h) * hd..][..hd];
            for (j, w) in e.iter().enumerate() {
                let vv = &v[(j * s.num_kv_heads + g) * hd..][..hd];
                for (d, x) in o.iter_mut().zip(vv) {
                    *d += (*w / sum) as f32 * x;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn rand_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
    }

    #[test]
    fn exp_matches_std() {
        for i in -17000..17000 {
            let x = i as f32 * 0.005;
            let (a, b) = (exp_fast(x), x.exp());
            assert!((a - b).abs() <= 3e-7 * b.max(1e-30), "exp({x}): {a} vs {b}");
        }
    }

    #[test]
    fn attention_matches_naive() {
        let mut rng = StdRng::seed_from_u64(7);
        // (tokens, pos0, heads, kv_heads, head_dim): prefill tiles, decode splits, GQA.
        for &(tokens, pos0, nh, nkv, hd) in &[
            (1, 0, 2, 1, 8),
            (37, 0, 4, 2, 16),
            (5, 700, 6, 2, 32),
            (1, 1500, 9, 3, 64),
            (200, 90, 4, 4, 8),
        ] {
            let total = pos0 + tokens;
            let q = rand_vec(&mut rng, tokens * nh * hd);
            let k = rand_vec(&mut rng, total * nkv * hd);
            let v = rand_vec(&mut rng, total * nkv * hd);
            let s = AttnShape {
                tokens,
                pos0,
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
            };
            let mut out = vec![0.0; tokens * nh * hd];
            attention(&q, &k, &v, &mut out, s);
            let want = attention_naive(&q, &k, &v, s);
            let err = out
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(err < 1e-5, "{s:?}: max abs error {err}");
        }
    }

    #[test]
    fn linear_matches_naive() {
        let mut rng = StdRng::seed_from_u64(3);
        for &(m, k, n) in &[(1, 33, 70), (3, 64, 130), (17, 40, 9)] {
            let x = rand_vec(&mut rng, m * k);
            let w = rand_vec(&mut rng, n * k);
            let b = rand_vec(&mut rng, n);
            let mut out = vec![0.0; m * n];
            linear(&x, &w, Some(&b), &mut out, m, k, n);
            for i in 0..m {
                for j in 0..n {
                    let want: f32 = (0..k).map(|t| x[i * k + t] * w[j * k + t]).sum::<f32>() + b[j];
                    assert!((out[i * n + j] - want).abs() < 1e-4);
                }
            }
        }
    }
}
