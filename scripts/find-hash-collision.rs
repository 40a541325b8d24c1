//! Finds two 16-token blocks whose prefix-cache keys collided under the 64-bit key strata
//! used before SHA-256 (`DefaultHasher` over `(None::<u64>, tokens)`, unkeyed SipHash-1-3):
//! Pollard's rho with distinguished points, ~2^32 hashes, memory in megabytes. The pair
//! it printed is in tests/serve_scheduler.rs (the collision test).
//!
//!     rustc -O scripts/find-hash-collision.rs -o /tmp/find-collision && /tmp/find-collision
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// 64 bits as 16 token ids: 4 bits each, offset into ordinary vocabulary ids.
fn block(x: u64) -> [u32; 16] {
    std::array::from_fn(|i| 1000 + ((x >> (4 * i)) & 0xF) as u32)
}

fn old_key(tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    None::<u64>.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

fn step(x: u64) -> u64 {
    old_key(&block(x))
}

fn main() {
    const DP_BITS: u32 = 18; // a distinguished point has its top 18 bits zero
    let dp = |x: u64| x >> (64 - DP_BITS) == 0;
    // distinguished point -> (start of the chain, its length)
    let mut seen: HashMap<u64, (u64, u64)> = HashMap::new();
    let mut start = 0x5eed_u64;
    loop {
        start = start.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let (mut x, mut len) = (start, 0u64);
        while !dp(x) && len < 40 << DP_BITS {
            x = step(x);
            len += 1;
        }
        if !dp(x) {
            continue;
        }
        if let Some(&(s2, l2)) = seen.get(&x) {
            // Two chains meet: walk them to the same distance, then in step to the merge.
            let (mut a, mut b) = (start, s2);
            let (mut la, mut lb) = (len, l2);
            while la > lb {
                a = step(a);
                la -= 1;
            }
            while lb > la {
                b = step(b);
                lb -= 1;
            }
            if a == b {
                continue; // one chain started on the other
            }
            while step(a) != step(b) {
                a = step(a);
                b = step(b);
            }
            println!("a = {a:#018x} block {:?}", block(a));
            println!("b = {b:#018x} block {:?}", block(b));
            println!("key {:#018x}", step(a));
            return;
        }
        seen.insert(x, (start, len));
        if seen.len() % 1024 == 0 {
            eprintln!("{} chains", seen.len());
        }
    }
}
