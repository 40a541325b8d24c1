//! Where a logical KV block's data lives, and the only legal ways it may move.
//!
//! ```text
//!            start_store(Cpu)            store_done
//!   Gpu ───────────────────▶ MovingToCpu ──────────▶ Cpu
//!    ▲ ▲◀──── store_failed ──────┘                     │ start_load
//!    │ └──────── load_done ◀──── MovingToGpu ◀─────────┘
//!    │                               └── load_failed ──▶ Cpu
//!    │  (the disk tier: the same shape with Ssd / MovingToSsd / MovingFromSsd; its
//!    │   copies are staged through host memory by the disk backend)
//! ```
//!
//! Demotion (the host tier is full): a host-resident block moves on to disk, holding its
//! host slot and a disk slot until the write is done.
//!
//! ```text
//!           demote              store_done
//!   Cpu ──────────▶ MovingCpuToSsd ──────────▶ Ssd
//!    ▲                   │
//!    └── store_failed ───┘   (the host copy is still valid)
//! ```
//!
//! A block is freed only from a settled state (`Gpu`, `Cpu`, `Ssd`): freeing a block
//! whose copy is in flight would let its page or slot be reused under the copy.

use thiserror::Error;

/// The storage tier a block can be offloaded to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    Cpu,
    /// The disk tier (`serve::disk`): one slot file, staged through host memory.
    Ssd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Residency {
    Gpu,
    Cpu,
    MovingToCpu,
    MovingToGpu,
    Ssd,
    MovingToSsd,
    MovingFromSsd,
    /// Demotion: host slot → disk slot (both held until the write completes).
    MovingCpuToSsd,
}

/// What happens to a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Move {
    StartStore(Tier),
    /// Host tier → disk tier (making room in the host tier).
    Demote,
    StoreDone,
    StoreFailed,
    StartLoad,
    LoadDone,
    LoadFailed,
}

#[derive(Debug, Error, PartialEq, Eq)]
#[error("illegal KV block transition: {event:?} from {from:?}")]
pub struct IllegalTransition {
    pub from: Residency,
    pub event: Move,
}

impl Residency {
    pub const ALL: [Residency; 8] = [
        Residency::Gpu,
        Residency::Cpu,
        Residency::MovingToCpu,
        Residency::MovingToGpu,
        Residency::Ssd,
        Residency::MovingToSsd,
        Residency::MovingFromSsd,
        Residency::MovingCpuToSsd,
    ];

    /// The state after `event`, or an error if `event` is illegal from `self`.
    pub fn apply(self, event: Move) -> Result<Residency, IllegalTransition> {
        use Move::*;
        use Residency::*;
        let next = match (self, event) {
            (Gpu, StartStore(Tier::Cpu)) => MovingToCpu,
            (Gpu, StartStore(Tier::Ssd)) => MovingToSsd,
            (MovingToCpu, StoreDone) => Cpu,
            (MovingToSsd, StoreDone) => Ssd,
            // A failed store leaves the data where it was: the source page is still valid.
            (MovingToCpu | MovingToSsd, StoreFailed) => Gpu,
            (Cpu, Demote) => MovingCpuToSsd,
            (MovingCpuToSsd, StoreDone) => Ssd,
            (MovingCpuToSsd, StoreFailed) => Cpu,
            (Cpu, StartLoad) => MovingToGpu,
            (Ssd, StartLoad) => MovingFromSsd,
            (MovingToGpu | MovingFromSsd, LoadDone) => Gpu,
            // A failed load leaves the data in the lower tier; the reserved page is released.
            (MovingToGpu, LoadFailed) => Cpu,
            (MovingFromSsd, LoadFailed) => Ssd,
            (from, event) => return Err(IllegalTransition { from, event }),
        };
        Ok(next)
    }

    /// Not mid-copy: the block may be freed, and exactly one copy of its data is valid.
    pub fn is_settled(self) -> bool {
        matches!(self, Residency::Gpu | Residency::Cpu | Residency::Ssd)
    }

    /// Holds a GPU page (as the valid copy, a store's source, or a load's destination).
    pub fn holds_page(self) -> bool {
        matches!(
            self,
            Residency::Gpu
                | Residency::MovingToCpu
                | Residency::MovingToGpu
                | Residency::MovingToSsd
                | Residency::MovingFromSsd
        )
    }

    /// Holds a host-tier slot (as the valid copy, a store's destination, or a load's source).
    pub fn holds_host_slot(self) -> bool {
        matches!(
            self,
            Residency::Cpu
                | Residency::MovingToCpu
                | Residency::MovingToGpu
                | Residency::MovingCpuToSsd
        )
    }

    /// Holds a disk-tier slot (as the valid copy, a store's destination, or a load's source).
    pub fn holds_disk_slot(self) -> bool {
        matches!(
            self,
            Residency::Ssd
                | Residency::MovingToSsd
                | Residency::MovingFromSsd
                | Residency::MovingCpuToSsd
        )
    }
}
