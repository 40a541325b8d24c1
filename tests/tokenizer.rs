//! The GGUF tokenizer of the default model: round trips, pre-tokenization as SmolLM2's
//! tokenizer.json specifies (digits split one by one, no prefix space), special tokens,
//! and the ChatML chat template.

mod common;

use strata::model::Model;

fn smollm() -> strata::model::Tokenizer {
    Model::load(&common::require_default_model(), false)
        .unwrap()
        .1
}

#[test]
fn round_trips_text_of_every_script() {
    let tok = smollm();
    for s in [
        "Hello, world! The quick brown fox jumps over the lazy dog.",
        "  leading spaces and\ttabs\nnewlines\n\n",
        "Café, naïve, résumé, Ærøskøbing, Ünïcödé",
        "日本語の文章と中文句子，还有한국어",
        "emoji: 🚀🎉👍🏽 👨‍👩‍👧",
        "code: fn main() { println!(\"{}\", 1 + 2); }",
    ] {
        let ids = tok.encode(s, false).unwrap();
        assert!(!ids.is_empty());
        assert_eq!(tok.decode(&ids, false).unwrap(), s);
    }
}

#[test]
fn digits_are_split_and_no_prefix_space_is_added() {
    let tok = smollm();
    let digits = tok.encode("12345", false).unwrap();
    assert_eq!(digits.len(), 5, "SmolLM2 splits every digit: {digits:?}");
    // No prefix space: "Hello" and " Hello" are different tokens.
    assert_ne!(
        tok.encode("Hello", false).unwrap(),
        tok.encode(" Hello", false).unwrap()
    );
    assert_eq!(tok.encode("Hello", false).unwrap().len(), 1);
}

#[test]
fn control_tokens_are_single_ids_without_added_spaces() {
    let tok = smollm();
    let ids = tok
        .encode("<|im_start|>user\nHi<|im_end|>\n", false)
        .unwrap();
    assert_eq!(ids[0], 1, "<|im_start|> is id 1");
    assert!(ids.contains(&2), "<|im_end|> is id 2");
    // candle's TokenizerFromGguf inserts spaces around specials; ours must not.
    assert_eq!(
        tok.decode(&ids, false).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n"
    );
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nHi\n");
}

#[test]
fn chat_template_renders_chatml() {
    let tok = smollm();
    let text = tok.apply_chat_template("What is 2+2?").unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn hf_directory_tokenizer_and_template() {
    let dir = common::scratch_dir("tok_hf");
    common::TinySpec::llama().write(&dir, 1);
    let (model, tok) = Model::load(&dir, false).unwrap();
    assert_eq!(model.cfg.eos_token_ids, vec![2]);
    assert_eq!(
        tok.apply_chat_template("  hi  ").unwrap(),
        "<s>user: hi\nassistant:"
    );
    let s = "héllo wörld";
    assert_eq!(
        tok.decode(&tok.encode(s, false).unwrap(), false).unwrap(),
        s
    );
}

#[test]
fn chat_template_from_a_jinja_file() {
    let dir = common::scratch_dir("tok_jinja");
    common::TinySpec::qwen3().write(&dir, 1);
    // transformers 5.x keeps the template in chat_template.jinja.
    let cfg_path = dir.join("tokenizer_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}",
    )
    .unwrap();
    let (_, tok) = Model::load(&dir, false).unwrap();
    assert_eq!(
        tok.apply_chat_template("hi").unwrap(),
        "[USER] hi[ASSISTANT]"
    );
}
