//! The decode attention kernels alone, hot in L1: `DotKernel::scores` (a score tile) and
//! `DotKernel::accumulate_rows` (`P·V`) of the AVX-512 kernel (else the portable one),
//! over 32 f16 keys for one GQA group of query rows, per head size. Prints the fastest of
//! 7 rounds in ns per (query row, key) pair: the kernels' compute cost without memory
//! stalls, tiles, softmax or threads (`cargo bench --bench attention` times the whole of
//! attention).
//!
//! `cargo bench --bench attention_kernels`

use std::time::Instant;

use half::f16;
use strata::device::cpu::dot::{DotKernel, Rows};

const KEYS: usize = 32;
const STRIDE: usize = 128; // as attention's score tile (K_TILE)
const ITERS: usize = 100_000;
const ROUNDS: usize = 7;

/// Fastest of the rounds, ns per call of `f` divided by `pairs`.
fn best_ns(pairs: usize, mut f: impl FnMut()) -> f64 {
    (0..ROUNDS)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..ITERS {
                f();
            }
            t.elapsed().as_nanos() as f64 / (ITERS * pairs) as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn run<K: DotKernel>(kern: K, name: &str) {
    // (head size, query rows of a GQA group): SmolLM2 (64, 3); Llama/Qwen (128, 4).
    for (hd, rows) in [(64usize, 3usize), (128, 4)] {
        let store: Vec<f16> = (0..KEYS * hd)
            .map(|i| f16::from_f32(((i * 7919) % 1000) as f32 / 1000.0 - 0.5))
            .collect();
        let keys: Vec<&[f16]> = store.chunks(hd).collect();
        let q: Vec<f32> = (0..rows * hd)
            .map(|i| ((i * 31) % 100) as f32 / 100.0)
            .collect();
        let mut scores = vec![0.0f32; rows * STRIDE];
        let s = best_ns(KEYS * rows, || {
            kern.scores(&q, Rows::whole(&keys), &mut scores, STRIDE, &[]);
            std::hint::black_box(&mut scores);
        });
        let ps = vec![0.01f32; rows * STRIDE];
        let mut acc = vec![0.0f32; rows * hd];
        let pv = best_ns(KEYS * rows, || {
            kern.accumulate_rows(&ps, STRIDE, Rows::whole(&keys), &mut acc, &[]);
            std::hint::black_box(&mut acc);
        });
        println!("{name} head {hd:>3}, {rows} rows: scores {s:5.2} ns/pair, P·V {pv:5.2} ns/pair");
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    if let Some(kern) = strata::device::cpu::dot::Avx512::detect() {
        return run(kern, "avx512");
    }
    run(strata::device::cpu::dot::Portable, "portable");
}
