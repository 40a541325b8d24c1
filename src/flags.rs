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
/// Slowest simulated link other than 0 (unthrottled), GB/s: 1 MB/s. Slower links turn a
/// copy into sleeps of days (and, far below, into durations that do not exist).
pub const MIN_LINK_GBPS: f64 = 1e-3;
/// Most IO threads of the disk tier (`--disk-io-threads`, `bench disk --threads`).
pub const MAX_IO_THREADS: usize = 64;
/// Largest `strata bench disk --size-mib` (16 TiB) and `--payload-bytes` (1 GiB).
pub const MAX_BENCH_DISK_MIB: usize = 16 << 20;
pub const MAX_PAYLOAD_BYTES: usize = 1 << 30;
/// Most requests `strata serve` admits at once (`--max-pending-requests`).
pub const MAX_PENDING: usize = 1 << 20;
/// Longest `strata serve --shutdown-timeout`, seconds (a day).
pub const MAX_SHUTDOWN_SECS: u64 = 86_400;

fn ranged(lo: usize, hi: usize) -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::new().range(lo as u64..=hi as u64)
}

/// A token count that may be zero (`--max-tokens`, `--shared-prefix`, `--greedy-tokens`).
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

/// `--num-expert-buffers`: one slot is allowed (each layer's experts copied, then used).
pub fn expert_buffers() -> RangedU64ValueParser<usize> {
    ranged(1, MAX_KV_BUFFERS)
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

/// A simulated link speed in GB/s: 0 (= unthrottled), or `MIN_LINK_GBPS` up to
/// `MAX_LINK_GBPS`.
pub fn link_gbps(s: &str) -> Result<f64, String> {
    let x: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("expected a number of GB/s, got {s:?}"))?;
    if !link_gbps_in_range(x) {
        return Err(format!(
            "{s} is not 0 (unthrottled) or in {MIN_LINK_GBPS}..={MAX_LINK_GBPS} GB/s"
        ));
    }
    Ok(x)
}

/// `strata serve --host`: an IP address, or a host name (letters, digits, `-` and `.`,
/// labels of 1 to 63 characters, 253 at most); resolving it is the listener's job.
pub fn host(s: &str) -> Result<String, String> {
    if s.parse::<std::net::IpAddr>().is_ok() {
        return Ok(s.to_string());
    }
    let label_ok = |l: &str| {
        (1..=63).contains(&l.len())
            && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    let name = s.strip_suffix('.').unwrap_or(s);
    if s.len() <= 253 && !name.is_empty() && name.split('.').all(label_ok) {
        return Ok(s.to_string());
    }
    Err(format!("{s:?} is not an IP address or a host name"))
}

/// Whether `x` GB/s is a simulated link speed `link_gbps` accepts.
pub fn link_gbps_in_range(x: f64) -> bool {
    x == 0.0 || (MIN_LINK_GBPS..=MAX_LINK_GBPS).contains(&x)
}

/// IO threads (`--disk-io-threads`).
pub fn io_threads() -> RangedU64ValueParser<usize> {
    ranged(1, MAX_IO_THREADS)
}

/// `strata bench disk --size-mib`.
pub fn bench_disk_mib() -> RangedU64ValueParser<usize> {
    ranged(1, MAX_BENCH_DISK_MIB)
}

/// `strata bench disk --payload-bytes`.
pub fn payload_bytes() -> RangedU64ValueParser<usize> {
    ranged(1, MAX_PAYLOAD_BYTES)
}

/// `strata serve --max-pending-requests`.
pub fn pending() -> RangedU64ValueParser<usize> {
    ranged(1, MAX_PENDING)
}

/// `strata serve --shutdown-timeout`, seconds.
pub fn shutdown_secs() -> RangedU64ValueParser<u64> {
    RangedU64ValueParser::new().range(0..=MAX_SHUTDOWN_SECS)
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
        assert_eq!(link_gbps("0.001"), Ok(0.001));
        assert_eq!(link_gbps("1e6"), Ok(1e6));
        // Tiny positive speeds: sleeps of years, or durations past `Duration`'s range.
        for bad in [
            "NaN", "nan", "inf", "-1", "1e300", "fast", "", "1e-300", "0.0009", "5e-324",
        ] {
            assert!(link_gbps(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn hosts_are_addresses_or_names() {
        for ok in [
            "127.0.0.1",
            "::1",
            "0.0.0.0",
            "localhost",
            "my-host.example.com",
            "a.",
        ] {
            assert!(host(ok).is_ok(), "{ok} refused");
        }
        for bad in ["", "a b", "-a", "a..b", "x\n", "http://h", &"a".repeat(64)] {
            assert!(host(bad).is_err(), "{bad} accepted");
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

/// `--dtype`, on every command that loads a model: how the CPU holds the weights and
/// computes the matmuls. Its help is the one description of the choice (docs/cpu.md has
/// the measurements).
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub struct WeightDtypeArg {
    /// How the CPU holds the weights: q8 (as stored; rows of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and the
    /// Q4_K/Q5_K/Q6_K K-quants repacked, each
    /// matmul's input quantised to 15 bits per block of 32 for integer dots: the fastest,
    /// within ~1e-6 nats of the reference, not bitwise), stored (as in the file, widened in
    /// registers: bitwise the f32 reference) or f32 (widened at load: the reference, 4-6x
    /// the memory). CUDA uploads bf16 whatever this says [default: q8 on the CPU, stored on
    /// CUDA]
    #[arg(long, value_enum, value_name = "DTYPE")]
    pub dtype: Option<crate::model::weights::WeightDtype>,
}

impl WeightDtypeArg {
    /// The flag's mode, or the default for `device`: q8 on the CPU (its greedy outputs equal
    /// the reference's on the reference prompts: docs/cpu.md, "Accuracy"), stored for CUDA
    /// (which holds its own bf16 copy, so repacking for the CPU would be wasted work).
    pub fn resolve(self, device: crate::device::DeviceKind) -> crate::model::weights::WeightDtype {
        use crate::model::weights::WeightDtype;
        self.dtype.unwrap_or(match device {
            crate::device::DeviceKind::Cpu => WeightDtype::Q8,
            crate::device::DeviceKind::Cuda => WeightDtype::Stored,
        })
    }
}

/// `--kv-dtype`, on every command that sizes a KV cache: the element the CPU device stores
/// K and V in. Its help is the one description of the choice (docs/cpu.md has the numbers).
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub struct KvDtypeArg {
    /// KV cache element on the CPU device: f32 (the reference), bf16 or f16 (half the
    /// bytes; attention widens them in registers). CUDA stores bf16 [default: f16 on the
    /// CPU, bf16 on CUDA]
    #[arg(long, value_enum, value_name = "DTYPE")]
    pub kv_dtype: Option<crate::device::KvDtype>,
}

impl KvDtypeArg {
    /// The element `device` stores: the flag's, or the device's default; one error line
    /// where the device cannot store it.
    pub fn resolve(
        self,
        device: crate::device::DeviceKind,
    ) -> anyhow::Result<crate::device::KvDtype> {
        device.kv_dtype(self.kv_dtype)
    }
}
