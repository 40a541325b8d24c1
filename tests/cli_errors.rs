//! Bad input reaches the user as one line naming the cause, a non-zero exit, no panic.

mod common;

use std::path::Path;
use std::process::Command;

use common::{scratch_dir, TinySpec};

/// Runs `strata generate` and asserts the error contract (exit 1).
fn generate_err(model: &Path, extra: &[&str], expect: &str) {
    generate_err_code(model, extra, expect, 1)
}

fn generate_err_code(model: &Path, extra: &[&str], expect: &str, code: i32) {
    let mut args: Vec<std::ffi::OsString> = vec!["generate".into(), "--model".into(), model.into()];
    if !extra.iter().any(|a| a.starts_with("--prompt")) {
        args.extend(["--prompt".into(), "hello".into()]);
    }
    args.extend(extra.iter().map(Into::into));
    args.push("--json".into()); // no progress bar: stderr holds only the error
    assert_error(env!("CARGO_BIN_EXE_strata"), &args, expect, code);
}

/// Runs `bin` with `args` (and RUST_BACKTRACE=1, which must not leak a backtrace) and
/// asserts the contract: exit `code`, exactly one `error:` line on stderr naming
/// `expect`, nothing on stdout, no panic.
fn assert_error<S: AsRef<std::ffi::OsStr>>(bin: &str, args: &[S], expect: &str, code: i32) {
    let mut child = Command::new(bin)
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // No case may hang: a FIFO model or a runaway template must fail within seconds.
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > std::time::Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("hung for {expect:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(code),
        "exit code for {expect:?}: {stderr}"
    );
    assert!(
        !stderr.contains("panicked") && !stderr.contains("backtrace"),
        "panic or backtrace for {expect:?}: {stderr}"
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
    generate_err_code(
        &tiny_dir("err_ring"),
        &["--enable-offload", "--num-kv-buffers", "1"],
        "1 is not in 2..=64 (see `strata generate --help`)",
        2,
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

/// `--offload-experts` streams experts to a GPU: on the CPU device, or for a model without
/// experts, it is one line naming the cause, before anything loads onto a device.
#[test]
fn offload_experts_needs_cuda_and_experts() {
    generate_err(
        &tiny_dir("err_experts_cpu"),
        &["--offload-experts"],
        "--offload-experts streams experts to the GPU: add --device cuda",
    );
    // A dense model (the check the CLI reaches once a GPU is found).
    let dense = strata::model::Model::peek_config(&tiny_dir("err_experts_dense")).unwrap();
    let mut scfg = strata::SessionConfig::new(strata::device::DeviceKind::Cuda, 64);
    scfg.offload_experts = Some(strata::offload::experts::ExpertOffload {
        slots: 2,
        check_order: false,
        sanitize: false,
    });
    let e = scfg.plan(&dense).unwrap_err().to_string();
    assert!(e.contains("this model has no experts"), "{e}");
    let gpt_oss = common::tiny_gpt_oss_dir("err_experts_gpt_oss");
    let zero = [
        "--offload-experts",
        "--num-expert-buffers",
        "0",
        "--device",
        "cuda",
    ];
    generate_err_code(&gpt_oss, &zero, "--num-expert-buffers", 2);
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
        &["--enable-offload", "--num-cpu-blocks", "16777216"],
        "of memory is available",
    );
}

// ---------------------------------------------------------------------------------------
// Hostile inputs (issue #11): each once made a binary panic, abort, hang, leak a
// multi-line error or accept garbage.

use candle_core::quantized::gguf_file::Value as G;
use strata::fuzz::{corpus, gguf_writer::GgufDoc};

/// The fuzzer's tiny valid GGUF (Llama layout) with `edit` applied, written to a file.
fn gguf_with(name: &str, edit: impl FnOnce(&mut GgufDoc)) -> std::path::PathBuf {
    let mut doc = corpus::gguf_doc("llama");
    edit(&mut doc);
    let p = scratch_dir(name).join("model.gguf");
    std::fs::write(&p, doc.to_bytes()).unwrap();
    p
}

fn set_meta(doc: &mut GgufDoc, key: &str, v: G) {
    doc.metadata.retain(|(k, _)| k != key);
    doc.metadata.push((key.to_string(), v));
}

#[test]
fn the_tiny_gguf_itself_loads() {
    // The base of the cases below is valid: each error comes from its one edit.
    let p = gguf_with("gguf_ok", |_| {});
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "generate",
            "--max-tokens",
            "2",
            "--json",
            "--prompt",
            "hello",
            "--model",
        ])
        .arg(&p)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn gguf_alignment_zero_is_refused_not_a_division_by_zero() {
    // Twice: candle keeps the last of duplicate keys, so the check must too.
    let p = gguf_with("gguf_align0", |d| {
        d.metadata.push(("general.alignment".into(), G::U32(0)))
    });
    generate_err(&p, &[], "general.alignment is 0");
    let p = gguf_with("gguf_align3", |d| {
        set_meta(d, "general.alignment", G::U32(3))
    });
    generate_err(&p, &[], "general.alignment must be a power of two");
}

#[test]
fn gguf_tensor_offsets_must_be_aligned_and_disjoint() {
    let p = gguf_with("gguf_misaligned", |d| {
        d.tensors[1].offset = Some(36_000 + 1)
    });
    generate_err(&p, &[], "not a multiple of the alignment 32");
    let p = gguf_with("gguf_overlap", |d| d.tensors[2].offset = Some(0));
    generate_err(&p, &[], "overlap");
    // A shape whose element count wraps 64 bits.
    let p = gguf_with("gguf_wrap", |d| d.tensors[0].dims = vec![1 << 40, 1 << 40]);
    generate_err(&p, &[], "element count overflows");
}

#[test]
fn huge_layer_counts_are_refused_before_allocating() {
    let p = gguf_with("gguf_layers", |d| {
        set_meta(d, "llama.block_count", G::U64(u64::MAX))
    });
    generate_err(&p, &[], "num_hidden_layers = 18446744073709551615 is above");
    // Within the bound but past the tensors present.
    let p = gguf_with("gguf_layers2", |d| {
        set_meta(d, "llama.block_count", G::U32(1000))
    });
    generate_err(
        &p,
        &[],
        "the config names 1000 layers but the weights have no `blk.999.attn_norm.weight`",
    );
    let dir = tiny_dir("err_hf_layers");
    let cfg = TinySpec::llama()
        .config_json()
        .replace("\"num_hidden_layers\":3", "\"num_hidden_layers\":1000");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    generate_err(&dir, &[], "the config names 1000 layers");
}

#[test]
fn a_head_dim_whose_products_wrap_is_refused() {
    let p = gguf_with("gguf_head_dim", |d| {
        set_meta(d, "llama.attention.key_length", G::U64(1 << 62))
    });
    generate_err(
        &p,
        &[],
        "head_dim = 4611686018427387904 is above the supported limit of 1024",
    );
}

#[test]
fn meaningless_rope_and_norm_values_are_refused() {
    for (i, (key, v, expect)) in [
        (
            "llama.rope.scaling.factor",
            G::F32(0.0),
            "factor must be a finite number > 0",
        ),
        (
            "llama.rope.scaling.factor",
            G::F32(-2.0),
            "factor must be a finite number > 0",
        ),
        (
            "llama.rope.scaling.factor",
            G::F32(f32::NAN),
            "factor must be a finite number > 0",
        ),
        (
            "llama.rope.scaling.factor",
            G::F32(f32::INFINITY),
            "factor must be a finite number > 0",
        ),
        (
            "llama.attention.layer_norm_rms_epsilon",
            G::F32(f32::INFINITY),
            "rms_norm_eps must be a finite number",
        ),
        (
            "llama.rope.freq_base",
            G::F32(f32::INFINITY),
            "rope_theta must be a finite number",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let p = gguf_with(&format!("gguf_rope{i}"), |d| {
            set_meta(d, "llama.rope.scaling.type", G::String("linear".into()));
            set_meta(d, "llama.rope.scaling.factor", G::F32(2.0));
            set_meta(d, key, v);
        });
        generate_err(&p, &[], expect);
    }
    let dir = tiny_dir("err_hf_rope");
    let cfg = TinySpec::llama()
        .config_json()
        .replace("\"factor\":8.0", "\"factor\":-8.0");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    generate_err(
        &dir,
        &[],
        "rope scaling factor must be a finite number > 0, got -8",
    );
}

#[test]
fn token_type_longer_than_tokens_is_refused() {
    let p = gguf_with("gguf_token_type", |d| {
        set_meta(
            d,
            "tokenizer.ggml.token_type",
            G::Array(vec![G::I32(3); 1000]),
        )
    });
    generate_err(
        &p,
        &[],
        "token_type has 1000 entries but tokenizer.ggml.tokens has 262",
    );
}

#[test]
fn an_empty_vocabulary_is_named_as_such() {
    let p = gguf_with("gguf_empty_vocab", |d| {
        set_meta(d, "tokenizer.ggml.tokens", G::Array(vec![]));
        set_meta(d, "tokenizer.ggml.token_type", G::Array(vec![]));
        set_meta(d, "llama.vocab_size", G::U32(262));
    });
    generate_err(&p, &[], "the model has no vocabulary");
}

#[test]
fn untrusted_text_in_errors_is_escaped_onto_one_line() {
    let p = gguf_with("gguf_arch_nl", |d| {
        set_meta(
            d,
            "general.architecture",
            G::String("evil\nsecond line\u{1b}[2J".into()),
        )
    });
    generate_err(
        &p,
        &[],
        "unsupported architecture `evil\\nsecond line\\u{1b}[2J`",
    );
    // A template's exception text, too.
    let p = gguf_with("gguf_raise", |d| {
        set_meta(
            d,
            "tokenizer.chat_template",
            G::String("{{ raise_exception('bad\\nrole') }}".into()),
        )
    });
    generate_err(&p, &["--chat"], "bad\\nrole");
}

#[test]
fn candle_errors_carry_no_backtrace() {
    // An unknown metadata value type fails inside candle's reader, whose errors capture a
    // backtrace under RUST_BACKTRACE=1 (set by `assert_error`).
    let p = gguf_with("gguf_value_type", |_| {});
    let mut bytes = std::fs::read(&p).unwrap();
    let key = b"general.architecture";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    bytes[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
    std::fs::write(&p, bytes).unwrap();
    generate_err(&p, &[], "unrecognized value-type");
}

#[test]
fn an_unknown_tensor_type_is_named_with_its_tensor() {
    let p = gguf_with("gguf_dtype", |d| d.tensors[0].ggml_type = 99);
    generate_err(&p, &[], "has unknown GGML type 99");
}

#[test]
fn token_ids_from_config_files_name_the_file_and_key() {
    let dir = tiny_dir("err_eos_range");
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": [2, 99999]}"#,
    )
    .unwrap();
    generate_err(
        &dir,
        &[],
        "generation_config.json: eos_token_id 99999 is outside the vocabulary (320 tokens)",
    );
    let dir = tiny_dir("err_eos_cfg");
    let cfg = TinySpec::llama()
        .config_json()
        .replace("\"eos_token_id\":2", "\"eos_token_id\":5000000000");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    generate_err(&dir, &[], "config.json: eos_token_id must hold token ids");
    let p = gguf_with("gguf_bos_range", |d| {
        set_meta(d, "tokenizer.ggml.bos_token_id", G::U32(70000))
    });
    generate_err(
        &p,
        &[],
        "GGUF tokenizer.ggml.bos_token_id 70000 is outside the vocabulary",
    );
}

#[test]
fn generation_config_values_are_reported_as_that_file() {
    let dir = tiny_dir("err_gen_temp");
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"do_sample": true, "temperature": -1.5}"#,
    )
    .unwrap();
    generate_err(
        &dir,
        &[],
        "generation_config.json: temperature must be a finite number >= 0, got -1.5",
    );
}

