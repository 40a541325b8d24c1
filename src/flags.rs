//! Bounds of every numeric command-line flag, in one place (the README's flag tables quote
//! them). A value outside its range is a usage error (exit 2) naming the flag and the range;
//! limits that depend on the model (context, memory) are checked after it loads (exit 1).
//! Each bound keeps every size derived from the flags far from wrapping in 64-bit
//! arithmetic; the derived sizes are still computed with checked arithmetic where formed.

use clap::builder::RangedU64ValueParser;

use crate::model::config::limits::MAX_CONTEXT;

/// Longest prompt, output, context or token budget, in tokens.
pub const MAX_TOKENS: usize = MAX_CONTEXT;
/// Most device ring slots of layerwise offload.
pub const MAX_KV_BUFFERS: usize = 64;
/// Largest KV block, in tokens.
pub use crate::offload::MAX_BLOCK_SIZE;
/// Most KV blocks of any tier (host, device pages).
pub const MAX_BLOCKS: usize = MAX_CONTEXT;
/// Most requests of a benchmark, or running at once.
pub const MAX_SEQS: usize = 1 << 16;
/// Most repeats of the needle cases.
pub const MAX_REPEATS: usize = 10_000;
/// Fastest simulated link, GB/s (faster than any memory bus).
pub const MAX_LINK_GBPS: f64 = 1e6;

fn ranged(lo: usize, hi: usize) -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::new().range(lo as u64..=hi as u64)
}

/// A token count that may be zero (`--max-tokens`, `--shared-prefix`, `--decode-steps`).
pub fn tokens_or_zero() -> RangedU64ValueParser<usize> {
    ranged(0, MAX_TOKENS)
}

/// A token count of at least one (`--max-model-len`, `--context`, `--input-len`).
pub fn tokens() -> RangedU64ValueParser<usize> {
    ranged(1, MAX_TOKENS)
}

/// Timed rounds of a benchmark (`strata bench offload --rounds`).
pub fn rounds() -> RangedU64ValueParser<usize> {
    ranged(1, 1000)
}

pub fn kv_buffers() -> RangedU64ValueParser<usize> {
    ranged(2, MAX_KV_BUFFERS)
}

pub fn block_size() -> RangedU64ValueParser<usize> {
    ranged(1, MAX_BLOCK_SIZE)
}

/// A block count of at least one (`--num-cpu-blocks`, `--num-gpu-blocks`).
pub fn blocks() -> RangedU64ValueParser<usize> {
    ranged(1, MAX_BLOCKS)
}

/// A block count that may be zero (`--max-cpu-offload-blocks`: 0 = recompute).
pub fn blocks_or_zero() -> RangedU64ValueParser<usize> {
    ranged(0, MAX_BLOCKS)
}

pub fn seqs() -> RangedU64ValueParser<usize> {
    ranged(1, MAX_SEQS)
}

/// Most connections a server keeps open at once (`--max-connections`).
pub const MAX_CONNECTIONS: usize = 1 << 20;

pub fn connections() -> RangedU64ValueParser<usize> {
    ranged(1, MAX_CONNECTIONS)
}

/// A timeout in whole seconds, 1 s to a day (`--header-read-timeout`, `--body-read-timeout`).
pub fn seconds() -> RangedU64ValueParser<u64> {
    RangedU64ValueParser::new().range(1..=86_400)
}

pub fn repeats() -> RangedU64ValueParser<usize> {
    ranged(1, MAX_REPEATS)
}

/// A simulated link speed in GB/s: finite, 0 (= unthrottled) up to `MAX_LINK_GBPS`.
pub fn link_gbps(s: &str) -> Result<f64, String> {
    let x: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("expected a number of GB/s, got {s:?}"))?;
    if !(x.is_finite() && (0.0..=MAX_LINK_GBPS).contains(&x)) {
        return Err(format!("{s} is not in 0..={MAX_LINK_GBPS} GB/s"));
    }
    Ok(x)
}

/// A ratio in (0, 1000] (`--transfer-over-compute`).
pub fn positive_ratio(s: &str) -> Result<f64, String> {
    let x: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("expected a positive number, got {s:?}"))?;
    if !(x > 0.0 && x <= 1000.0) {
        return Err(format!("{s} is not in (0, 1000]"));
    }
    Ok(x)
}

/// A fraction in [0, 1] (`--depth`).
pub fn fraction(s: &str) -> Result<f64, String> {
    let x: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("expected a number in [0, 1], got {s:?}"))?;
    if !(0.0..=1.0).contains(&x) {
        return Err(format!("{s} is not in [0, 1]"));
    }
    Ok(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_speeds_must_be_finite_and_not_negative() {
        assert_eq!(link_gbps("12.5"), Ok(12.5));
        assert_eq!(link_gbps("0"), Ok(0.0));
        for bad in ["NaN", "nan", "inf", "-1", "1e300", "fast", ""] {
            assert!(link_gbps(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn fractions_are_within_zero_and_one() {
        assert_eq!(fraction("0.5"), Ok(0.5));
        for bad in ["NaN", "-0.1", "1.01", "inf"] {
            assert!(fraction(bad).is_err(), "{bad} accepted");
        }
    }
}
