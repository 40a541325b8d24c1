//! Gemma 3's SentencePiece BPE tokenizer, built from the GGUF's metadata (issue 58's first
//! piece): every one of the 40 strings recorded from Hugging Face transformers' tokenizer
//! on the same file (tests/data/gemma3/hf_reference.json: leading, repeated and mixed
//! whitespace, newlines and tabs, byte fallback, emoji, CJK, control tokens) encodes to
//! transformers' ids (except that a text starting with `<bos>` gets no second one) and
//! decodes to its text; token bytes spell the text.
//! The model file comes from `models/fetch-gemma3.sh` (.ci/run fetches it).

mod common;

use strata::model::Tokenizer;

fn gemma_tokenizer() -> Option<Tokenizer> {
    let path = common::gemma3_model()?;
    let mut f = std::fs::File::open(&path).unwrap();
    let len = f.metadata().unwrap().len();
    let content = strata::model::weights::read_gguf_header(&mut f, len).unwrap();
    Some(Tokenizer::from_gguf(&content.metadata).unwrap())
}

#[test]
fn gemma3_tokenizer_matches_transformers_on_every_recorded_string() {
    let Some(tok) = gemma_tokenizer() else {
        return;
    };
    let reference = common::gemma3_reference();
    let cases = reference["tokenizer_cases"].as_array().unwrap();
    assert_eq!(cases.len(), 40);
    let mut wrong = Vec::new();
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
        let got = tok.encode(text, true).unwrap();
        if text.starts_with("<bos>") && want.starts_with(&[2, 2]) {
            // strata's one deliberate difference: BOS is not prepended to a text that
            // already starts with it (transformers doubles it; llama.cpp warns of that).
            assert_eq!(got[..], want[1..], "{text:?}");
            continue;
        }
        if got != want {
            wrong.push(format!("{text:?}: {got:?} want {want:?}"));
            continue;
        }
        let decoded = tok.decode(&got, true).unwrap();
        if decoded != c["decoded_skip_special"].as_str().unwrap() {
            wrong.push(format!("{text:?}: decoded {decoded:?}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of 40 differ:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}

#[test]
fn gemma3_prompts_tokenize_as_transformers_and_token_bytes_spell_them() {
    let Some(tok) = gemma_tokenizer() else {
        return;
    };
    let reference = common::gemma3_reference();
    for case in reference["prompts"].as_array().unwrap() {
        let ids: Vec<u32> = serde_json::from_value(case["prompt_ids"].clone()).unwrap();
        let text = case["text"].as_str().unwrap();
        let special = case["add_special_tokens"] != serde_json::Value::Bool(false);
        let got = tok.encode(text, special).unwrap();
        assert_eq!(got, ids, "{text:?}");
        let bytes: Vec<u8> = ids[1..]
            .iter()
            .flat_map(|&id| tok.token_bytes(id))
            .collect();
        let spelled = String::from_utf8(bytes).unwrap();
        assert!(text.ends_with(&spelled), "{text:?} vs {spelled:?}");
    }
}

/// The GGUF carries no chat template: the built-in Gemma 3 template renders the recorded
/// chat prompt to transformers' ids (its render of the published template), and a turn's
/// end stops generation as the end of text does.
#[test]
fn builtin_chat_template_renders_transformers_chat_prompt() {
    let Some(tok) = gemma_tokenizer() else {
        return;
    };
    let reference = common::gemma3_reference();
    let chat = reference["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "chat_2plus2")
        .unwrap();
    let want: Vec<u32> = serde_json::from_value(chat["prompt_ids"].clone()).unwrap();
    let text = tok.apply_chat_template("What is 2+2?").unwrap();
    assert_eq!(text, chat["text"].as_str().unwrap());
    assert_eq!(tok.encode(&text, false).unwrap(), want);
    assert_eq!(tok.eos_token_ids, [1, 106]); // <eos>, <end_of_turn>
                                             // A system message is folded into the first user turn, as the published template does.
    let messages = [
        ("system", "Be brief."),
        ("user", "Hi"),
        ("assistant", "Hello"),
        ("user", "Bye"),
    ]
    .map(|(role, content)| strata::model::tokenizer::ChatMessage {
        role: role.into(),
        content: content.into(),
    });
    assert_eq!(
        tok.render_chat(&messages).unwrap(),
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    );
}
