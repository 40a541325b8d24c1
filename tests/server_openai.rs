//! The official `openai` Python client against a live `strata serve` on the default model
//! (tests/openai_client.py): chat and completions, streamed and not; greedy text and usage
//! equal to `strata generate --temperature 0`; stop strings split across tokens; 16
//! concurrent greedy requests equal to their sequential results; error statuses.
//!
//! Needs `pip install openai` (.ci/run installs a pinned version). Without it the test
//! fails under CI=true and is skipped, loudly, elsewhere.

mod common;
mod live_server;

#[test]
fn the_openai_python_client_gets_the_cli_greedy_text_exact_usage_and_openai_errors() {
    let model = common::require_default_model();
    let Some(python) = common::python_with("openai", "pip install openai") else {
        return;
    };
    let server = live_server::Server::start(&model, &[]);
    server.run_openai_client(&python, &model, None);
}
