//! What the runtime names on a device: streams by role, events, allocations and spans of
//! them. Plain handles, shared by every device, the offload engine, the serving pages and
//! the stream-ordering checker (`super::order`).

use anyhow::{bail, Result};

/// A stream by what it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamRole {
    /// The model's stream: layer compute and the decode-buffer copies.
    Compute,
    /// Host → device prefetch of the next layers' KV.
    Prefetch,
    /// Device → host offload, a pool: consecutive layers' offloads run side by side.
    Offload(usize),
    /// Sparse decode: host → device fetch of the pages a layer selected but was not
    /// prefetched with (its own stream, so it does not queue behind the next layers'
    /// prefetches; it shares the link with them).
    Miss,
    /// The disk tier's staging copies, both ways (pages ↔ host staging memory), so they
    /// queue behind neither the host tier's stores nor its loads.
    Staging,
}

impl std::fmt::Display for StreamRole {
    /// The name traces and error messages give the stream.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamRole::Compute => f.write_str("compute"),
            StreamRole::Prefetch => f.write_str("h2d-prefetch"),
            StreamRole::Miss => f.write_str("h2d-miss"),
            StreamRole::Staging => f.write_str("disk-staging"),
            StreamRole::Offload(i) => write!(f, "d2h-offload-{i}"),
        }
    }
}

/// An event created by the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventId(pub usize);

/// An allocation made by the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemId(pub usize);

/// Host memory (pinned on CUDA) or device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    Host,
    Device,
}

/// `len` elements of allocation `mem`, from element `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub mem: MemId,
    pub off: usize,
    pub len: usize,
}

/// Allocations by id with their sizes, so every copy is checked against its buffers.
pub struct Allocations<M> {
    mems: Vec<(M, Space, usize)>, // (memory, space, elements)
}

impl<M> Default for Allocations<M> {
    fn default() -> Self {
        Self { mems: Vec::new() }
    }
}

impl<M> Allocations<M> {
    pub fn add(&mut self, mem: M, space: Space, elems: usize) -> MemId {
        self.mems.push((mem, space, elems));
        MemId(self.mems.len() - 1)
    }

    pub fn get(&self, id: MemId) -> &M {
        &self.mems[id.0].0
    }

    pub fn space(&self, id: MemId) -> Space {
        self.mems[id.0].1
    }

    /// Errors unless `s` lies inside its allocation.
    pub fn check(&self, s: Span) -> Result<()> {
        let Some(&(_, _, elems)) = self.mems.get(s.mem.0) else {
            bail!(
                "offload copy names allocation {} of {}",
                s.mem.0,
                self.mems.len()
            );
        };
        match s.off.checked_add(s.len) {
            Some(end) if end <= elems => Ok(()),
            _ => bail!(
                "offload copy of {} elements at {} overruns an allocation of {elems}",
                s.len,
                s.off
            ),
        }
    }

    /// Errors unless `src` and `dst` are equally long and lie inside their allocations.
    pub fn check_copy(&self, name: &str, src: Span, dst: Span) -> Result<()> {
        if src.len != dst.len {
            bail!("offload copy {name}: {} elements into {}", src.len, dst.len);
        }
        self.check(src)?;
        self.check(dst)
    }
}
