//! A layer's K and V rows as the CPU attention reads them: raw pointers handed out a row
//! range at a time (the serving pool's other pages, a ring slot's neighbours may be under
//! another stream's copy), never one slice over the whole layer. `crate::kv::LayerKv`
//! makes them from a slot. Elements are the cache's `KvElem` (`T`), widened by the kernels.

use std::marker::PhantomData;

/// A layer's K and V as the attention reads them, row by row (see the module docs).
pub struct KvRows<'a, T> {
    k: *const T,
    v: *const T,
    len: usize, // elements in each of K and V
    _borrow: PhantomData<&'a [T]>,
}

impl<T> Clone for KvRows<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for KvRows<'_, T> {}

// SAFETY: a shared view; the rows it reaches are not written while it lives (the
// `KvCache` contract, or a borrow of the caller's buffers).
unsafe impl<T: Sync> Send for KvRows<'_, T> {}
unsafe impl<T: Sync> Sync for KvRows<'_, T> {}

impl<'a, T> KvRows<'a, T> {
    /// # Safety
    /// `k` and `v` each address `len` elements that nothing writes while the view lives.
    pub unsafe fn from_raw(k: *const T, v: *const T, len: usize) -> Self {
        Self {
            k,
            v,
            len,
            _borrow: PhantomData,
        }
    }

    pub fn from_slices(k: &'a [T], v: &'a [T]) -> Self {
        assert_eq!(k.len(), v.len(), "K and V hold the same rows");
        Self {
            k: k.as_ptr(),
            v: v.as_ptr(),
            len: k.len(),
            _borrow: PhantomData,
        }
    }

    /// K and V at `at..at + n` (offsets in elements).
    #[inline(always)]
    pub fn rows(&self, at: usize, n: usize) -> (&'a [T], &'a [T]) {
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
