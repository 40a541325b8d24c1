//! lm-evaluation-harness against `strata serve` (issue 61): its `local-completions` model
//! scores the repo's 40-item multiple-choice task (tests/data/lm_eval) from prompt
//! log-probabilities (`echo`, `logprobs: 1`, token-id prompts), and must give the same
//! accuracy, the same choice on every item and per-choice log-likelihoods within 0.02
//! nats of the same harness run on Hugging Face transformers with the same GGUF
//! (`hf_reference.json`, recorded with transformers 5.24.0's f32 forward; its README says
//! how). tests/lm_eval_compare.py does the run and the comparison; lm_eval is installed,
//! pinned, by .ci/run.

mod common;
mod live_server;

use std::process::Command;

#[test]
fn lm_eval_harness_scores_strata_as_it_scores_hf_transformers() {
    let model = common::require_default_model();
    let Some(python) = common::python_with(
        "lm_eval, transformers, gguf, tokenizers",
        "pip install 'lm_eval[api]==0.4.13' gguf (see .ci/run)",
    ) else {
        return;
    };
    let server = live_server::Server::start(&model, &[]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/lm_eval_compare.py");
    let out = Command::new(&python)
        .arg(script)
        .args(["--base-url", &format!("http://{}", server.addr)])
        .args(["--model-name", &server.model_name])
        .arg("--gguf")
        .arg(&model)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("running python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "lm_eval_compare.py exited {:?}:\n{stdout}\n{}",
        out.status.code(),
        stderr.lines().rev().take(40).collect::<Vec<_>>().join("\n")
    );
    assert!(stdout.contains("OK strata_mc"), "{stdout}");
}