#[test]
fn a_fifo_as_the_model_fails_at_once() {
    let dir = scratch_dir("err_fifo");
    let fifo = dir.join("model.gguf");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    generate_err(&fifo, &[], "not a regular file or a model directory");
    // A FIFO inside a model directory (read by path) as well.
    let dir = tiny_dir("err_fifo_cfg");
    std::fs::remove_file(dir.join("tokenizer_config.json")).unwrap();
    let c = std::ffi::CString::new(dir.join("tokenizer_config.json").to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    generate_err(&dir, &[], "tokenizer_config.json: not a regular file");
}

/// The three template sources, each with a runaway template: one error naming the source.
#[test]
fn chat_templates_run_on_a_budget_from_every_source() {
    let hang = "{% for a in range(99999) %}{% for b in range(99999) %}x{% endfor %}{% endfor %}";
    let flood = "{% for a in range(99999) %}{{ 'y' * 100000 }}{% endfor %}";
    // Values held, never printed: 100 MB each (minijinja's largest repeat), the third
    // passes the budget (built by fast repeats, so the time budget is not reached first).
    let hoard = "{% set a = 'ab' * 50000000 %}{% set b = 'cd' * 50000000 %}{% set c = 'ef' * 50000000 %}{{ a|length + b|length + c|length }}";
    // A chain minijinja's compiler would recurse through past any thread's stack.
    let chain = format!("{{{{ 'x'{} }}}}", "|lower".repeat(30_000));
    // A value nested 2.4 million deep within the fuel and memory budgets: printing and
    // dropping it overflows even a 256 MiB stack, so only a worker process contains it.
    let nested = format!(
        "{{% set ns = namespace(x=[1]) %}}{{% for i in range(80) %}}{{% for j in range(100) %}}{{% set ns.x = ns.x{} %}}{{% endfor %}}{{% endfor %}}{{{{ ns.x }}}}",
        "|batch(1)".repeat(300)
    );
    // A count that overflows a capacity inside minijinja (a panic there).
    let overflow = "{{ [1, 2]|slice(4611686018427387904)|list }}";
    for (i, (template, expect)) in [
        (hang, "ran out of its budget of 5000000 instructions"),
        (flood, "the rendered text passes 64 MiB"),
        (hoard, "used more than 256 MiB of memory"),
        (chain.as_str(), "has a tag of more than 2000 tokens"),
        (nested.as_str(), "crashed its renderer"),
        (overflow, "rendering failed ("),
    ]
    .into_iter()
    .enumerate()
    {
        let p = gguf_with(&format!("tpl_gguf{i}"), |d| {
            set_meta(d, "tokenizer.chat_template", G::String(template.into()))
        });
        generate_err(
            &p,
            &["--chat"],
            &format!("chat template from GGUF tokenizer.chat_template: {expect}"),
        );
        let dir = tiny_dir(&format!("tpl_cfg{i}"));
        let tc =
            serde_json::json!({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template});
        std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
        generate_err(
            &dir,
            &["--chat"],
            &format!("chat template from tokenizer_config.json chat_template: {expect}"),
        );
        let dir = tiny_dir(&format!("tpl_jinja{i}"));
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"eos_token": "</s>"}"#,
        )
        .unwrap();
        std::fs::write(dir.join("chat_template.jinja"), template).unwrap();
        generate_err(
            &dir,
            &["--chat"],
            &format!("chat template from chat_template.jinja: {expect}"),
        );
    }
}

