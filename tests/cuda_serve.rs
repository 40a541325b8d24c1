//! The serving path on the CUDA model, run by the kernel emulator (gpu-check step 6 on the
//! emulator, `gpucheck::serve_checks`): the batched forward over a page pool is
//! batch-invariant (a sequence's logits are bitwise the same alone, inside batches of
//! 2…16 random companions, and however its prompt was chunked) and close to the f32 CPU
//! model; the serving engine on it keeps tokens and log-probs bitwise under preemption
//! with (sanitized) host offload and with recomputation, and its greedy tokens equal the
//! CPU engine's; prompt log-probabilities take the right rows, batch-invariant. Once on a
//! tiny Qwen3, once on a tiny Gemma 3 whose windows are shorter than the requests, and
//! (batch invariance and preemption) on transformers' tiny random Qwen3.5 dense and MoE, whose state
//! layers run each sequence's rows from its own recurrent state, and gpt-oss (sinks, windows,
//! experts).

use strata::gpucheck::kernels::format_table;
use strata::gpucheck::serve_checks::{disk_case, serve_check_emulated};
use strata::model::random::Shape;

#[test]
fn serving_path_on_the_emulator_is_batch_invariant_and_bitwise_under_preemption() {
    let rows = serve_check_emulated().unwrap();
    eprint!("{}", format_table(&rows));
    // tiny Qwen3 5, tiny Gemma 3 5, Qwen3.5 4, its MoE 3, gpt-oss 4
    assert_eq!(rows.len(), 21);
    let failed: Vec<_> = rows.iter().filter(|r| !r.pass).collect();
    assert!(failed.is_empty(), "failed: {failed:#?}");
}

/// The disk tier under the CUDA model (its pages on the CPU device in bf16, as on a GPU):
/// spills and loads bitwise, a restart reuses the persisted prefix, a corrupted slot is
/// never used.
#[test]
fn the_disk_tier_runs_under_the_cuda_model_bitwise_across_restarts_and_corruption() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda_serve_disk");
    let emu = strata::gpucheck::emu::emulator_serve_engine;
    let rows = disk_case(&emu, "tiny", Shape::tiny(), &dir).unwrap();
    eprint!("{}", format_table(&rows));
    assert_eq!(rows.len(), 3);
    let failed: Vec<_> = rows.iter().filter(|r| !r.pass).collect();
    assert!(failed.is_empty(), "failed: {failed:#?}");
}
