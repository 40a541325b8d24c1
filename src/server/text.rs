//! From generated token ids to response text: incremental detokenization (a character
//! split across tokens comes out whole) and stop strings (the text from the first stop
//! string on is never returned, even when the stop string is split across tokens).

use std::sync::Arc;

use anyhow::Result;

use crate::model::tokenizer::{StreamDecoder, Tokenizer};

/// Holds back text that might be the start of a stop string until it is known not to be.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Decoded text not yet released: the longest suffix that is a prefix of a stop string.
    held: String,
}

/// What one more piece of text releases.
#[derive(Debug, PartialEq, Eq)]
pub struct Released {
    pub text: String,
    /// A stop string was completed: `text` ends just before it, and nothing follows.
    pub stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            held: String::new(),
        }
    }

    pub fn push(&mut self, piece: &str) -> Released {
        self.held.push_str(piece);
        // Earliest completed stop string, if any: the text before it is final.
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let text = self.held[..at].to_string();
            self.held.clear();
            return Released {
                text,
                stopped: true,
            };
        }
        // Keep the longest suffix that could still grow into a stop string.
        let keep_from = (0..self.held.len())
            .filter(|&i| self.held.is_char_boundary(i))
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let text = self.held[..keep_from].to_string();
        self.held.drain(..keep_from);
        Released {
            text,
            stopped: false,
        }
    }

    /// The generation ended without a stop string: release what was held back.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// The text pipeline of one request.
pub struct TextStream {
    tokenizer: Arc<Tokenizer>,
    decoder: StreamDecoder,
    stop: StopMatcher,
}

impl TextStream {
    pub fn new(tokenizer: Arc<Tokenizer>, stops: Vec<String>) -> Self {
        Self {
            tokenizer,
            decoder: StreamDecoder::new(),
            stop: StopMatcher::new(stops),
        }
    }

    /// Feeds one generated token (special tokens decode to nothing).
    pub fn push(&mut self, id: u32) -> Result<Released> {
        Ok(match self.decoder.push(&self.tokenizer, id)? {
            Some(piece) => self.stop.push(&piece),
            None => Released {
                text: String::new(),
                stopped: false,
            },
        })
    }

    /// The generation ended without a stop string: the text still held back.
    pub fn finish(&mut self) -> String {
        self.stop.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let r = m.push(p);
            out += &r.text;
            if r.stopped {
                return (out, true);
            }
        }
        out += &m.finish();
        (out, false)
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_cut_with_everything_after_it() {
        assert_eq!(
            run(&["END"], &["hello E", "N", "D and more"]),
            ("hello ".into(), true)
        );
    }

    #[test]
    fn text_that_only_resembles_a_stop_prefix_is_released_in_full() {
        assert_eq!(
            run(&["END"], &["hello E", "NX", " bye E"]),
            ("hello ENX bye E".into(), false)
        );
    }

    #[test]
    fn the_earliest_of_several_stop_strings_wins() {
        assert_eq!(
            run(&["world", "lo w"], &["hel", "lo world"]),
            ("hel".into(), true)
        );
    }

    #[test]
    fn held_text_is_released_as_soon_as_it_cannot_start_a_stop_string() {
        let mut m = StopMatcher::new(vec!["ab".into()]);
        assert_eq!(m.push("xa").text, "x");
        assert_eq!(m.push("c").text, "ac");
    }

    #[test]
    fn multibyte_text_never_splits_a_character() {
        assert_eq!(
            run(&["é!"], &["café", " ok é", "!"]),
            ("café ok ".into(), true)
        );
    }
}
