//! A typed address in one device's memory: `DevPtr<f32>` on the CPU device, `DevPtr<bf16>`
//! on CUDA. Offsets count elements of `T`, so a byte offset or a pointer of the wrong
//! element type is a compile error rather than a silent misaddress.

use std::marker::PhantomData;

pub struct DevPtr<T> {
    addr: u64,
    _elem: PhantomData<fn() -> T>,
}

impl<T> Clone for DevPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DevPtr<T> {}

impl<T> PartialEq for DevPtr<T> {
    fn eq(&self, o: &Self) -> bool {
        self.addr == o.addr
    }
}

impl<T> std::fmt::Debug for DevPtr<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DevPtr<{}>({:#x})",
            std::any::type_name::<T>(),
            self.addr
        )
    }
}

impl<T> DevPtr<T> {
    /// The address as the device's API takes it (a `CUdeviceptr`, or a host address on the
    /// CPU device).
    pub const fn from_addr(addr: u64) -> Self {
        Self {
            addr,
            _elem: PhantomData,
        }
    }

    pub const fn addr(self) -> u64 {
        self.addr
    }

    /// Element `i` of the `T` array starting here.
    pub const fn at(self, i: usize) -> Self {
        Self::from_addr(self.addr + (i * std::mem::size_of::<T>()) as u64)
    }

    /// The same address viewed as another element type (a byte buffer holding `U`s).
    pub const fn cast<U>(self) -> DevPtr<U> {
        DevPtr::from_addr(self.addr)
    }

    /// On the CPU device, device memory is host memory: the address as a raw pointer.
    pub fn as_host_ptr(self) -> *mut T {
        self.addr as usize as *mut T
    }
}

#[cfg(test)]
mod tests {
    use super::DevPtr;

    #[test]
    fn offsets_count_elements() {
        let p = DevPtr::<f32>::from_addr(0x1000);
        assert_eq!(p.at(3).addr(), 0x100c);
        assert_eq!(p.cast::<u16>().at(3).addr(), 0x1006);
    }
}
