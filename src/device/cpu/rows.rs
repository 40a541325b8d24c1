//! A layer's K and V rows as the CPU attention reads them: raw pointers handed out a row
//! range at a time (the serving pool's other pages, a ring slot's neighbours may be under
//! another stream's copy), never one slice over the whole layer. `crate::kv::LayerKv`
//! makes them from a slot.

use std::marker::PhantomData;

/// A layer's K and V as the attention reads them, row by row (see the module docs).
#[derive(Clone, Copy)]
pub struct KvRows<'a> {
    k: *const f32,
    v: *const f32,
    len: usize,
    _borrow: PhantomData<&'a [f32]>,
}

// SAFETY: a shared view; the rows it reaches are not written while it lives (the
// `KvCache` contract, or a borrow of the caller's buffers).
unsafe impl Send for KvRows<'_> {}
unsafe impl Sync for KvRows<'_> {}

impl<'a> KvRows<'a> {
    /// # Safety
    /// `k` and `v` each address `len` f32s that nothing writes while the view lives.
    pub unsafe fn from_raw(k: *const f32, v: *const f32, len: usize) -> Self {
        Self {
            k,
            v,
            len,
            _borrow: PhantomData,
        }
    }

    pub fn from_slices(k: &'a [f32], v: &'a [f32]) -> Self {
        assert_eq!(k.len(), v.len(), "K and V hold the same rows");
        Self {
            k: k.as_ptr(),
            v: v.as_ptr(),
            len: k.len(),
            _borrow: PhantomData,
        }
    }

    /// K and V at `at..at + n` (offsets in f32s).
    #[inline(always)]
    pub fn rows(&self, at: usize, n: usize) -> (&'a [f32], &'a [f32]) {
        assert!(at + n <= self.len, "KV read {at}+{n} past {}", self.len);
        // SAFETY: in bounds (above); nothing writes the range while the view lives.
        unsafe {
            (
                std::slice::from_raw_parts(self.k.add(at), n),
                std::slice::from_raw_parts(self.v.add(at), n),
            )
        }
    }
}
