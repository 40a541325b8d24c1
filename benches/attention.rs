//! Decode attention alone: one query token over a context of `STRATA_BENCH_CTX` keys
//! (default 4096) with the default model's heads (9 query, 3 KV, 64 wide), in each KV
//! element. "hot" reuses one layer's cache (it stays in L2/L3: the kernels' compute
//! cost); "cold" walks 30 layers' caches in turn, as a decode step does; "dram" walks
//! copies of them adding up to `DRAM_BYTES`, more than this machine's L3 holds, so every
//! layer's K and V come from memory, as in a decode step whose weights stream between the
//! layers (30 layers of 4K-context KV, 95 MB, can stay in a large L3, which decode's
//! weights push them out of). Prints the fastest and the median round's time per call,
//! and the KV bytes per second the fastest reads.
//!
//! `cargo bench --bench attention` (`STRATA_BENCH_KERNEL=avx2`: the AVX2 kernel, which CPUs
//! without AVX-512 run, instead of the best this CPU has)

use std::time::Instant;

use rand::{rngs::StdRng, Rng, SeedableRng};
use strata::device::cpu::ops::{attention, AttnShape};
use strata::device::kv_elem::KvElem;

const LAYERS: usize = 30;
const ROUNDS: usize = 15;
/// The KV bytes "dram" walks per round: past the 260 MiB L3 of the Xeon the decode
/// figures in docs/cpu.md come from.
const DRAM_BYTES: usize = 640 << 20;

/// (fastest, median) of the rounds: a shared machine's noise only ever adds time.
fn min_median(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[0], v[v.len() / 2])
}

/// Which attention kernel a run times: `STRATA_BENCH_KERNEL=avx2` the build's AVX2 one
/// (what CPUs without AVX-512 run), else the best this CPU has (the dispatcher's).
#[derive(Clone, Copy, PartialEq)]
enum Kernel {
    Best,
    Avx2,
}

/// `attention` with the build's AVX2 kernel (x86-64-v3 builds, as `.cargo/config.toml`'s).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
mod avx2 {
    use strata::device::cpu::dot::Avx2;
    use strata::device::cpu::ops::{attention_with, AttnShape};
    use strata::device::kv_elem::KvElem;
    use strata::kv::KvRows;

    pub fn attention<T: KvElem>(q: &[f32], k: &[T], v: &[T], out: &mut [f32], s: AttnShape) {
        let (heads, seq) = s.batch_of_one();
        attention_with(Avx2, q, KvRows::from_slices(k, v), out, heads, None, &[seq]);
    }
}

#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
)))]
mod avx2 {
    pub fn attention<T>(_: &[f32], _: &[T], _: &[T], _: &mut [f32], _: super::AttnShape) {
        panic!("STRATA_BENCH_KERNEL=avx2: this build has no AVX2 kernel");
    }
}

fn run<T: KvElem>(ctx: usize, kernel: Kernel) {
    // STRATA_BENCH_KV_HEADS=1 packs the same work into one KV head (3 query heads) over
    // 3× the keys: contiguous keys instead of a 3-head row's stride.
    let one = std::env::var("STRATA_BENCH_KV_HEADS").is_ok_and(|v| v == "1");
    let (nh, nkv, hd, ctx) = if one {
        (3, 1, 64, 3 * ctx)
    } else {
        (9, 3, 64, ctx)
    };
    let mut rng = StdRng::seed_from_u64(1);
    let row = nkv * hd;
    let caches: Vec<(Vec<T>, Vec<T>)> = (0..LAYERS)
        .map(|_| {
            let mut f = || -> Vec<T> {
                (0..ctx * row)
                    .map(|_| T::from_f32(rng.random_range(-1.0..1.0)))
                    .collect()
            };
            (f(), f())
        })
        .collect();
    let q: Vec<f32> = (0..nh * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut out = vec![0.0f32; nh * hd];
    let shape = AttnShape {
        tokens: 1,
        pos0: ctx - 1,
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
    };
    let bytes = (2 * ctx * row * std::mem::size_of::<T>()) as f64;
    // Copies of the 30 (the values only steer the softmax, not the time).
    let dram: Vec<(Vec<T>, Vec<T>)> = caches
        .iter()
        .cycle()
        .take(DRAM_BYTES.div_ceil(bytes as usize).max(LAYERS))
        .cloned()
        .collect();
    for (name, walk) in [
        ("hot", &caches[..1]),
        ("cold", &caches[..]),
        ("dram", &dram[..]),
    ] {
        let calls = walk.len().max(LAYERS);
        let mut times = Vec::new();
        for _ in 0..ROUNDS {
            let t = Instant::now();
            for (k, v) in walk.iter().cycle().take(calls) {
                match kernel {
                    Kernel::Best => attention(&q, k, v, &mut out, shape),
                    Kernel::Avx2 => avx2::attention(&q, k, v, &mut out, shape),
                }
            }
            times.push(t.elapsed().as_secs_f64() * 1e6 / calls as f64);
        }
        let (us, median) = min_median(times);
        println!(
            "{:>5} ctx {ctx:>6} {name:>4}{}: {us:8.1} us/layer (median {median:8.1}), {:6.2} GB/s of KV, {:6.2} ms per 30-layer token",
            T::NAME,
            if kernel == Kernel::Avx2 { " (AVX2)" } else { "" },
            bytes / us / 1e3,
            us * LAYERS as f64 / 1e3
        );
    }
}

fn main() {
    // As `generate` and `bench decode` do: this thread is rayon's worker 0.
    strata::engine::compute_on_this_thread().expect("a compute pool");
    let ctx: usize = std::env::var("STRATA_BENCH_CTX")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4096);
    let kernel = match std::env::var("STRATA_BENCH_KERNEL").as_deref() {
        Ok("avx2") => Kernel::Avx2,
        Ok(other) if !other.is_empty() => panic!("STRATA_BENCH_KERNEL={other}: avx2, or unset"),
        _ => Kernel::Best,
    };
    run::<half::f16>(ctx, kernel);
    run::<f32>(ctx, kernel);
}
