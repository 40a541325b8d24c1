//! Block metadata, owned by the scheduler side: logical block ids (stable for a sequence's
//! life), which physical GPU page or host slot each one occupies, reference counts, and
//! the prefix cache. It never touches KV memory; the worker side does, through jobs.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};

use thiserror::Error;

use super::residency::{IllegalTransition, Move, Residency, Tier};

/// A block's identity, stable while any sequence refers to it.
pub type LogicalId = u32;
/// An index into the per-layer GPU page pool `[num_gpu_blocks, block_size, kv_heads, head_dim]`.
pub type PageId = u32;
/// An index into the host tier `[max_cpu_offload_blocks, block_size, kv_heads, head_dim]`.
pub type SlotId = u32;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum BlockError {
    #[error("out of GPU pages: {need} needed, {free} free")]
    NoPages { need: usize, free: usize },
    #[error("out of host slots: {need} needed, {free} free")]
    NoSlots { need: usize, free: usize },
    #[error("unknown logical block {0}")]
    Unknown(LogicalId),
    #[error("block {id} is not resident on the GPU (it is {state:?})")]
    NotResident { id: LogicalId, state: Residency },
    #[error("block {0} has no references to release")]
    NotReferenced(LogicalId),
    #[error("block {id} is released while {state:?}: a copy is in flight")]
    ReleaseInFlight { id: LogicalId, state: Residency },
    #[error(transparent)]
    Illegal(#[from] IllegalTransition),
}

#[derive(Debug, Clone)]
pub struct Block {
    pub refs: u32,
    pub state: Residency,
    pub page: Option<PageId>,
    pub slot: Option<SlotId>,
    /// Content hash (chained with the previous block's) once the block is full, computed,
    /// and registered in the prefix cache.
    pub hash: Option<u64>,
}

/// Chained content hash of one full block: equal hashes mean equal token prefixes.
pub fn block_hash(prev: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new(); // fixed keys: the same on every run
    prev.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

pub struct BlockManager {
    num_pages: usize,
    num_slots: usize,
    blocks: HashMap<LogicalId, Block>,
    next_id: LogicalId,
    free_pages: VecDeque<PageId>,
    free_slots: Vec<SlotId>,
    /// Prefix cache: hash → block. Only GPU-resident blocks are handed out on a hit.
    by_hash: HashMap<u64, LogicalId>,
    /// Unreferenced but cached GPU blocks, least recently released first; their pages are
    /// reclaimed (and the cache entry dropped) when free pages run out.
    evictable: VecDeque<LogicalId>,
}

impl BlockManager {
    pub fn new(num_pages: usize, num_slots: usize) -> Self {
        Self {
            num_pages,
            num_slots,
            blocks: HashMap::new(),
            next_id: 0,
            free_pages: (0..num_pages as PageId).collect(),
            free_slots: (0..num_slots as SlotId).rev().collect(),
            by_hash: HashMap::new(),
            evictable: VecDeque::new(),
        }
    }

    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// Pages that can be handed out now (free or held only by the prefix cache).
    pub fn available_pages(&self) -> usize {
        self.free_pages.len() + self.evictable.len()
    }

    pub fn free_slots(&self) -> usize {
        self.free_slots.len()
    }

    /// Pages that will come free when in-flight stores complete.
    pub fn pages_being_stored(&self) -> usize {
        self.blocks
            .values()
            .filter(|b| matches!(b.state, Residency::MovingToCpu | Residency::MovingToSsd))
            .count()
    }

    pub fn block(&self, id: LogicalId) -> Result<&Block, BlockError> {
        self.blocks.get(&id).ok_or(BlockError::Unknown(id))
    }

    fn block_mut(&mut self, id: LogicalId) -> Result<&mut Block, BlockError> {
        self.blocks.get_mut(&id).ok_or(BlockError::Unknown(id))
    }

    pub fn state(&self, id: LogicalId) -> Result<Residency, BlockError> {
        Ok(self.block(id)?.state)
    }

    /// The resolver: the physical page of a GPU-resident block, and nothing else.
    pub fn resolve(&self, id: LogicalId) -> Result<PageId, BlockError> {
        let b = self.block(id)?;
        match (b.state, b.page) {
            (Residency::Gpu, Some(p)) => Ok(p),
            (state, _) => Err(BlockError::NotResident { id, state }),
        }
    }

    /// Takes a page: a free one, else the least recently used cached block's.
    fn take_page(&mut self) -> Option<PageId> {
        if let Some(p) = self.free_pages.pop_front() {
            return Some(p);
        }
        let id = self.evictable.pop_front()?;
        let b = self.blocks.remove(&id).expect("evictable blocks exist");
        if let Some(h) = b.hash {
            if self.by_hash.get(&h) == Some(&id) {
                self.by_hash.remove(&h);
            }
        }
        b.page
    }

    /// New GPU blocks with one reference each, all or nothing.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<LogicalId>, BlockError> {
        if self.available_pages() < n {
            return Err(BlockError::NoPages {
                need: n,
                free: self.available_pages(),
            });
        }
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            let page = self.take_page().expect("counted above");
            let id = self.next_id;
            self.next_id = self.next_id.wrapping_add(1);
            self.blocks.insert(
                id,
                Block {
                    refs: 1,
                    state: Residency::Gpu,
                    page: Some(page),
                    slot: None,
                    hash: None,
                },
            );
            ids.push(id);
        }
        Ok(ids)
    }

    /// A prefix-cache hit: a GPU-resident block with this content hash.
    pub fn lookup(&self, hash: u64) -> Option<LogicalId> {
        let id = *self.by_hash.get(&hash)?;
        (self.blocks.get(&id)?.state == Residency::Gpu).then_some(id)
    }

    /// Takes one more reference to an existing block (a prefix-cache hit).
    pub fn acquire(&mut self, id: LogicalId) -> Result<(), BlockError> {
        let b = self.block_mut(id)?;
        b.refs += 1;
        if b.refs == 1 {
            self.evictable.retain(|&e| e != id);
        }
        Ok(())
    }

    /// Registers a full, computed block under its content hash (first writer wins).
    pub fn register(&mut self, id: LogicalId, hash: u64) -> Result<(), BlockError> {
        let b = self.block_mut(id)?;
        if b.hash.is_some() {
            return Ok(());
        }
        b.hash = Some(hash);
        self.by_hash.entry(hash).or_insert(id);
        Ok(())
    }

    /// Drops one reference. The last one frees the block, except that a cached GPU block
    /// stays (evictable) so a later request with the same prefix can reuse it.
    pub fn release(&mut self, id: LogicalId) -> Result<(), BlockError> {
        let b = self.block_mut(id)?;
        if b.refs == 0 {
            return Err(BlockError::NotReferenced(id));
        }
        if b.refs == 1 && !b.state.is_settled() {
            return Err(BlockError::ReleaseInFlight { id, state: b.state });
        }
        b.refs -= 1;
        if b.refs > 0 {
            return Ok(());
        }
        let cached =
            b.state == Residency::Gpu && b.hash.is_some_and(|h| self.by_hash.get(&h) == Some(&id));
        if cached {
            self.evictable.push_back(id);
            return Ok(());
        }
        let b = self.blocks.remove(&id).expect("looked up above");
        if let Some(h) = b.hash {
            if self.by_hash.get(&h) == Some(&id) {
                self.by_hash.remove(&h);
            }
        }
        self.free_pages.extend(b.page);
        self.free_slots.extend(b.slot);
        Ok(())
    }

    /// Starts moving GPU blocks to `tier`: each gets a slot and keeps its page until the
    /// store completes, so the page cannot be handed out under the copy. All or nothing.
    pub fn start_store(
        &mut self,
        ids: &[LogicalId],
        tier: Tier,
    ) -> Result<Vec<(LogicalId, PageId, SlotId)>, BlockError> {
        if self.free_slots.len() < ids.len() {
            return Err(BlockError::NoSlots {
                need: ids.len(),
                free: self.free_slots.len(),
            });
        }
        for &id in ids {
            self.block(id)?.state.apply(Move::StartStore(tier))?;
        }
        let mut out = Vec::with_capacity(ids.len());
        for &id in ids {
            let slot = self.free_slots.pop().expect("counted above");
            let b = self.blocks.get_mut(&id).expect("checked above");
            b.state = b.state.apply(Move::StartStore(tier))?;
            b.slot = Some(slot);
            out.push((id, b.page.expect("a GPU block has a page"), slot));
        }
        Ok(out)
    }

    /// A store finished: on success the page is released (only now); on failure the slot
    /// is, and the block is back on the GPU with its data untouched.
    pub fn finish_store(&mut self, id: LogicalId, ok: bool) -> Result<(), BlockError> {
        let b = self.block_mut(id)?;
        b.state = b.state.apply(if ok {
            Move::StoreDone
        } else {
            Move::StoreFailed
        })?;
        let freed = if ok {
            (b.page.take(), None)
        } else {
            (None, b.slot.take())
        };
        self.free_pages.extend(freed.0);
        self.free_slots.extend(freed.1);
        Ok(())
    }

    /// Starts loading lower-tier blocks back: each gets a reserved (new) page. All or nothing.
    pub fn start_load(
        &mut self,
        ids: &[LogicalId],
    ) -> Result<Vec<(LogicalId, SlotId, PageId)>, BlockError> {
        if self.available_pages() < ids.len() {
            return Err(BlockError::NoPages {
                need: ids.len(),
                free: self.available_pages(),
            });
        }
        for &id in ids {
            self.block(id)?.state.apply(Move::StartLoad)?;
        }
        let mut out = Vec::with_capacity(ids.len());
        for &id in ids {
            let page = self.take_page().expect("counted above");
            let b = self.blocks.get_mut(&id).expect("checked above");
            b.state = b.state.apply(Move::StartLoad)?;
            b.page = Some(page);
            out.push((id, b.slot.expect("an offloaded block has a slot"), page));
        }
        Ok(out)
    }

    /// A load finished: on success the slot is released and the block resolves to its new
    /// page; on failure the reserved page is released and the data stays in the lower tier.
    pub fn finish_load(&mut self, id: LogicalId, ok: bool) -> Result<(), BlockError> {
        let b = self.block_mut(id)?;
        b.state = b
            .state
            .apply(if ok { Move::LoadDone } else { Move::LoadFailed })?;
        let freed = if ok {
            (None, b.slot.take())
        } else {
            (b.page.take(), None)
        };
        self.free_pages.extend(freed.0);
        self.free_slots.extend(freed.1);
        Ok(())
    }

    /// Checks the bookkeeping against the sequences' block lists (`holders`): reference
    /// counts, one owner per page and slot, pages/slots held exactly per residency, and
    /// every page and slot either owned or free. Returns the first violation.
    pub fn check(&self, holders: &[&[LogicalId]]) -> Result<(), String> {
        let mut refs: HashMap<LogicalId, u32> = HashMap::new();
        for ids in holders {
            for &id in *ids {
                *refs.entry(id).or_default() += 1;
            }
        }
        let mut page_owner = vec![None; self.num_pages];
        let mut slot_owner = vec![None; self.num_slots];
        for (&id, b) in &self.blocks {
            let want = refs.get(&id).copied().unwrap_or(0);
            if b.refs != want {
                return Err(format!("block {id}: {} refs, {want} holders", b.refs));
            }
            if b.refs == 0 && !self.evictable.contains(&id) {
                return Err(format!("block {id}: unreferenced but not evictable"));
            }
            if b.state.holds_page() != b.page.is_some() || b.state.holds_slot() != b.slot.is_some()
            {
                return Err(format!(
                    "block {id}: {:?} with {:?}/{:?}",
                    b.state, b.page, b.slot
                ));
            }
            if let Some(p) = b.page {
                let o = page_owner
                    .get_mut(p as usize)
                    .ok_or(format!("page {p} out of range"))?;
                if let Some(other) = o.replace(id) {
                    return Err(format!("page {p} owned by blocks {other} and {id}"));
                }
            }
            if let Some(s) = b.slot {
                let o = slot_owner
                    .get_mut(s as usize)
                    .ok_or(format!("slot {s} out of range"))?;
                if let Some(other) = o.replace(id) {
                    return Err(format!("slot {s} owned by blocks {other} and {id}"));
                }
            }
        }
        for id in refs.keys() {
            if !self.blocks.contains_key(id) {
                return Err(format!("a sequence holds freed block {id}"));
            }
        }
        for &p in &self.free_pages {
            if let Some(id) = page_owner[p as usize] {
                return Err(format!("free page {p} is owned by block {id}"));
            }
        }
        for &s in &self.free_slots {
            if let Some(id) = slot_owner[s as usize] {
                return Err(format!("free slot {s} is owned by block {id}"));
            }
        }
        let owned = page_owner.iter().flatten().count();
        if owned + self.free_pages.len() != self.num_pages {
            return Err(format!(
                "pages leaked: {owned} owned + {} free != {}",
                self.free_pages.len(),
                self.num_pages
            ));
        }
        let owned = slot_owner.iter().flatten().count();
        if owned + self.free_slots.len() != self.num_slots {
            return Err(format!(
                "slots leaked: {owned} owned + {} free != {}",
                self.free_slots.len(),
                self.num_slots
            ));
        }
        Ok(())
    }
}
