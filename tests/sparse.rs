//! Sparse decode over offloaded KV (#15): Quest's bound is an upper bound and the selection
//! keeps every page it must (brute force on random data, f32 and bf16); a budget that holds
//! the whole context is bit-for-bit full offload (tokens and log-probs) across ring, block
//! and page sizes; a small budget really selects, and its results do not change under the
//! sanitizer's delays; bad settings are clear errors.

mod common;

use std::process::Command;
use std::sync::Arc;

use common::sparse_oracle::Oracle;
use common::{bits, random_prompt, scratch_dir, TinySpec};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};
use strata::device::cpu::ops::AttnHeads;
use strata::device::KvElem;
use strata::engine::{self, GenerateOptions, GenerationOutput, SamplingParams};
use strata::kv::KvCache;
use strata::model::Model;
use strata::offload::{CpuOffloadEngine, OffloadConfig, OffloadControl};
use strata::sparse::{self, SparseConfig, SparseStats};

fn tiny(spec: TinySpec, name: &str) -> Arc<Model> {
    common::load_tiny(spec, name, 33)
}

fn run(
    model: &Arc<Model>,
    cfg: OffloadConfig,
    prompt: &[u32],
    n: usize,
) -> (GenerationOutput, Option<SparseStats>) {
    let opts = GenerateOptions {
        max_tokens: n,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
    };
    let mut kv = CpuOffloadEngine::on_cpu(&model.cfg, cfg).unwrap();
    let cap = kv.capacity();
    let out = engine::generate_with(model, &mut kv, cap, prompt, &opts, &mut |_| Ok(())).unwrap();
    (out, kv.sparse_stats())
}

#[test]
fn a_budget_holding_the_context_is_bitwise_full_offload() {
    let mut rng = StdRng::seed_from_u64(3);
    for (spec, name) in [
        (TinySpec::llama(), "sparse_llama"),
        (TinySpec::qwen3(), "sparse_qwen3"),
    ] {
        let model = tiny(spec, name);
        for (nb, bs, page, len) in [(2, 16, 4, 37), (3, 32, 8, 100), (4, 16, 16, 70)] {
            let prompt = random_prompt(&mut rng, len, model.cfg.vocab_size);
            let n = 60; // crosses block boundaries: flushes and new candidate pages
            let max_len = len + n + 1;
            let full_cfg = OffloadConfig {
                num_kv_buffers: nb,
                block_size: bs,
                max_model_len: max_len,
                ..Default::default()
            };
            let budget = max_len.div_ceil(page) * page + bs;
            let sparse_cfg = OffloadConfig {
                sparse: Some(SparseConfig {
                    budget,
                    page_size: page,
                }),
                ..full_cfg.clone()
            };
            let (full, _) = run(&model, full_cfg, &prompt, n);
            let (sp, stats) = run(&model, sparse_cfg, &prompt, n);
            let ctx = format!("{name}: ring {nb}, block {bs}, page {page}, prompt {len}");
            assert_eq!(sp.token_ids, full.token_ids, "{ctx}");
            assert_eq!(bits(&sp.logprobs), bits(&full.logprobs), "{ctx}");
            let stats = stats.expect("sparse stats");
            assert_eq!(
                stats.selections, 0,
                "{ctx}: everything fits, nothing is scored"
            );
            assert!(stats.hit_pages > 0, "{ctx}: {stats:?}");
        }
    }
}

/// A budget far below the context: the engine selects at every layer and step, and the
/// sanitizer (random copy delays, NaN in released slots and at reset) changes nothing.
#[test]
fn small_budget_selects_and_is_unchanged_under_the_sanitizer() {
    let mut rng = StdRng::seed_from_u64(4);
    let model = tiny(TinySpec::llama(), "sparse_sanitized");
    let prompt = random_prompt(&mut rng, 150, model.cfg.vocab_size);
    let n = 40;
    let cfg = |sanitize| OffloadConfig {
        num_kv_buffers: 3,
        block_size: 16,
        max_model_len: 200,
        sanitize,
        sparse: Some(SparseConfig {
            budget: 48,
            page_size: 8,
        }),
        ..Default::default()
    };
    let (plain, stats) = run(&model, cfg(false), &prompt, n);
    let stats = stats.unwrap();
    // n tokens: the first from prefill, then n - 1 decode steps.
    assert_eq!(
        stats.selections,
        (n - 1) * model.cfg.num_layers,
        "{stats:?}"
    );
    assert!(stats.miss_pages > 0 && stats.hit_pages > 0, "{stats:?}");
    for _ in 0..2 {
        let (sanitized, s2) = run(&model, cfg(true), &prompt, n);
        assert_eq!(sanitized.token_ids, plain.token_ids);
        assert_eq!(bits(&sanitized.logprobs), bits(&plain.logprobs));
        assert_eq!(s2.unwrap(), stats, "same selections, same hits");
    }
}

