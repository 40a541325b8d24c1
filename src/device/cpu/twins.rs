//! CPU twins of the CUDA kernels that have no counterpart in `ops`: same semantics, f32,
//! written for clarity. `scripts/gpu-check.sh` compares each kernel against its twin.

use super::ops::{self, AttnHeads, AttnShape};
use super::rows::KvRows;

pub use crate::device::bf16::{bf16_to_f32, f32_to_bf16};

/// Twin of `embedding_gather`: `out[t] = table[ids[t]]`, a zero row for an out-of-range id.
/// `table[vocab, dim]`, `ids[tokens]`, `out[tokens, dim]`.
pub fn embedding_gather(table: &[f32], ids: &[i32], dim: usize, out: &mut [f32]) {
    let vocab = table.len() / dim;
    for (row, &id) in out.chunks_exact_mut(dim).zip(ids) {
        match usize::try_from(id).ok().filter(|&i| i < vocab) {
            Some(i) => row.copy_from_slice(&table[i * dim..(i + 1) * dim]),
            None => row.fill(0.0),
        }
    }
}

/// Twin of `kv_store`: copies token `t`'s first `kv_dim` values of `k`/`v` (rows
/// `src_stride` apart) to cache row `slots[t]` (`slots[t] % rows` in a ring of
/// `Some(rows)`); a negative slot is skipped.
/// `k`, `v`: `[tokens, src_stride]`; caches `[num_slots, kv_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn kv_store(
    k: &[f32],
    v: &[f32],
    src_stride: usize,
    kv_dim: usize,
    slots: &[i32],
    ring: Option<usize>,
    k_cache: &mut [f32],
    v_cache: &mut [f32],
) {
    for (t, &s) in slots.iter().enumerate() {
        let Ok(s) = usize::try_from(s) else { continue };
        let s = ring.map_or(s, |rows| s % rows);
        k_cache[s * kv_dim..(s + 1) * kv_dim].copy_from_slice(&k[t * src_stride..][..kv_dim]);
        v_cache[s * kv_dim..(s + 1) * kv_dim].copy_from_slice(&v[t * src_stride..][..kv_dim]);
    }
}

/// Twin of `argmax`: index of the largest logit, the lowest index on ties.
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best
}

/// Twin of `sample` (temperature > 0): keep logits ≥ the k-th largest (`top_k` 0 = all),
/// then the most probable of those whose mass reaches `top_p` (ties at either cut-off
/// kept), and pick by inverse CDF in *index order* at `u · kept mass`. Same kept set as
/// `engine::sampler` (up to ties); the token for a given `u` differs only in order.
pub fn sample(logits: &[f32], temperature: f32, top_k: usize, top_p: f32, u: f32) -> usize {
    let mx = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let kcut = if top_k > 0 && top_k < logits.len() {
        let mut sorted = logits.to_vec();
        sorted.sort_unstable_by(|a, b| b.total_cmp(a));
        sorted[top_k - 1]
    } else {
        f32::NEG_INFINITY
    };
    let e: Vec<f32> = logits
        .iter()
        .map(|&l| {
            if l >= kcut {
                ((l - mx) / temperature).exp()
            } else {
                0.0
            }
        })
        .collect();
    let z: f64 = e.iter().map(|&x| x as f64).sum();
    let pcut = if top_p < 1.0 {
        // The largest weight e* with mass(e ≥ e*) ≥ top_p · z: walk weights high to low.
        let mut sorted: Vec<f32> = e.iter().copied().filter(|&x| x > 0.0).collect();
        sorted.sort_unstable_by(|a, b| b.total_cmp(a));
        let mut acc = 0.0f64;
        let mut cut = 0.0;
        for x in sorted {
            acc += x as f64;
            cut = x;
            if acc >= top_p as f64 * z {
                break;
            }
        }
        cut
    } else {
        0.0
    };
    let kept = |i: usize| e[i] > 0.0 && e[i] >= pcut;
    let total: f64 = (0..e.len()).filter(|&i| kept(i)).map(|i| e[i] as f64).sum();
    let target = u as f64 * total;
    let mut acc = 0.0f64;
    let mut last = 0;
    for i in (0..e.len()).filter(|&i| kept(i)) {
        acc += e[i] as f64;
        last = i;
        if target < acc {
            return i;
        }
    }
    last
}

