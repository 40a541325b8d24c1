//! Bad input reaches the user as one line naming the cause, a non-zero exit, no panic.

mod common;

use std::path::Path;
use std::process::Command;

use common::{scratch_dir, TinySpec};

/// Runs `strata generate` and returns its stderr, asserting the error contract.
fn generate_err(model: &Path, extra: &[&str], expect: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args(if extra.iter().any(|a| a.starts_with("--prompt")) {
            vec![]
        } else {
            vec!["--prompt", "hello"]
        })
        .args(extra)
        .arg("--json") // no progress bar: stderr holds only the error
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure for {expect:?}, got success"
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "exit code for {expect:?}: {stderr}"
    );
    assert!(
        !stderr.contains("panicked"),
        "panic for {expect:?}: {stderr}"
    );
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "expected one line for {expect:?}, got: {stderr}"
    );
    assert!(lines[0].starts_with("error: "), "{stderr}");
    assert!(stderr.contains(expect), "expected {expect:?} in: {stderr}");
    assert!(out.stdout.is_empty(), "nothing on stdout on error");
}

fn tiny_dir(name: &str) -> std::path::PathBuf {
    let dir = scratch_dir(name);
    TinySpec::llama().write(&dir, 5);
    dir
}

/// Rewrites the tiny model's weights after `edit` changes the tensor map.
fn with_tensors(
    name: &str,
    edit: impl FnOnce(&mut std::collections::HashMap<String, candle_core::Tensor>),
) -> std::path::PathBuf {
    let dir = tiny_dir(name);
    let mut w = TinySpec::llama().weights(5);
    edit(&mut w);
    candle_core::safetensors::save(&w, dir.join("model.safetensors")).unwrap();
    dir
}

#[test]
fn missing_model_file() {
    generate_err(
        Path::new("/nonexistent/model.gguf"),
        &[],
        "model not found: /nonexistent/model.gguf",
    );
}

#[test]
fn truncated_safetensors() {
    let dir = tiny_dir("err_truncated");
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    generate_err(&dir, &[], "invalid safetensors file");
}

#[test]
fn header_claims_more_bytes_than_the_file_has() {
    let dir = tiny_dir("err_header");
    let p = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&p).unwrap();
    let claimed = bytes.len() as u64 * 4;
    bytes[..8].copy_from_slice(&claimed.to_le_bytes());
    std::fs::write(&p, &bytes).unwrap();
    generate_err(&dir, &[], "invalid safetensors file");
}

#[test]
fn wrong_shape() {
    let dir = with_tensors("err_shape", |w| {
        let t =
            candle_core::Tensor::zeros((3, 7), candle_core::DType::F32, &candle_core::Device::Cpu)
                .unwrap();
        w.insert("model.layers.0.self_attn.q_proj.weight".into(), t);
    });
    generate_err(
        &dir,
        &[],
        "tensor `model.layers.0.self_attn.q_proj.weight` has shape [3, 7], expected [64, 64]",
    );
}

#[test]
fn wrong_dtype() {
    let dir = with_tensors("err_dtype", |w| {
        let t = candle_core::Tensor::zeros(64, candle_core::DType::U8, &candle_core::Device::Cpu)
            .unwrap();
        w.insert("model.norm.weight".into(), t);
    });
    generate_err(&dir, &[], "unsupported dtype");
}

#[test]
fn missing_tensor() {
    let dir = with_tensors("err_missing", |w| {
        w.remove("model.layers.1.mlp.down_proj.weight");
    });
    generate_err(
        &dir,
        &[],
        "missing tensor `model.layers.1.mlp.down_proj.weight`",
    );
}

#[test]
fn unknown_architecture() {
    let dir = tiny_dir("err_arch");
    let cfg = TinySpec::llama()
        .config_json()
        .replace("LlamaForCausalLM", "GPTNeoXForCausalLM");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    generate_err(&dir, &[], "unsupported architecture `GPTNeoXForCausalLM`");
}

#[test]
fn sliding_window_attention() {
    let dir = scratch_dir("err_sliding");
    let spec = TinySpec::qwen2();
    spec.write(&dir, 5);
    let cfg = spec.config_json().replace(
        "\"use_sliding_window\":false",
        "\"use_sliding_window\":true",
    );
    assert!(cfg.contains("\"use_sliding_window\":true"));
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    generate_err(&dir, &[], "use_sliding_window is true");
}