#[test]
fn a_kv_events_endpoint_in_use_is_one_line_before_the_server_listens() {
    // `*`: an endpoint the socket binds (a named host and port it would connect to).
    let taken = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let endpoint = format!("tcp://*:{}", taken.local_addr().unwrap().port());
    let m = tiny_dir("kv_events_taken");
    let args = [
        "serve",
        "--model",
        m.to_str().unwrap(),
        "--port",
        "0",
        "--kv-events-endpoint",
        &endpoint,
    ];
    assert_error(
        env!("CARGO_BIN_EXE_strata"),
        &args,
        &format!("cannot bind --kv-events-endpoint {endpoint}"),
        1,
    );
}

#[test]
fn an_unwritable_trace_out_fails_before_any_text() {
    generate_err(
        &tiny_dir("err_trace"),
        &[
            "--enable-offload",
            "--trace-out",
            "/nonexistent-dir/trace.json",
        ],
        "cannot write --trace-out /nonexistent-dir/trace.json",
    );
}

#[test]
fn no_informational_line_precedes_an_error() {
    // Once: a context warning and the memory plan were printed, then this error.
    let long = "c".repeat(100);
    generate_err(
        &tiny_dir("err_info_first"),
        &[
            "--prompt",
            &long,
            "--max-model-len",
            "100000",
            "--enable-offload",
            "--block-size",
            "16",
            "--num-cpu-blocks",
            "2",
        ],
        "host KV too small for the prompt",
    );
}

