//! `strata serve` under attack: a model file's hostile chat template, connection-level
//! abuse (idle and half-open connections, bodies that never end, half-closed clients) and
//! floods of huge prompts. After each, the server is alive and answers (docs/server.md
//! "Limits", docs/errors.md).

mod common;
mod live_server;

use common::{scratch_dir, TinySpec};
use live_server::Server;
use serde_json::json;

/// The tiny model's context is 512 tokens.
const TINY_ARGS: &[&str] = &["--max-model-len", "256"];

/// The tiny model with `template` as its chat template (a file beside the model).
fn tiny_with_template(name: &str, template: &str) -> std::path::PathBuf {
    let dir = scratch_dir(name);
    TinySpec::llama().write(&dir, 5);
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": "</s>"}"#,
    )
    .unwrap();
    std::fs::write(dir.join("chat_template.jinja"), template).unwrap();
    dir
}

fn assert_serving(server: &Server) {
    assert_eq!(server.get("/health").status, 200);
    let r = server.post_json(
        "/v1/completions",
        &json!({"model": server.model_name, "prompt": "hello", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn a_template_nesting_values_past_any_stack_is_a_400_and_the_server_keeps_serving() {
    // 2.4 million list levels within the fuel and memory budgets: printing or dropping
    // them overflows a 256 MiB stack. In-process this killed the server.
    let nested = format!(
        "{{% set ns = namespace(x=[1]) %}}{{% for i in range(80) %}}{{% for j in range(100) %}}{{% set ns.x = ns.x{} %}}{{% endfor %}}{{% endfor %}}{{{{ ns.x }}}}",
        "|batch(1)".repeat(300)
    );
    let server = Server::start(&tiny_with_template("hostile_tpl", &nested), TINY_ARGS);
    for _ in 0..3 {
        let r = server.post_json(
            "/v1/chat/completions",
            &json!({"model": server.model_name, "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}]}),
        );
        let msg = r.expect_error(400);
        assert!(msg.contains("crashed its renderer"), "{msg}");
        assert_serving(&server);
    }
}