#[test]
fn malformed_config() {
    let dir = tiny_dir("err_config");
    std::fs::write(dir.join("config.json"), "{\"hidden_size\": 64,").unwrap();
    generate_err(&dir, &[], "malformed config.json");
}

#[test]
fn invalid_config_values() {
    let dir = tiny_dir("err_config_values");
    let cfg = TinySpec::llama()
        .config_json()
        .replace("\"num_key_value_heads\":2", "\"num_key_value_heads\":3");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    generate_err(&dir, &[], "not a multiple of num_key_value_heads");
}

#[test]
fn gguf_bad_magic() {
    let dir = scratch_dir("err_magic");
    let p = dir.join("model.gguf");
    std::fs::write(&p, b"GGML\x03\x00\x00\x00 this is not a gguf file").unwrap();
    generate_err(&p, &[], "not a GGUF file (bad magic)");
}

#[test]
fn truncated_gguf() {
    let src = common::require_default_model();
    let dir = scratch_dir("err_gguf_trunc");
    let p = dir.join("model.gguf");
    let bytes = std::fs::read(src).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 3]).unwrap();
    generate_err(&p, &[], "truncated GGUF file");
}

#[test]
fn empty_prompt() {
    generate_err(&tiny_dir("err_empty"), &["--prompt", ""], "empty prompt");
}

#[test]
fn prompt_longer_than_context() {
    let dir = tiny_dir("err_long");
    // The tiny tokenizer is byte-level: 600 bytes are 600 tokens, over max_position_embeddings 512.
    let long = "a".repeat(600);
    generate_err(
        &dir,
        &["--prompt", &long],
        "longer than the model's maximum context of 512",
    );
}

#[test]
fn no_cuda_device() {
    if strata::device::cuda::probe().is_ok() {
        return; // a machine with CUDA: nothing to check here
    }
    generate_err(
        &tiny_dir("err_cuda"),
        &["--device", "cuda"],
        "no CUDA driver found",
    );
}

#[test]
fn offload_needs_two_ring_slots() {
    generate_err(
        &tiny_dir("err_ring"),
        &["--enable-offload", "--num-kv-buffers", "1"],
        "--num-kv-buffers must be at least 2",
    );
}

#[test]
fn offload_host_kv_too_small_for_the_prompt() {
    let long = "b".repeat(100);
    generate_err(
        &tiny_dir("err_host_kv"),
        &[
            "--prompt",
            &long,
            "--enable-offload",
            "--block-size",
            "16",
            "--num-cpu-blocks",
            "2",
        ],
        "host KV too small for the prompt: 100 tokens",
    );
}

#[test]
fn no_cuda_device_with_offload() {
    if strata::device::cuda::probe().is_ok() {
        return;
    }
    generate_err(
        &tiny_dir("err_cuda_offload"),
        &["--device", "cuda", "--enable-offload"],
        "no CUDA driver found",
    );
}

#[test]
fn profile_steps_need_cuda() {
    generate_err(
        &tiny_dir("err_profile"),
        &["--profile-steps", "1:3"],
        "--profile-steps needs --device cuda",
    );
}

/// The gpu-check subcommands fail with one line, never a panic, without a GPU.
#[test]
fn cuda_subcommands_without_driver() {
    if strata::device::cuda::probe().is_ok() {
        return;
    }
    for sub in ["kernels", "logits", "offload", "bandwidth", "bench-offload"] {
        let out = Command::new(env!("CARGO_BIN_EXE_strata-gpucheck"))
            .arg(sub)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{sub}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{sub}: {stderr}");
        assert!(stderr.contains("no CUDA driver found"), "{sub}: {stderr}");
        assert!(!stderr.contains("panicked"), "{sub}: {stderr}");
    }
}

#[test]
fn offload_host_kv_larger_than_memory() {
    generate_err(
        &tiny_dir("err_host_oom"),
        &["--enable-offload", "--num-cpu-blocks", "100000000"],
        "of memory is available",
    );
}