#[test]
fn usage_errors_are_one_line_with_exit_2() {
    let strata = env!("CARGO_BIN_EXE_strata");
    let m = tiny_dir("usage");
    let m = m.to_str().unwrap();
    let generate = [
        "generate",
        "--model",
        m,
        "--prompt",
        "x",
        "--max-tokens",
        "4",
    ];
    // Verified sparse decode, its draft count (and more) to follow.
    let verified = [
        &generate[..],
        &[
            "--enable-offload",
            "--block-size",
            "16",
            "--sparse-budget",
            "32",
            "--sparse-verify",
        ],
    ]
    .concat();
    for (args, expect) in [
        (
            vec!["generate", "--model", m, "--prompt", "x", "--bogus"],
            "unexpected argument '--bogus' found (see `strata generate --help`)",
        ),
        (vec![], "missing subcommand (see `strata --help`)"),
        (
            vec!["bench"],
            "missing subcommand (see `strata bench --help`)",
        ),
        (vec!["generate", "--model", m], "--prompt"),
        (
            vec![
                "generate",
                "--model",
                m,
                "--prompt",
                "x",
                "--max-tokens",
                "18446744073709551615",
            ],
            "is not in 0..=16777216",
        ),
        (
            vec![
                "generate",
                "--model",
                m,
                "--prompt",
                "x",
                "--enable-offload",
                "--num-kv-buffers",
                "1000000",
            ],
            "1000000 is not in 2..=64",
        ),
        (
            vec![
                "generate",
                "--model",
                m,
                "--prompt",
                "x",
                "--enable-offload",
                "--sim-link-gbps",
                "NaN",
            ],
            "NaN is not 0 (unthrottled) or in 0.001..=1000000 GB/s",
        ),
        (
            vec![
                "generate",
                "--model",
                m,
                "--prompt",
                "x",
                "--enable-offload",
                "--num-cpu-blocks",
                "18446744073709551615",
            ],
            "is not in 1..=16777216",
        ),
        (
            vec![
                "bench",
                "serve",
                "--model",
                m,
                "--input-len",
                "1:18446744073709551615",
            ],
            "expected 1 <= A <= B <= 16777216",
        ),
        (
            vec![
                "bench",
                "serve",
                "--model",
                m,
                "--num-seqs",
                "18446744073709551615",
            ],
            "is not in 1..=65536",
        ),
        (
            vec!["bench", "serve", "--model", m, "--link-gbps=-1"],
            "is not 0 (unthrottled) or in 0.001..=1000000 GB/s",
        ),
        (
            vec!["bench", "offload", "--model", m, "--sim-link-gbps", "inf"],
            "is not 0 (unthrottled) or in 0.001..=1000000 GB/s (see `strata bench offload --help`)",
        ),
        (
            vec![
                "bench",
                "offload",
                "--model",
                m,
                "--context",
                "18446744073709551615",
            ],
            "is not in 1..=16777216",
        ),
        (
            vec!["bench", "offload", "--model", m, "--rounds", "0"],
            "0 is not in 1..=1000",
        ),
        (
            vec!["bench", "offload", "--model", m, "--sparse-verify", "4"],
            "--sparse-verify checks sparse decode's tokens: add --sparse-budget",
        ),
        (
            [&generate[..], &["--sparse-verify", "4"]].concat(),
            "--sparse-verify checks sparse decode's tokens: add --sparse-budget",
        ),
        (
            [&verified[..], &["0"]].concat(),
            "--sparse-verify drafts 1 to 32 tokens per round, got 0",
        ),
        (
            vec![
                "serve",
                "--model",
                m,
                "--kv-events-endpoint",
                "udp://127.0.0.1:1",
            ],
            "expected tcp://HOST:PORT (HOST may be `*`) or ipc://PATH, got \"udp://127.0.0.1:1\"",
        ),
        (
            vec!["serve", "--model", m, "--kv-events-topic", "t"],
            "--kv-events-endpoint",
        ),
        (
            vec![
                "serve",
                "--model",
                m,
                "--kv-events-endpoint",
                "tcp://127.0.0.1:0",
                "--kv-events-queue",
                "0",
            ],
            "0 is not in 1..=1000000",
        ),
    ] {
        assert_error(strata, &args, expect, 2);
    }
    let needle = env!("CARGO_BIN_EXE_needle");
    for (args, expect) in [
        (
            vec!["--model", m, "--input-len", "18446744073709551615"],
            "is not in 1..=16777216 (see `needle --help`)",
        ),
        (
            vec!["--model", m, "--repeats", "0"],
            "0 is not in 1..=10000",
        ),
        (vec!["--model", m, "--depth", "NaN"], "NaN is not in [0, 1]"),
        (
            vec!["--model", m, "--num-kv-buffers", "100"],
            "100 is not in 2..=64",
        ),
        (
            vec!["--model", m, "--input-len", "64", "--sparse-verify", "2"],
            "--sparse-verify checks sparse decode's tokens: add --sparse-budget",
        ),
    ] {
        assert_error(needle, &args, expect, 2);
    }
}