/// `n` keys of `row` channels, values in ±3 with mixed signs.
fn random_keys<T: From32>(rng: &mut StdRng, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| T::from32(rng.random_range(-3.0f32..3.0)))
        .collect()
}

trait From32: KvElem {
    fn from32(x: f32) -> Self;
}
impl From32 for f32 {
    fn from32(x: f32) -> Self {
        x
    }
}
impl From32 for bf16 {
    fn from32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

fn dot64<T: KvElem>(q: &[f32], k: &[T]) -> f64 {
    q.iter()
        .zip(k)
        .map(|(a, b)| *a as f64 * b.to_f32() as f64)
        .sum()
}

/// The documented page score (`sparse::page_scores`), recomputed independently: each
/// page's best rank over the query heads by a full sort of each head's bounds (ties: the
/// earlier page), capped at `depth`, and its share (per query head, a softmax over pages
/// `1..` of `bound / √head_dim`, summed over the heads) in f64.
fn page_scores_ref(
    per_head: &[f32],
    heads: AttnHeads,
    pages: usize,
    depth: usize,
) -> Vec<(u32, f64)> {
    let n = heads.num_heads;
    let mut score = vec![(depth.min(pages - 1) as u32, 0.0f64); pages];
    for h in 0..n {
        let b = |p: usize| per_head[p * n + h] as f64 / (heads.head_dim as f64).sqrt();
        let max = (1..pages).map(b).fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = (1..pages).map(|p| (b(p) - max).exp()).sum();
        for (p, s) in score.iter_mut().enumerate().skip(1) {
            s.1 += (b(p) - max).exp() / z;
        }
        let mut order: Vec<usize> = (1..pages).collect();
        order.sort_by(|&x, &y| {
            per_head[y * n + h]
                .total_cmp(&per_head[x * n + h])
                .then(x.cmp(&y))
        });
        for (r, &p) in order.iter().enumerate() {
            score[p].0 = score[p].0.min(r as u32);
        }
    }
    score
}

/// Brute force over random pages: the box bound is what its definition gives from the
/// keys (each key halved `KEY_BITS` times into its box), never above the halves bound (one
/// halving) nor Quest's; every key's score under a query head is at most its page's
/// bound for that head; the selection is the sink and the `k` best pages by the
/// documented score (checked against an f64 recomputation); and no page whose true score
/// exceeds a chosen page's bound under every query head is left out (the score is monotone
/// in each head's bound), so the selection cannot drop a page that must be kept.
fn bound_and_selection_vs_brute_force<T: From32>() {
    let mut rng = StdRng::seed_from_u64(9);
    let (mut dominated_cases, mut tighter) = (0, 0);
    for case in 0..300 {
        let heads = AttnHeads::causal(
            [1, 4, 6][case % 3],
            [1, 2, 3][case % 3],
            [8, 16, 5][case % 3],
        );
        let (row, hd) = (heads.num_kv_heads * heads.head_dim, heads.head_dim);
        let group = heads.num_heads / heads.num_kv_heads;
        // Pages past 16 tokens need a second mask row.
        let page = [rng.random_range(1..9), rng.random_range(15..40)][case % 2];
        let pages = rng.random_range(2..30);
        let keys: Vec<T> = random_keys(&mut rng, pages * page * row);
        let q: Vec<f32> = (0..heads.num_heads * hd)
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        let rows = sparse::meta_rows(page);
        let mut meta = vec![T::from32(0.0); pages * rows * row];
        sparse::page_bounds(&keys, row, page, &mut meta);
        let per_head = sparse::head_bounds(&q, &meta, heads, pages, page);
        // The box bound recomputed from the keys themselves (each key's box of its page's
        // range found here by halving, not read from the mask), never above the halves
        // bound (the first halving alone) nor Quest's.
        for p in 0..pages {
            let (min, max) = (
                &meta[p * rows * row..][..row],
                &meta[(p * rows + 1) * row..][..row],
            );
            for h in 0..heads.num_heads {
                let (g, qh) = ((h / group) * hd, &q[h * hd..][..hd]);
                let (mut want, mut halves) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for t in 0..page {
                    let k = &keys[(p * page + t) * row + g..][..hd];
                    let (mut s, mut s1) = (0.0f32, 0.0f32);
                    for c in 0..hd {
                        let (mut lo, mut hi) = (min[g + c].to_f32(), max[g + c].to_f32());
                        for halving in 0..sparse::KEY_BITS {
                            let m = (lo + (hi - lo) * 0.5).min(hi);
                            (lo, hi) = if k[c].to_f32() >= m { (m, hi) } else { (lo, m) };
                            if halving == 0 {
                                s1 += (qh[c] * lo).max(qh[c] * hi);
                            }
                        }
                        s += (qh[c] * lo).max(qh[c] * hi);
                    }
                    want = want.max(s);
                    halves = halves.max(s1);
                }
                let got = per_head[p * heads.num_heads + h];
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "case {case}: page {p} head {h}"
                );
                // Quest's bound, summed in the same channel order.
                let mut quest = 0.0f32;
                for c in 0..hd {
                    let (lo, hi) = (min[g + c].to_f32(), max[g + c].to_f32());
                    quest += (qh[c] * lo).max(qh[c] * hi);
                }
                assert!(got <= quest, "case {case}: {got} above Quest's {quest}");
                assert!(
                    got <= halves,
                    "case {case}: {got} above the halves bound {halves}"
                );
                tighter += usize::from(got < halves);
            }
        }
        let k = rng.random_range(0..pages);
        let scores = sparse::page_scores(&per_head, heads, pages, k);
        // The true best score of each page under each query head: max over its keys.
        let n = heads.num_heads;
        let mut true_max = vec![f64::NEG_INFINITY; pages * n];
        for p in 0..pages {
            for t in 0..page {
                let k = &keys[(p * page + t) * row..][..row];
                for h in 0..n {
                    let g = h / group;
                    let s = dot64(&q[h * hd..][..hd], &k[g * hd..][..hd]);
                    true_max[p * n + h] = true_max[p * n + h].max(s);
                }
            }
        }
        let tol = 1e-4 * hd as f64;
        for (i, (&b, &t)) in per_head.iter().zip(&true_max).enumerate() {
            assert!(
                b as f64 + tol >= t,
                "case {case}: page {} head {} bound {b} below a key's score {t}",
                i / n,
                i % n
            );
        }
        let want = page_scores_ref(&per_head, heads, pages, k);
        for p in 1..pages {
            let (got, (rank, share)) = (scores[p], want[p]);
            assert!(
                got.best_rank == rank && (got.share as f64 - share).abs() <= 1e-4 * n as f64,
                "case {case}: page {p} scores {got:?} (reference: rank {rank}, share {share})"
            );
        }
        let chosen = sparse::choose(&sparse::rank(&scores, pages, k), pages, k);
        assert_eq!(chosen.len(), pages.min(1 + k));
        assert_eq!(chosen[0], 0, "the sink page is always kept");
        assert!(chosen.windows(2).all(|w| w[0] < w[1]), "ascending");
        let picked: Vec<usize> = chosen.iter().skip(1).map(|&p| p as usize).collect();
        for u in 1..pages {
            if picked.contains(&u) {
                continue;
            }
            for &s in &picked {
                // The top-k order itself, by brute force over the scores (ties: earlier).
                let key = |p: usize| (scores[p].best_rank, -scores[p].share, p);
                let (ku, ks) = (key(u), key(s));
                assert!(
                    ks.0 < ku.0 || (ks.0 == ku.0 && (ks.1 < ku.1 || (ks.1 == ku.1 && s < u))),
                    "case {case}: {u} ({:?}) outranks chosen {s} ({:?})",
                    scores[u],
                    scores[s]
                );
            }
        }
        // A page whose keys beat a chosen page's bound under every head is chosen too.
        for u in 1..pages {
            for &s in &picked {
                let dominates =
                    (0..n).all(|h| true_max[u * n + h] > per_head[s * n + h] as f64 + tol);
                if dominates {
                    dominated_cases += 1;
                    assert!(
                        picked.contains(&u),
                        "case {case}: page {u} left out though under every head a key scores above chosen page {s}'s bound"
                    );
                }
            }
        }
    }
    assert!(
        dominated_cases > 0,
        "the data never exercises the domination property"
    );
    assert!(
        tighter > 0,
        "the box bound is never tighter than the halves bound"
    );
}

