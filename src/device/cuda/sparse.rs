//! Launches of sparse decode's kernels (`kernels/sparse.cu`); their references are the
//! runtime's `sparse::page_bounds` and `sparse::head_bounds`, which they equal bit for bit
//! (gpu-check step 1, and the emulator in CI). `key_bits` (the mask planes per key and
//! channel) is the caller's, the runtime's `sparse::KEY_BITS`: `device/` is a leaf.

use super::ops::{arg, grid1, i, launch, Launch, EW};
use crate::device::cpu::ops::AttnHeads;
use crate::device::DevPtr;
use half::bf16;

/// sparse.cu `page_bounds(keys, bounds, pages, page_size, row, key_bits)`: channel-wise
/// min and max of K per page and `key_bits` mask planes, one thread per (page, channel).
pub fn page_bounds(
    keys: DevPtr<bf16>,   // bf16 [pages · page_size, row]
    bounds: DevPtr<bf16>, // bf16 [pages, meta_rows(page_size), row]
    pages: usize,
    page_size: usize,
    row: usize,
    key_bits: usize,
) -> Launch {
    let args = vec![
        arg(keys),
        arg(bounds),
        i(pages),
        i(page_size),
        i(row),
        i(key_bits),
    ];
    launch("sparse.cu", "page_bounds", grid1(pages * row, EW), args)
}

/// sparse.cu `head_bounds(q, bounds, out, pages, page_size, num_heads, num_kv_heads,
/// head_dim, key_bits)`: the box bound of each page for each query head, one thread per
/// (page, head).
pub fn head_bounds(
    q: DevPtr<bf16>,      // bf16 [num_heads, head_dim]
    bounds: DevPtr<bf16>, // bf16 [pages, meta_rows(page_size), num_kv_heads · head_dim]
    out: DevPtr<f32>,     // f32 [pages, num_heads]
    pages: usize,
    page_size: usize,
    h: AttnHeads,
    key_bits: usize,
) -> Launch {
    let args = vec![
        arg(q),
        arg(bounds),
        arg(out),
        i(pages),
        i(page_size),
        i(h.num_heads),
        i(h.num_kv_heads),
        i(h.head_dim),
        i(key_bits),
    ];
    launch(
        "sparse.cu",
        "head_bounds",
        grid1(pages * h.num_heads, EW),
        args,
    )
}