#[test]
fn bench_serve_sizes_that_cannot_fit_are_refused() {
    let strata = env!("CARGO_BIN_EXE_strata");
    let m = tiny_dir("serve_sizes");
    let m = m.to_str().unwrap();
    for (args, expect) in [
        // Lengths past the model's context (512), whatever their sum.
        (
            vec![
                "bench",
                "serve",
                "--model",
                m,
                "--input-len",
                "16777216",
                "--output-len",
                "16777216",
            ],
            "reach 33554432 tokens, past the model's context (512)",
        ),
        // Pools whose byte size is far past any memory.
        (
            vec![
                "bench",
                "serve",
                "--model",
                m,
                "--input-len",
                "8",
                "--output-len",
                "8",
                "--num-gpu-blocks",
                "16777216",
                "--max-cpu-offload-blocks",
                "16777216",
                "--block-size",
                "64",
            ],
            "the KV pools need",
        ),
    ] {
        assert_error(strata, &args, expect, 1);
    }
}

/// `bench offload` decodes compute alone for `--rounds + 1` rounds of `--decode-steps`
/// after the prompt: past the model's context (512) it is refused before any prefill.
#[test]
fn bench_offload_rounds_past_the_context_are_refused() {
    let strata = env!("CARGO_BIN_EXE_strata");
    let m = tiny_dir("offload_rounds");
    let m = m.to_str().unwrap();
    let args = [
        "bench",
        "offload",
        "--model",
        m,
        "--context",
        "500",
        "--decode-steps",
        "3",
    ];
    assert_error(strata, &args, "minus (--rounds + 1) × --decode-steps", 1);
}

