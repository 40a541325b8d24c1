//! Prefix-cache keys: SHA-256 over the parent block's key (for a prompt's first block, the
//! model's `KeySeed`) and the block's token ids, as vLLM keys its prefix cache. Equal keys
//! mean equal token prefixes under the same model and KV layout, short of breaking
//! SHA-256: the 64-bit unkeyed `DefaultHasher` used before let two prompts found in three
//! CPU-minutes share a block (the second request got the first one's output).
//!
//! Routers get 64 bits (`wire`): vLLM's default int form of its SHA-256 keys (the last 8
//! bytes, big-endian). A collision there misleads a router's guess, never the cache.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest, Sha256};

/// What a first block's key is chained to: the model, KV element and block size, so keys
/// never match across them (the disk tier's persisted blocks outlive the process).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct KeySeed([u8; 32]);

impl KeySeed {
    /// The seed for everything that decides a block's bits, described by `parts`.
    pub fn new(parts: &[&[u8]]) -> Self {
        let mut h = Sha256::new();
        h.update(b"strata-prefix-v1");
        for p in parts {
            h.update((p.len() as u64).to_le_bytes());
            h.update(p);
        }
        Self(h.finalize().into())
    }
}

/// One full block's key, chained through every block before it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey([u8; 32]);

impl BlockKey {
    /// The key of a block of `tokens` after `parent` (`None`: a prompt's first block).
    pub fn chained(seed: &KeySeed, parent: Option<&BlockKey>, tokens: &[u32]) -> Self {
        let mut h = Sha256::new();
        match parent {
            None => {
                h.update([0u8]);
                h.update(seed.0);
            }
            Some(p) => {
                h.update([1u8]);
                h.update(p.0);
            }
        }
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        Self(h.finalize().into())
    }

    /// The key as raw bytes (tests build colliding wire forms from them).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 64-bit form routers see (KV events, disk slot stamps): vLLM's int form.
    pub fn wire(&self) -> u64 {
        u64::from_be_bytes(self.0[24..].try_into().expect("8 bytes"))
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({self})")
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// In the disk tier's index: 64 hex digits.
impl Serialize for BlockKey {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for BlockKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        let bad = || serde::de::Error::custom("a block key is 64 hex digits");
        if text.len() != 64 || !text.is_ascii() {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Self(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chain_through_parents_and_depend_on_the_seed() {
        let seed = KeySeed::new(&[b"model a"]);
        let a = BlockKey::chained(&seed, None, &[1, 2, 3, 4]);
        assert_eq!(a, BlockKey::chained(&seed, None, &[1, 2, 3, 4]));
        assert_ne!(a, BlockKey::chained(&seed, None, &[1, 2, 3, 5]));
        let other = KeySeed::new(&[b"model b"]);
        assert_ne!(a, BlockKey::chained(&other, None, &[1, 2, 3, 4]));
        let b = BlockKey::chained(&seed, Some(&a), &[5, 6, 7, 8]);
        assert_ne!(b, BlockKey::chained(&seed, None, &[5, 6, 7, 8]));
        // Part boundaries count: ["ab"] and ["a", "b"] are other models.
        assert_ne!(KeySeed::new(&[b"ab"]), KeySeed::new(&[b"a", b"b"]));
    }

    #[test]
    fn sha256_of_the_seed_and_tokens_as_written_down() {
        // Independent of this module's code: the bytes hashed, spelled out.
        let seed = KeySeed::new(&[]);
        let mut bytes = vec![0u8];
        bytes.extend(seed.0);
        bytes.extend(7u32.to_le_bytes());
        let want: [u8; 32] = Sha256::digest(&bytes).into();
        assert_eq!(BlockKey::chained(&seed, None, &[7]).0, want);
        let expected_seed: [u8; 32] = Sha256::digest(b"strata-prefix-v1").into();
        assert_eq!(seed.0, expected_seed);
    }

    #[test]
    fn the_wire_form_is_the_last_8_bytes_big_endian_and_hex_round_trips() {
        let mut raw = [0u8; 32];
        raw[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        raw[0] = 0xAB;
        let k = BlockKey::from_bytes(raw);
        assert_eq!(k.wire(), 0x0102_0304_0506_0708);
        let json = serde_json::to_string(&k).unwrap();
        assert_eq!(json.len(), 66);
        assert!(json.starts_with("\"ab00"));
        assert_eq!(serde_json::from_str::<BlockKey>(&json).unwrap(), k);
        for bad in ["\"ab\"", &json.replace('a', "g"), "\"é\""] {
            assert!(serde_json::from_str::<BlockKey>(bad).is_err(), "{bad}");
        }
    }
}
