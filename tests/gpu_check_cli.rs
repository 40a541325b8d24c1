//! `scripts/gpu-check.sh`'s CLI steps (7 generate, 8 needle, 9 serve) dry-run on the CPU
//! device (`--device cpu`): the script a GPU session runs once, with no second chance,
//! must parse the binaries' output, compare what it says it compares and fail when it
//! should. Small sizes (a ~500-token prompt, 512-token needles, 4 tokens per request).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A folder holding `strata` and `needle` for `--cli`: links to the built binaries, or
/// `strata` replaced by `wrapper` (a bash script given the real binary as `$REAL`).
fn cli_dir(name: &str, wrapper: Option<&str>) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("strata-gpu-check-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let real = env!("CARGO_BIN_EXE_strata");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_needle"), dir.join("needle")).unwrap();
    match wrapper {
        None => std::os::unix::fs::symlink(real, dir.join("strata")).unwrap(),
        Some(body) => {
            use std::os::unix::fs::PermissionsExt;
            let path = dir.join("strata");
            std::fs::write(
                &path,
                format!("#!/usr/bin/env bash\nREAL='{real}'\n{body}\n"),
            )
            .unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
    }
    dir
}

fn gpu_check(steps: &str, cli: &Path, out: &Path) -> Output {
    Command::new("bash")
        .arg("scripts/gpu-check.sh")
        .args(["--steps", steps, "--device", "cpu"])
        .arg("--cli")
        .arg(cli)
        .arg("--model")
        .arg(common::require_default_model())
        .arg("--out")
        .arg(out)
        .arg(env!("CARGO_BIN_EXE_strata-gpucheck"))
        .env("GPU_CHECK_PROMPT_CHARS", "2000")
        .env("GPU_CHECK_NEEDLE_LENS", "512")
        .env("GPU_CHECK_SERVE_TOKENS", "4")
        .output()
        .unwrap()
}

/// The summary table's row of `step`: (result, detail).
fn row(stdout: &str, step: &str) -> (String, String) {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.split_whitespace().next() == Some(step))
        .unwrap_or_else(|| panic!("no row {step} in:\n{stdout}"));
    let result = ["ok", "FAIL", "MISS", "SKIP"]
        .into_iter()
        .find(|r| line.contains(&format!(" {r} ")))
        .unwrap_or_else(|| panic!("no result in {line:?}"));
    (result.to_string(), line.to_string())
}

#[test]
fn cli_steps_pass_on_the_cpu_device() {
    let cli = cli_dir("pass", None);
    let out = cli.join("out");
    let o = gpu_check("7,8,9", &cli, &out);
    let stdout = String::from_utf8_lossy(&o.stdout);
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&o.stderr));
    // Serving 16 streams on two cores misses the GPU's 8× goal: MISS, not a failure.
    assert!(o.status.success(), "{stdout}");
    let (r7, d7) = row(&stdout, "7");
    assert_eq!(r7, "ok", "{d7}");
    assert!(d7.contains("tokens equal") && d7.contains("kept"), "{d7}");
    assert_eq!(row(&stdout, "8").0, "ok");
    let (r9, d9) = row(&stdout, "9");
    assert!(r9 == "ok" || r9 == "MISS", "{d9}");
    assert!(d9.contains("tok/s 1 stream"), "{d9}");
    let _ = std::fs::remove_dir_all(&cli);
}

/// Planted: the verified run samples (its tokens are not full attention's greedy ones),
/// so step 7 must fail and the script exit non-zero.
#[test]
fn step_7_fails_when_the_verified_tokens_differ() {
    let wrapper = r#"args=("$@")
if [[ " $* " == *" --sparse-verify "* ]]; then
    for i in "${!args[@]}"; do [[ "${args[$i]}" == --temperature ]] && args[$((i + 1))]=1.5; done
fi
exec "$REAL" "${args[@]}""#;
    let cli = cli_dir("planted", Some(wrapper));
    let o = gpu_check("7", &cli, &cli.join("out"));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(!o.status.success(), "{stdout}");
    let (r7, d7) = row(&stdout, "7");
    assert_eq!(r7, "FAIL", "{d7}");
    assert!(d7.contains("verified = offload"), "{d7}");
    let _ = std::fs::remove_dir_all(&cli);
}

#[test]
fn help_prints_cleanly() {
    let o = Command::new("bash")
        .args(["scripts/gpu-check.sh", "--help"])
        .output()
        .unwrap();
    assert!(o.status.success());
    assert!(
        o.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("--cli DIR"));
}

#[test]
fn cli_steps_refuse_a_missing_cli_dir() {
    let o = Command::new("bash")
        .args(["scripts/gpu-check.sh", "--steps", "7"])
        .arg(env!("CARGO_BIN_EXE_strata-gpucheck"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("need --cli DIR"));
}