/// Where a command's stdout goes in the output tests.
enum Stdout {
    /// A pipe whose reader has gone (`| true`, `| head` after its lines).
    Closed,
    /// `/dev/full`: every write fails with ENOSPC.
    Full,
}

/// Runs `bin args` with stdout `to`; returns (exit code, stderr).
fn run_with_stdout(bin: &str, args: &[&str], to: Stdout) -> (Option<i32>, String) {
    use std::process::Stdio;
    let stdout = match to {
        Stdout::Closed => Stdio::piped(),
        Stdout::Full => Stdio::from(std::fs::File::create("/dev/full").unwrap()),
    };
    let mut child = Command::new(bin)
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader goes away before the first byte
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_closed_stdout_ends_quietly_and_a_full_one_is_one_error_line() {
    let m = tiny_dir("output_closed");
    let model = m.to_str().unwrap();
    let strata = env!("CARGO_BIN_EXE_strata");
    let needle = env!("CARGO_BIN_EXE_needle");
    let runs: [(&str, Vec<&str>); 4] = [
        (
            strata,
            vec![
                "generate",
                "--model",
                model,
                "--prompt",
                "hello",
                "--max-tokens",
                "8",
            ],
        ),
        (
            strata,
            vec![
                "generate",
                "--model",
                model,
                "--prompt",
                "hello",
                "--max-tokens",
                "8",
                "--json",
            ],
        ),
        (
            needle,
            vec!["--model", model, "--input-len", "450", "--depth", "0.5"],
        ),
        (
            needle,
            vec![
                "--model",
                model,
                "--input-len",
                "450",
                "--depth",
                "0.5",
                "--json",
            ],
        ),
    ];
    for (bin, args) in &runs {
        let (code, stderr) = run_with_stdout(bin, args, Stdout::Closed);
        assert!(!stderr.contains("panicked"), "{args:?} | true: {stderr}");
        assert_eq!(code, Some(0), "{args:?} | true: {stderr}");
        assert!(!stderr.contains("error"), "{args:?} | true: {stderr}");
        let (code, stderr) = run_with_stdout(bin, args, Stdout::Full);
        assert!(
            !stderr.contains("panicked"),
            "{args:?} >/dev/full: {stderr}"
        );
        assert_eq!(code, Some(1), "{args:?} >/dev/full: {stderr}");
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error")).collect();
        assert_eq!(errors.len(), 1, "{args:?} >/dev/full: {stderr}");
        assert!(
            errors[0].contains("writing to standard output") && errors[0].contains("No space"),
            "{args:?} >/dev/full: {stderr}"
        );
    }
}

#[test]
fn more_compute_threads_than_cores_are_capped_with_a_warning_after_the_checks() {
    let m = tiny_dir("rayon_threads");
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["generate", "--model"])
            .arg(&m)
            .args(["--prompt", "hello", "--max-tokens", "4"])
            .args(extra)
            .env("RAYON_NUM_THREADS", "2000")
            .output()
            .unwrap()
    };
    let ok = run(&[]);
    let stderr = String::from_utf8_lossy(&ok.stderr);
    assert!(ok.status.success(), "{stderr}");
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with("warning: RAYON_NUM_THREADS=2000 is more than the")),
        "{stderr}"
    );
    // A failing run still prints only its error line.
    let bad = run(&["--max-model-len", "99999999"]);
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success());
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
}

#[test]
fn bench_sparse_eval_flag_combinations_are_usage_errors_with_the_hint() {
    let strata = env!("CARGO_BIN_EXE_strata");
    for (args, expect) in [
        (
            &[
                "bench",
                "sparse-eval",
                "--budget",
                "1/1000",
                "--context",
                "2048",
            ][..],
            "--budget 1/1000 at --context 2048",
        ),
        (
            &["bench", "sparse-eval", "--sparse-verify", "0"][..],
            "--sparse-verify",
        ),
    ] {
        assert_error(strata, args, expect, 2);
        let out = Command::new(strata).args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("(see `strata bench sparse-eval --help`)"),
            "{stderr}"
        );
    }
}
