//! The KV cache's element type, one concept for every device, tier and kernel: `KvDtype`
//! names it at run time (`--kv-dtype`), `KvElem` is the Rust type the caches, copies and
//! kernels are generic over, and `with_kv_elem!` is the one place that maps the first to
//! the second. A `KvCache<bf16>` and a `KvCache<f32>` are different types, so a page pool
//! of one element can never be handed to a model, tier or kernel of another.
//!
//! Every element widens to f32 exactly, and the CPU kernels compute in f32 on the widened
//! values; so a 16-bit cache gives bitwise the results of an f32 cache holding the same
//! (rounded) values. Only the rounding at the store differs between the dtypes.

pub use half::{bf16, f16};

/// A KV element type, as the command line and the disk tier's fingerprint name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum KvDtype {
    /// 32-bit float: the reference.
    F32,
    /// bfloat16: f32's range, 8 bits of mantissa (what the CUDA device stores).
    Bf16,
    /// IEEE half: 11 bits of mantissa, range ±65504 (what llama.cpp stores by default).
    F16,
}

impl KvDtype {
    /// Bytes of one element.
    pub const fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 | KvDtype::F16 => 2,
        }
    }

    /// Its name in flags, JSON and fingerprints.
    pub const fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
            KvDtype::F16 => "f16",
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A KV element: what the caches hold, the copies move and the kernels read (widening to
/// f32 in registers). Sparse decode's page metadata is made of it too: the min and max of
/// elements are elements, so bounds are kept exactly in the KV's own type, and a mask
/// row's element carries 16 bits as its bit pattern.
pub trait KvElem: Copy + Default + PartialEq + Send + Sync + std::fmt::Debug + 'static {
    const DTYPE: KvDtype;
    /// Its name where a format records it (the disk tier's fingerprint).
    const NAME: &'static str = Self::DTYPE.name();
    /// Exact: every element is an f32 value.
    fn to_f32(self) -> f32;
    /// Round to nearest, ties to even (f16: values past ±65504 become ±∞).
    fn from_f32(x: f32) -> Self;
    /// The element whose low 16 bits are `m` (a mask row's entry).
    fn from_mask(m: u16) -> Self;
    fn mask(self) -> u16;
}

impl KvElem for f32 {
    const DTYPE: KvDtype = KvDtype::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    fn from_mask(m: u16) -> Self {
        f32::from_bits(m as u32)
    }
    fn mask(self) -> u16 {
        self.to_bits() as u16
    }
}

impl KvElem for bf16 {
    const DTYPE: KvDtype = KvDtype::Bf16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn from_mask(m: u16) -> Self {
        bf16::from_bits(m)
    }
    fn mask(self) -> u16 {
        self.to_bits()
    }
}

impl KvElem for f16 {
    const DTYPE: KvDtype = KvDtype::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn from_mask(m: u16) -> Self {
        f16::from_bits(m)
    }
    fn mask(self) -> u16 {
        self.to_bits()
    }
}

/// Runs `$body` with `$T` the `KvElem` type of the `KvDtype` `$dtype`: the one run-time to
/// compile-time mapping (`with_kv_elem!(dtype, T => Engine::<T>::new())`).
#[macro_export]
macro_rules! with_kv_elem {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::device::kv_elem::KvDtype::F32 => {
                type $T = f32;
                $body
            }
            $crate::device::kv_elem::KvDtype::Bf16 => {
                type $T = $crate::device::kv_elem::bf16;
                $body
            }
            $crate::device::kv_elem::KvDtype::F16 => {
                type $T = $crate::device::kv_elem::f16;
                $body
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip<T: KvElem>() {
        assert_eq!(T::DTYPE.bytes(), std::mem::size_of::<T>());
        for m in [0u16, 1, 0x7f80, 0xffff, 0x8000] {
            assert_eq!(T::from_mask(m).mask(), m, "{} mask {m:#x}", T::NAME);
        }
        // Every element widens exactly: converting back gives the same element.
        for x in [0.0f32, -1.5, 3.140625, 1e-3, 100.0] {
            let e = T::from_f32(x);
            assert_eq!(T::from_f32(e.to_f32()), e, "{} {x}", T::NAME);
        }
        // The macro maps each dtype to the type of that dtype.
        with_kv_elem!(T::DTYPE, E => assert_eq!(E::DTYPE, T::DTYPE));
    }

    #[test]
    fn every_element_round_trips_and_its_dtype_names_its_size() {
        round_trip::<f32>();
        round_trip::<bf16>();
        round_trip::<f16>();
    }

    #[test]
    fn the_16_bit_elements_round_to_nearest_even() {
        // 1 + 2^-8 is halfway between two bf16 values: ties to even (1.0).
        assert_eq!(bf16::from_f32(1.0 + 1.0 / 256.0).to_f32(), 1.0);
        assert_eq!(
            <bf16 as KvElem>::from_f32(1.0 + 3.0 / 256.0).to_f32(),
            1.0 + 4.0 / 256.0
        );
        // f16 keeps 10 stored mantissa bits: 1 + 2^-11 ties to 1.0, 1 + 3·2^-11 up.
        assert_eq!(<f16 as KvElem>::from_f32(1.0 + 1.0 / 2048.0).to_f32(), 1.0);
        assert_eq!(
            <f16 as KvElem>::from_f32(1.0 + 3.0 / 2048.0).to_f32(),
            1.0 + 4.0 / 2048.0
        );
        assert_eq!(<f16 as KvElem>::from_f32(1e6).to_f32(), f32::INFINITY);
    }
}
