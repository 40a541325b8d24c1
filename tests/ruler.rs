//! The RULER generator on the default model's tokenizer (needles in the prompt at their
//! depths, prompts sized to the context, deterministic, tuning and held-out sets apart),
//! and `strata bench sparse-eval` end to end on a small case: its table and JSON, scores
//! that are RULER's scoring of the answers it printed, and clear errors for bad flags.

mod common;

use std::process::Command;

use strata::model::{Model, Tokenizer};
use strata::ruler::{self, RulerCase, SeedSet, Task};

fn smollm() -> Tokenizer {
    Model::load(&common::require_default_model(), false)
        .unwrap()
        .1
}

fn case(task: Task, context: usize, index: usize, set: SeedSet) -> RulerCase {
    RulerCase {
        task,
        context,
        index,
        set,
    }
}

#[test]
fn needles_sit_at_their_depths_and_prompts_fill_the_context() {
    let tok = smollm();
    for task in Task::ALL {
        for context in [1024, 2048, 4096, 8192] {
            let c = case(task, context, 0, SeedSet::Tune);
            let p = c.build(&tok).unwrap();
            let s = task.spec();
            // Prompt + answer tokens fit the context, within a few haystack units of it (an
            // essay paragraph is up to ~100 tokens: multikey 3 at 1K ends 82 short).
            let used = p.ids.len() + p.max_new_tokens;
            assert!(used <= context, "{task:?} {context}: {used}");
            assert!(used + 160 >= context, "{task:?} {context}: only {used}");
            assert_eq!(p.needles.len(), s.keys * s.values, "{task:?}");
            assert_eq!(p.answers.len(), s.queries * s.values, "{task:?}");
            let needle_tokens: usize = p.needles.iter().map(|n| n.tokens).sum();
            let filler = (p.haystack.len() - needle_tokens) as f64;
            for (i, n) in p.needles.iter().enumerate() {
                // The needle's own text starts at its token...
                let text = tok.decode(&p.ids[n.token..n.token + 8], false).unwrap();
                assert!(
                    text.trim_start().starts_with("One of the special magic"),
                    "{task:?} {context}: {text:?}"
                );
                // ...at its depth in the haystack's filler, within a few percent (sentence
                // and line granularity).
                let before: usize = p.needles[..i].iter().map(|n| n.tokens).sum();
                let at = (n.token - p.haystack.start - before) as f64 / filler;
                let want = n.depth as f64 / 100.0;
                assert!(
                    (at - want).abs() < 0.05,
                    "{task:?} {context}: {at} vs {want}"
                );
            }
            // Every expected value is in the prompt, after its key.
            let text = tok.decode(&p.ids, false).unwrap();
            for a in &p.answers {
                assert!(text.contains(a.as_str()), "{task:?}: {a} missing");
            }
            for q in &p.queries {
                assert!(text.contains(&format!("for {q} is:")), "{task:?}: {q}");
            }
            // The question ends with RULER's answer prefix, singular when one value is asked.
            let prefix = if s.values * s.queries == 1 {
                "mentioned in the provided text is"
            } else {
                "mentioned in the provided text are"
            };
            assert!(
                text.ends_with(prefix),
                "{task:?}: {}",
                &text[text.len() - 80..]
            );
        }
    }
}

#[test]
fn cases_are_deterministic_and_the_seed_sets_differ() {
    let tok = smollm();
    for task in [Task::Single2, Task::MultiKey2, Task::MultiQuery] {
        let a = case(task, 2048, 3, SeedSet::Tune).build(&tok).unwrap();
        let b = case(task, 2048, 3, SeedSet::Tune).build(&tok).unwrap();
        assert_eq!(a.ids, b.ids);
        assert_eq!(a.answers, b.answers);
        let h = case(task, 2048, 3, SeedSet::Heldout).build(&tok).unwrap();
        assert_ne!(a.answers, h.answers, "{task:?}");
        let other = case(task, 2048, 4, SeedSet::Tune).build(&tok).unwrap();
        assert_ne!(a.answers, other.answers, "{task:?}");
    }
}

