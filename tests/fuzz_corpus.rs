//! Every input the fuzzer ever found (`tests/fuzz_corpus/<target>/<hash>`, written by
//! `cargo run --release --bin fuzz`) is replayed here: each must now be refused with an
//! error (or, for a `flags` command line or a server target's exchange, may run): no
//! panic, no abort, no time or memory budget exceeded.

use std::path::Path;

use strata::fuzz::{self, Case, Outcome, Target};

#[test]
fn every_past_finding_is_now_a_clean_error() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_corpus");
    let mut replayed = 0;
    for target in Target::ALL {
        let Ok(entries) = std::fs::read_dir(root.join(target.name())) else {
            continue;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            let case = Case::from_bytes(&std::fs::read(&path).unwrap())
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            match fuzz::run_case_bounded(target, &case) {
                Outcome::Refused(msg) => {
                    assert!(!msg.is_empty(), "{}", path.display());
                }
                // A command line may be one the fix made work (a long run that now says
                // what it does, a server that now stops gracefully); a server target's
                // case always ends `Ok` once the server keeps its contract.
                Outcome::Ok
                    if matches!(
                        target,
                        Target::Flags | Target::Http | Target::HttpPipelined | Target::KvEvents
                    ) => {}
                other => panic!("{}: expected an error, got {other:?}", path.display()),
            }
            replayed += 1;
        }
    }
    // The corpus is in the repository: an empty replay means it went missing.
    assert!(
        replayed >= 8,
        "only {replayed} stored findings found under {}",
        root.display()
    );
}

/// The `flags` target's base command lines (which run the binaries this test build holds)
/// are accepted runs, so its mutations start from commands that work.
#[test]
fn every_base_command_line_of_the_flags_target_is_accepted() {
    for (i, case) in fuzz::base_corpus(Target::Flags).iter().enumerate() {
        let out = fuzz::run_case_bounded(Target::Flags, case);
        assert_eq!(out, Outcome::Ok, "flags base case {i}");
    }
}