#[test]
fn box_bound_and_selection_vs_brute_force_f32() {
    bound_and_selection_vs_brute_force::<f32>();
}

#[test]
fn box_bound_and_selection_vs_brute_force_bf16() {
    bound_and_selection_vs_brute_force::<bf16>();
}

fn strata(args: &[&str]) -> (bool, String) {
    let model = common::require_default_model();
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .arg("--model")
        .arg(model)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn bad_sparse_settings_are_clear_errors() {
    let gen = ["generate", "--prompt", "hi", "--max-tokens", "2"];
    for (extra, want) in [
        (vec!["--sparse-budget", "512"], "add --enable-offload"),
        (
            vec!["--enable-offload", "--sparse-budget", "500"],
            "multiple of --sparse-page-size",
        ),
        (
            vec!["--enable-offload", "--sparse-budget", "256"],
            "below the sink page plus the recent window",
        ),
        (
            vec![
                "--enable-offload",
                "--sparse-budget",
                "512",
                "--sparse-page-size",
                "24",
            ],
            "must divide --block-size",
        ),
        (vec!["--enable-offload", "--sparse-budget", "0"], "0"),
    ] {
        let args: Vec<&str> = gen.iter().copied().chain(extra.iter().copied()).collect();
        let (ok, stderr) = strata(&args);
        assert!(!ok, "{args:?} was accepted");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// The engine's rows are the oracle's (`Replay`, also `bench sparse-eval`'s), bit for bit:
/// a tiny Qwen3 at two ring, block and page sizes, and a tiny Gemma 3 (windows of 24),
/// whose full-attention layer selects while the windowed ones attend their window exactly.
#[test]
fn small_budget_attends_exactly_the_oracles_rows() {
    let mut rng = StdRng::seed_from_u64(6);
    let qwen3 = tiny(TinySpec::qwen3(), "sparse_oracle");
    let gemma3 = common::tiny_gemma3(24);
    for (model, nb, bs, page, budget) in [
        (&qwen3, 2, 16, 8, 48),
        (&qwen3, 4, 32, 4, 64),
        (&gemma3, 2, 16, 8, 48),
    ] {
        let c = &model.cfg;
        let prompt = random_prompt(&mut rng, 150, c.vocab_size);
        let (n, cap) = (40, 200);
        let sc = SparseConfig {
            budget,
            page_size: page,
        };
        let cfg = OffloadConfig {
            num_kv_buffers: nb,
            block_size: bs,
            max_model_len: cap,
            sparse: Some(sc),
            ..Default::default()
        };
        let (got, stats) = run(model, cfg, &prompt, n);
        assert!(stats.unwrap().miss_pages > 0, "the miss path runs");
        let mut oracle = Oracle::<f32>::new(c, sc, bs, cap);
        let opts = common::greedy(n);
        let want = engine::generate_with(model, &mut oracle, cap, &prompt, &opts, &mut |_| Ok(()))
            .unwrap();
        let what = format!("{:?}, ring {nb} block {bs}", c.arch);
        assert_eq!(got.token_ids, want.token_ids, "{what}");
        assert_eq!(bits(&got.logprobs), bits(&want.logprobs), "{what}");
    }
}

/// The first decode step's prefetch comes from the prompt's last token's query: the
/// prefill ranks each layer's pages with it once their bounds exist. Driven by hand so that
/// the first decode query *is* that query: then the prediction holds every chosen page and
/// nothing is fetched synchronously. (Without the prefill's ranking the first step
/// prefetches the sink and the most recent pages, and the best pages of random keys miss.)
#[test]
fn the_prompts_last_query_predicts_the_first_decode_step() {
    let mut rng = StdRng::seed_from_u64(8);
    let model = tiny(TinySpec::llama(), "sparse_first_step");
    let c = &model.cfg;
    let (prompt, row) = (150, c.kv_dim());
    let cfg = OffloadConfig {
        num_kv_buffers: 3,
        block_size: 16,
        max_model_len: 200,
        sparse: Some(SparseConfig {
            budget: 48,
            page_size: 8,
        }),
        ..Default::default()
    };
    let mut e = CpuOffloadEngine::on_cpu(c, cfg).unwrap();
    let q: Vec<f32> = (0..c.num_heads * c.head_dim)
        .map(|_| rng.random_range(-3.0f32..3.0))
        .collect();
    // Writes `rows` random K and V rows into the layer's slot from row `at`.
    let mut fill = |slot: strata::kv::LayerSlot<f32>, at: usize, rows: usize| {
        for p in [slot.k, slot.v] {
            let kv: Vec<f32> = random_keys(&mut rng, rows * row);
            // SAFETY: the CPU device's slot is host memory of `slot.rows` rows, handed to
            // this thread (the compute stream) until `end_layer`.
            unsafe {
                assert!(at + rows <= slot.rows);
                let dst = p.as_host_ptr().add(at * row);
                std::ptr::copy_nonoverlapping(kv.as_ptr(), dst, kv.len());
            }
        }
    };
    e.begin_step(0, prompt).unwrap();
    for l in 0..c.num_layers {
        let slot = e.begin_layer(l).unwrap();
        assert_eq!(e.select_rows(l, q[..].into()).unwrap(), None, "prefill");
        fill(slot, 0, prompt);
        e.end_layer(l).unwrap();
    }
    e.begin_step(prompt, 1).unwrap();
    for l in 0..c.num_layers {
        let slot = e.begin_layer(l).unwrap();
        let new_row = e.select_rows(l, q[..].into()).unwrap().expect("selects");
        fill(slot, new_row.0, 1);
        e.end_layer(l).unwrap();
    }
    let stats = e.sparse_stats().unwrap();
    assert_eq!(stats.selections, c.num_layers, "{stats:?}");
    assert!(stats.hit_pages > 0, "{stats:?}");
    assert_eq!(stats.miss_pages, 0, "{stats:?}");
}

/// `bench offload --json` in rounds: each budget's speedup is the median of the rounds'
/// full ÷ sparse step ratios, between its reported minimum and maximum, with one step time,
/// link and compute-only time per round, and where the sparse step's own work goes.
#[test]
fn bench_offload_reports_the_median_of_its_rounds() {
    let dir = scratch_dir("sparse_bench_rounds");
    TinySpec::llama().write(&dir, 9);
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["bench", "offload", "--model"])
        .arg(&dir)
        .args([
            "--context",
            "128",
            "--block-size",
            "16",
            "--decode-steps",
            "3",
        ])
        .args([
            "--rounds",
            "3",
            "--sparse-budget",
            "48,32",
            "--sparse-verify",
            "2",
        ])
        .args(["--transfer-over-compute", "2", "--json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let floats = |v: &serde_json::Value| -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let fulls = floats(&r["decode_step_ms_offload_per_round"]);
    assert_eq!(fulls.len(), 3);
    assert_eq!(floats(&r["link_gbps_per_round"]).len(), 3);
    assert_eq!(floats(&r["decode_step_ms_compute_only_per_round"]).len(), 3);
    let verified = r["verified"].as_array().unwrap();
    assert_eq!(verified.len(), 2, "a verified row per budget");
    for row in verified {
        assert_eq!(row["verify"], 2, "{row}");
        let kept = row["acceptance"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&kept), "{row}");
    }
    for (i, row) in r["sparse"]
        .as_array()
        .unwrap()
        .iter()
        .chain(verified)
        .enumerate()
    {
        let steps = floats(&row["decode_step_ms_per_round"]);
        let mut ratios: Vec<f64> = fulls.iter().zip(&steps).map(|(f, s)| f / s).collect();
        ratios.sort_by(f64::total_cmp);
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs();
        let get = |k: &str| row[k].as_f64().unwrap();
        assert!(close(get("decode_speedup"), ratios[1]), "{row}");
        assert!(close(get("decode_speedup_min"), ratios[0]), "{row}");
        assert!(close(get("decode_speedup_max"), ratios[2]), "{row}");
        let mut sorted = steps.clone();
        sorted.sort_by(f64::total_cmp);
        assert!(close(get("decode_step_ms"), sorted[1]), "{row}");
        assert!((0.0..=1.0).contains(&get("prefetch_hit_rate")), "{row}");
        let bytes = get("bytes_per_step_ratio");
        // Verified rows load the whole KV once a round, and the drafts' pages too.
        assert!(bytes > 0.0 && (bytes < 1.0 || i >= 2), "{row}");
        // Where the sparse step goes: scoring ran every step, and the parts (a mean over
        // the traced steps) fit in the slowest round's step.
        let part = |k: &str| row["step_parts"][k].as_f64().unwrap();
        assert!(part("scoring_ms") > 0.0, "{row}");
        let parts = [
            "scoring_ms",
            "miss_waits_ms",
            "moves_ms",
            "prefetch_waits_ms",
        ];
        assert!(parts.iter().all(|k| part(k) >= 0.0), "{row}");
        let sum: f64 = parts.iter().map(|k| part(k)).sum();
        assert!(sum <= sorted[2], "{row}");
    }
    assert_eq!(r["decode_speedup"], r["sparse"][0]["decode_speedup"]);
}