fn sparse_eval(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["bench", "sparse-eval", "--model"])
        .arg(common::require_default_model())
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// One 1K case of each single-needle task, full attention and a budget holding the whole
/// context (bitwise full attention) plus a small one: the JSON's shape, every score RULER's
/// scoring of the printed answer, the whole-context budget scoring exactly as full
/// attention, and a planted wrong answer (the value's digit changed) scored wrong.
#[test]
fn sparse_eval_scores_what_it_prints() {
    let (ok, stdout, stderr) = sparse_eval(&[
        "--task",
        "niah_single_1,niah_single_2",
        "--context",
        "1024",
        "--cases",
        "1",
        "--budget",
        "1024,1/8",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let r: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    // The defaults are `generate`'s: what a user's sparse decode runs with.
    assert_eq!((&r["dtype"], &r["kv_dtype"]), (&"q8".into(), &"f16".into()));
    let cases = r["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 2);
    for c in cases {
        let answers: Vec<String> = c["answers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .collect();
        let full = &c["full"];
        let text = full["answer"].as_str().unwrap();
        assert_eq!(
            full["score"].as_f64().unwrap(),
            ruler::score(text, &answers),
            "{c}"
        );
        // The default model finds a single needle at 1K (DESIGN.md).
        assert_eq!(full["score"], 1.0, "{c}");
        let planted = text.replace(
            &answers[0],
            &answers[0].replace(|ch: char| ch.is_ascii_digit(), "0"),
        );
        assert_eq!(ruler::score(&planted, &answers), 0.0, "{planted}");
        let sparse = c["sparse"].as_array().unwrap();
        assert_eq!(sparse.len(), 2, "{c}");
        assert_eq!(sparse[0]["budget"], 1024);
        assert_eq!(
            sparse[0]["answer"], full["answer"],
            "a whole-context budget is full attention"
        );
        assert_eq!(sparse[1]["budget"], 128);
        for d in sparse.iter().chain([full]) {
            let t = d["answer"].as_str().unwrap();
            assert_eq!(d["score"].as_f64().unwrap(), ruler::score(t, &answers));
            let found: Vec<bool> = serde_json::from_value(d["found"].clone()).unwrap();
            assert_eq!(found, ruler::found(t, &answers), "{d}");
        }
        // Teacher-forced: fed full attention's tokens, the whole-context budget makes full
        // attention's choice at every step with the same logits (KL exactly 0); comparing a
        // step with another step of full attention's would not.
        let forced = c["forced"].as_array().unwrap();
        assert_eq!(forced.len(), 2, "{c}");
        let steps = forced[0]["steps"].as_u64().unwrap();
        assert!(steps >= 7, "a 7-digit value and more: {c}");
        assert_eq!(forced[0]["agreed"], steps, "{c}");
        assert_eq!(forced[0]["disagreed"], serde_json::json!([]), "{c}");
        assert_eq!(
            (&forced[0]["mean_kl"], &forced[0]["max_kl"]),
            (&0.0.into(), &0.0.into())
        );
        assert_eq!(forced[1]["steps"], steps, "{c}");
        let disagreed: Vec<u64> = serde_json::from_value(forced[1]["disagreed"].clone()).unwrap();
        assert_eq!(
            forced[1]["agreed"].as_u64().unwrap() + disagreed.len() as u64,
            steps
        );
        assert!(
            disagreed.iter().all(|&i| i < steps) && disagreed.is_sorted(),
            "{c}"
        );
        let (mean, max) = (
            forced[1]["mean_kl"].as_f64().unwrap(),
            forced[1]["max_kl"].as_f64().unwrap(),
        );
        assert!((0.0..=max).contains(&mean), "{c}");
    }
    // Cells: two tasks and "all", per budget; counts consistent with the cases.
    let cells = r["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 6);
    for cell in cells {
        let n = if cell["task"] == "all" { 2 } else { 1 };
        assert_eq!(cell["cases"], n, "{cell}");
        assert_eq!(cell["full_correct"], n, "{cell}");
        assert!(cell["sparse_correct"].as_u64().unwrap() <= n);
        // One value a case, each found by full attention; kept where sparse found it.
        assert_eq!(cell["values_full_found"], n, "{cell}");
        assert_eq!(cell["values_kept"], cell["sparse_correct"], "{cell}");
        let (agreed, steps) = (&cell["forced_agreed"], &cell["forced_steps"]);
        assert!(
            agreed.as_u64().unwrap() <= steps.as_u64().unwrap(),
            "{cell}"
        );
    }
    assert_eq!(cells[2]["task"], "all");
    assert_eq!(
        cells[2]["forced_agreed"], cells[2]["forced_steps"],
        "the whole-context budget"
    );
    assert_eq!(cells[2]["forced_mean_kl"], 0.0);
    assert_eq!(
        cells[0]["sparse_accuracy"], 100.0,
        "the whole-context budget"
    );
    assert!(
        stderr.contains("[2/2] niah_single_2 1024"),
        "progress on stderr: {stderr}"
    );
}

/// `--sparse-verify`: on every case and budget the verified decode is full attention's,
/// token for token (its score too), with drafts and rounds that add up; the cells count it.
#[test]
fn sparse_eval_verified_decodes_are_full_attentions() {
    let (ok, stdout, stderr) = sparse_eval(&[
        "--task",
        "niah_single_3,niah_multikey_1",
        "--context",
        "1024",
        "--cases",
        "1",
        "--budget",
        "1/8,96",
        "--sparse-verify",
        "3",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let r: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    for c in r["cases"].as_array().unwrap() {
        let v = c["verified"].as_array().unwrap();
        assert_eq!(v.len(), 2, "{c}");
        for d in v {
            assert_eq!(d["same_as_full"], true, "{c}");
            assert_eq!(d["score"], c["full"]["score"], "{c}");
            let s = &d["stats"];
            let (rounds, drafted, accepted) = (
                s["rounds"].as_u64().unwrap(),
                s["drafted"].as_u64().unwrap(),
                s["accepted"].as_u64().unwrap(),
            );
            // Every decoded token after the first came from a round: a kept draft or the
            // round's own; no round drafts more than 3.
            let steps = c["forced"][0]["steps"].as_u64().unwrap();
            assert_eq!(rounds + accepted, steps, "{c}");
            assert!(accepted <= drafted && drafted <= 3 * rounds, "{c}");
        }
    }
    for cell in r["cells"].as_array().unwrap() {
        assert_eq!(cell["verified_same"], cell["cases"], "{cell}");
        assert_eq!(cell["verified_correct"], cell["full_correct"], "{cell}");
    }
}

#[test]
fn the_table_names_every_cell() {
    let (ok, stdout, stderr) = sparse_eval(&[
        "--task",
        "niah_single_1",
        "--context",
        "1024",
        "--cases",
        "1",
        "--budget",
        "1/8",
        "--dtype",
        "stored",
        "--kv-dtype",
        "f32",
    ]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("weights stored, KV f32,"),
        "the reference mode, named: {stdout}"
    );
    let head = stdout.lines().nth(1).unwrap();
    for col in [
        "task",
        "context",
        "budget",
        "cases",
        "full_acc",
        "full_ok",
        "sparse_ok",
        "sparse_acc",
        "drop",
        "values_kept",
        "agree",
        "mean_kl",
    ] {
        assert!(head.contains(col), "{head}");
    }
    assert!(
        stdout.contains("niah_single_1       1024   128 (1/8)     1    100.0       1"),
        "{stdout}"
    );
    assert!(stdout.lines().any(|l| l.starts_with("all ")), "{stdout}");
}

#[test]
fn bad_flags_are_one_line_errors() {
    for (args, code, want) in [
        (&["--budget", "2/8"][..], 2, "expected 1/N"),
        (&["--budget", "1/0"][..], 2, "expected 1/N"),
        (&["--task", "niah_single_9"][..], 2, "invalid value"),
        (&["--cases", "0"][..], 2, "--cases"),
        (&["--context", "0"][..], 2, "--context"),
        (&["--seed-set", "test"][..], 2, "invalid value"),
        // 1/16 of 1K is 64 tokens: less than the sink page and a 64-token window. Flags
        // that do not fit together are usage errors (2, with the help hint); a context
        // past the model's is the model's to refuse (1).
        (
            &["--context", "1024", "--budget", "1/16"][..],
            2,
            "--budget 1/16 at --context 1024",
        ),
        (&["--context", "9000"][..], 1, "exceeds the model's context"),
        (
            &["--sparse-page-size", "48"][..],
            2,
            "must divide --block-size",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["bench", "sparse-eval", "--model"])
            .arg(common::require_default_model())
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}