/// Shapes of a batch of sequences whose KV lives in a paged cache.
#[derive(Clone, Copy, Debug)]
pub struct PagedShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub max_blocks: usize, // columns of the block table
    pub scale: f32,
    pub window: Option<usize>,
}

/// Twin of `attn_prefill_hd*` and `attn_decode_hd*` + `attn_decode_reduce`: causal GQA
/// attention (scaled by `s.scale`, within `s.window`) for a batch, K/V read through block
/// tables. Sequence `b` has queries
/// `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` (the last tokens of its `context_lens[b]` keys).
/// `q[total_q, num_heads, head_dim]`; caches `[slots, num_kv_heads, head_dim]`;
/// `block_tables[batch, max_blocks]`; `out[total_q, num_heads, head_dim]`; `sinks[num_heads]`
/// (gpt-oss's attention sinks, as `ops::attention_batch` takes them).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    cu_seqlens_q: &[i32],
    context_lens: &[i32],
    block_tables: &[i32],
    s: PagedShape,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    let kv_dim = s.num_kv_heads * s.head_dim;
    let q_dim = s.num_heads * s.head_dim;
    for (b, &ctx) in context_lens.iter().enumerate() {
        let (q0, q1) = (cu_seqlens_q[b] as usize, cu_seqlens_q[b + 1] as usize);
        let ctx = ctx as usize;
        // Gather this sequence's keys into contiguous [ctx, kv_dim] and reuse ops::attention.
        let table = &block_tables[b * s.max_blocks..(b + 1) * s.max_blocks];
        let mut k = vec![0.0; ctx * kv_dim];
        let mut v = vec![0.0; ctx * kv_dim];
        for key in 0..ctx {
            let slot = table[key / s.block_size] as usize * s.block_size + key % s.block_size;
            k[key * kv_dim..(key + 1) * kv_dim]
                .copy_from_slice(&k_cache[slot * kv_dim..][..kv_dim]);
            v[key * kv_dim..(key + 1) * kv_dim]
                .copy_from_slice(&v_cache[slot * kv_dim..][..kv_dim]);
        }
        let shape = AttnShape {
            tokens: q1 - q0,
            pos0: ctx - (q1 - q0),
            num_heads: s.num_heads,
            num_kv_heads: s.num_kv_heads,
            head_dim: s.head_dim,
        };
        let (heads, seq) = shape.batch_of_one();
        let heads = AttnHeads {
            scale: s.scale,
            window: s.window,
            ..heads
        };
        ops::attention_batch(
            &q[q0 * q_dim..q1 * q_dim],
            KvRows::from_slices(&k, &v),
            &mut out[q0 * q_dim..q1 * q_dim],
            heads,
            sinks,
            &[seq],
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    #[test]
    fn bf16_round_trip_rounds_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties to even (1).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
    }

    #[test]
    fn embedding_gather_zeroes_bad_ids() {
        let table: Vec<f32> = (0..6).map(|x| x as f32).collect(); // [3, 2]
        let mut out = vec![9.0; 6];
        embedding_gather(&table, &[2, -1, 0], 2, &mut out);
        assert_eq!(out, [4.0, 5.0, 0.0, 0.0, 0.0, 1.0]);
    }

    #[test]
    fn kv_store_follows_slots_and_skips_padding() {
        let k = [1.0, 2.0, 0.0, 3.0, 4.0, 0.0]; // [2 tokens, stride 3], kv_dim 2
        let v = [5.0, 6.0, 0.0, 7.0, 8.0, 0.0];
        let (mut kc, mut vc) = (vec![0.0; 8], vec![0.0; 8]); // [4 slots, 2]
        kv_store(&k, &v, 3, 2, &[3, -1], None, &mut kc, &mut vc);
        assert_eq!(kc, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0]);
        assert_eq!(vc, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 6.0]);
    }

    #[test]
    fn argmax_takes_first_of_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn sample_respects_cutoffs_and_matches_probabilities() {
        let logits = [0.0, 2.0, 1.0, 3.0, -1.0];
        // top_k = 1 is greedy whatever u is.
        for u in [0.0, 0.5, 0.999] {
            assert_eq!(sample(&logits, 1.0, 1, 1.0, u), 3);
        }
        // top_k = 2 keeps {1, 3}: index order puts token 1 first with mass e^-1/(1+e^-1).
        let p1 = (-1.0f32).exp() / (1.0 + (-1.0f32).exp());
        assert_eq!(sample(&logits, 1.0, 2, 1.0, p1 - 1e-3), 1);
        assert_eq!(sample(&logits, 1.0, 2, 1.0, p1 + 1e-3), 3);
        // A small top_p keeps only the most probable token.
        assert_eq!(sample(&logits, 1.0, 0, 0.1, 0.0), 3);
        // Frequencies follow softmax(logits / T).
        let mut rng = StdRng::seed_from_u64(1);
        let mut counts = [0usize; 5];
        let n = 20000;
        for _ in 0..n {
            counts[sample(&logits, 2.0, 0, 1.0, rng.random())] += 1;
        }
        let z: f32 = logits.iter().map(|l| (l / 2.0).exp()).sum();
        for (i, &c) in counts.iter().enumerate() {
            let want = (logits[i] / 2.0).exp() / z;
            assert!((c as f32 / n as f32 - want).abs() < 0.02, "token {i}");
        }
    }

    #[test]
    fn paged_attention_matches_contiguous() {
        let mut rng = StdRng::seed_from_u64(5);
        let (nh, nkv, hd, bs) = (4, 2, 8, 4);
        let kv_dim = nkv * hd;
        // Two sequences: 5 new of 11 keys (chunked prefill), and 1 new of 6 (decode).
        let ctx = [11i32, 6];
        let cu = [0i32, 5, 6];
        let tables = [5i32, 0, 2, 7, 3, 1, 0, 0]; // [2, max_blocks 4], scattered blocks
        let s = PagedShape {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            block_size: bs,
            max_blocks: 4,
            scale: 1.0 / (hd as f32).sqrt(),
            window: None,
        };
        let slots = 8 * bs;
        let rnd = |rng: &mut StdRng, n| {
            (0..n)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect::<Vec<f32>>()
        };
        let (kc, vc) = (rnd(&mut rng, slots * kv_dim), rnd(&mut rng, slots * kv_dim));
        let q = rnd(&mut rng, 6 * nh * hd);
        let mut out = vec![0.0; 6 * nh * hd];
        paged_attention(&q, &kc, &vc, &cu, &ctx, &tables, s, None, &mut out);
        // Sequence 0 by hand: gather its keys, run the naive reference.
        let mut k = vec![0.0; 11 * kv_dim];
        let mut v = vec![0.0; 11 * kv_dim];
        for key in 0..11 {
            let slot = tables[key / bs] as usize * bs + key % bs;
            k[key * kv_dim..][..kv_dim].copy_from_slice(&kc[slot * kv_dim..][..kv_dim]);
            v[key * kv_dim..][..kv_dim].copy_from_slice(&vc[slot * kv_dim..][..kv_dim]);
        }
        let shape = AttnShape {
            tokens: 5,
            pos0: 6,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
        };
        let want = ops::attention_naive(&q[..5 * nh * hd], &k, &v, shape);
        for (a, b) in out[..5 * nh * hd].iter().zip(&want) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}
