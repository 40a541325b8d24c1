//! Block metadata, owned by the scheduler side: logical block ids (stable for a sequence's
//! life), which physical GPU page, host slot or disk slot each one occupies, reference
//! counts, the prefix cache, and the persisted prefix blocks of the disk tier (which
//! outlive the process). It never touches KV memory; the worker side does, through jobs.

use std::collections::{HashMap, VecDeque};

use thiserror::Error;

use super::block_key::BlockKey;
use super::cache_events::{BlockContent, CacheEvent, CacheEventLog, KvGroup, Medium};
use super::residency::{IllegalTransition, Move, Residency, Tier};

/// A block's identity, stable while any sequence refers to it.
pub type LogicalId = u32;
/// An index into the per-layer GPU page pool `[num_gpu_blocks, block_size, kv_heads, head_dim]`.
pub type PageId = u32;
/// An index into the host tier `[max_cpu_offload_blocks, block_size, kv_heads, head_dim]`.
pub type SlotId = u32;
/// An index into the disk tier's slot file (`serve::disk::store`).
pub type DiskSlotId = u32;

/// Where a block's KV is on the device: its page of the full-attention layers' pool and,
/// with a window pool, its page of the sliding-window layers' pool (`None` once no holder's
/// window reaches the block: those layers never read it again). Without a window pool
/// every layer uses `page` and `win` is `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuPages {
    pub page: PageId,
    pub win: Option<PageId>,
}

/// What one holder of a block holds: with a window pool, a holder whose sliding window
/// still reaches the block holds its windowed layers' KV too (`Windowed`); once the
/// window has moved past, the block alone (`BlockOnly`). Without a window pool every hold
/// is `Windowed` (and costs nothing more).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    Windowed,
    BlockOnly,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum BlockError {
    #[error("out of GPU pages: {need} needed, {free} free")]
    NoPages { need: usize, free: usize },
    #[error("out of host slots: {need} needed, {free} free")]
    NoSlots { need: usize, free: usize },
    #[error("out of disk slots: {need} needed, {free} free")]
    NoDiskSlots { need: usize, free: usize },
    #[error("unknown logical block {0}")]
    Unknown(LogicalId),
    #[error("block {id} is not resident on the GPU (it is {state:?})")]
    NotResident { id: LogicalId, state: Residency },
    #[error("block {0} has no references to release")]
    NotReferenced(LogicalId),
    #[error("block {0} has no windowed-layer KV to hold (no holder's window reached it)")]
    NoWindow(LogicalId),
    #[error("block {0} has no window reference to release")]
    NoWindowRef(LogicalId),
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
    /// Disk-tier slot (while spilled to disk, or loading from a persisted prefix copy).
    pub disk: Option<DiskSlotId>,
    /// The window pool's page (while on the device and `win`).
    pub win_page: Option<PageId>,
    /// Whether the block still has its windowed layers' KV (in `win_page` on the device,
    /// or in its lower-tier slot); dropped once no holder's window reaches it.
    pub win: bool,
    /// Holders whose window reaches the block (`Hold::Windowed`), at most `refs`.
    pub win_refs: u32,
    /// Content key (chained with the previous block's) once the block is full, computed,
    /// and registered in the prefix cache.
    pub hash: Option<BlockKey>,
    /// Its parent hash and tokens, kept with `hash` (for the events, and for the disk
    /// tier's index, which lets a restarted process announce what it restored).
    pub content: Option<BlockContent>,
    /// What the events last said of it on the GPU, so each change is told exactly once.
    pub announced: Announced,
}

/// Which of a block's groups the events have announced as cached on the GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Announced {
    pub full: bool,
    pub window: bool,
}

pub struct BlockManager {
    num_pages: usize,
    num_slots: usize,
    blocks: HashMap<LogicalId, Block>,
    next_id: LogicalId,
    free_pages: VecDeque<PageId>,
    free_slots: Vec<SlotId>,
    /// Prefix cache: hash → block. Only GPU-resident blocks are handed out on a hit.
    by_hash: HashMap<BlockKey, LogicalId>,
    /// Unreferenced but cached GPU blocks, least recently released first; their pages are
    /// reclaimed (and the cache entry dropped) when free pages run out.
    evictable: VecDeque<LogicalId>,
    disk: DiskSlots,
    /// The sliding-window layers' own page pool (`None`: every layer uses `pages`).
    win: Option<WindowPool>,
    /// Blocks entering and leaving the prefix cache, per tier (off unless enabled).
    events: CacheEventLog,
}

/// The sliding-window layers' pages: a block holds one while some holder's window reaches
/// it (vLLM's hybrid allocator frees a sliding-window group's blocks the same way). A
/// cached block whose window page no window reaches keeps it while the pool has room
/// (`idle`, least recently released first), so a later prefix hit ending there still finds
/// its window; the pool reclaims idle pages first.
struct WindowPool {
    num: usize,
    /// The layers' window in tokens (what their events say).
    window: usize,
    free: Vec<PageId>,
    idle: VecDeque<LogicalId>,
}

/// The free disk slots, kept lazily: memory grows with the slots in use, not with the
/// tier's capacity (a flag; the slot file may be terabytes). Slots at or past `fresh` were
/// never handed out and are free unless `taken` (adopted from the index out of order);
/// `returned` holds freed slots below `fresh`, reused first (last in, first out).
#[derive(Default)]
struct FreeSlots {
    num: usize,
    fresh: usize,
    returned: Vec<DiskSlotId>,
    taken: std::collections::HashSet<DiskSlotId>,
}

impl FreeSlots {
    fn new(num: usize) -> Self {
        // Slot ids are 32-bit: the flag's bound (`flags::MAX_BLOCKS`) keeps far below.
        assert!(num <= DiskSlotId::MAX as usize, "{num} disk slots");
        Self {
            num,
            ..Self::default()
        }
    }

    fn len(&self) -> usize {
        self.returned.len() + (self.num - self.fresh) - self.taken.len()
    }

    fn pop(&mut self) -> Option<DiskSlotId> {
        if let Some(s) = self.returned.pop() {
            return Some(s);
        }
        while self.fresh < self.num {
            let s = self.fresh as DiskSlotId;
            self.fresh += 1;
            if !self.taken.remove(&s) {
                return Some(s);
            }
        }
        None
    }

    fn push(&mut self, s: DiskSlotId) {
        self.returned.push(s);
    }

    /// Takes the free slot `s` out of the set; false if it is not free (or out of range).
    fn take(&mut self, s: DiskSlotId) -> bool {
        let i = s as usize;
        if i >= self.num {
            return false;
        }
        if i >= self.fresh {
            return self.taken.insert(s);
        }
        match self.returned.iter().position(|&r| r == s) {
            Some(pos) => {
                self.returned.swap_remove(pos);
                true
            }
            None => false,
        }
    }

    fn iter(&self) -> impl Iterator<Item = DiskSlotId> + '_ {
        let fresh = (self.fresh..self.num)
            .map(|s| s as DiskSlotId)
            .filter(|s| !self.taken.contains(s));
        self.returned.iter().copied().chain(fresh)
    }
}

/// A persisted prefix block, as the disk tier's index records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PersistedBlock {
    pub hash: BlockKey,
    pub slot: DiskSlotId,
    pub content: Option<BlockContent>,
}

/// A persisted copy: its slot and what it holds, where known (an index of an older format
/// has no contents): only copies with contents are announced, as a subscriber needs the
/// tokens.
struct Persisted {
    slot: DiskSlotId,
    content: Option<BlockContent>,
}

/// The disk tier's slots: free, spilled (owned by a block), being written through for the
/// prefix cache (pinned block), or persisted (a prefix block's durable copy, named in the
/// on-disk index and reusable after a restart).
#[derive(Default)]
struct DiskSlots {
    num: usize,
    free: FreeSlots,
    /// hash → slot (and content) of persisted prefix blocks, and slot → hash.
    persisted: HashMap<BlockKey, Persisted>,
    persisted_hash: HashMap<DiskSlotId, BlockKey>,
    /// Persisted hashes, least recently written or hit first (evicted first).
    lru: VecDeque<BlockKey>,
    /// Write-through jobs in flight: pinned block → (its hash, the reserved slot).
    persisting: HashMap<LogicalId, (BlockKey, DiskSlotId)>,
    /// The persisted set changed since the index was last written.
    changed: bool,
}

impl BlockManager {
    pub fn new(num_pages: usize, num_slots: usize) -> Self {
        Self::with_disk(num_pages, num_slots, 0)
    }

    /// As `new`, with a disk tier of `num_disk_slots` slots (0 = none).
    pub fn with_disk(num_pages: usize, num_slots: usize, num_disk_slots: usize) -> Self {
        Self {
            num_pages,
            num_slots,
            blocks: HashMap::new(),
            next_id: 0,
            free_pages: (0..num_pages as PageId).collect(),
            free_slots: (0..num_slots as SlotId).rev().collect(),
            by_hash: HashMap::new(),
            evictable: VecDeque::new(),
            disk: DiskSlots {
                num: num_disk_slots,
                free: FreeSlots::new(num_disk_slots),
                ..Default::default()
            },
            win: None,
            events: CacheEventLog::default(),
        }
    }

    /// Gives the sliding-window layers (of a `window`-token window) a pool of their own,
    /// `num` pages (the page past the last, `null_window_page`, is never handed out: a
    /// block table names it for blocks before a window, whose rows the kernels never read).
    pub fn with_window_pool(mut self, num: usize, window: usize) -> Self {
        assert!(num < PageId::MAX as usize, "{num} window pages");
        self.win = Some(WindowPool {
            num,
            window,
            free: (0..num as PageId).rev().collect(),
            idle: VecDeque::new(),
        });
        self
    }

    /// Pages of the window pool, if there is one.
    pub fn num_window_pages(&self) -> Option<usize> {
        self.win.as_ref().map(|w| w.num)
    }

    /// The window pool's table entry for a block before a sequence's window.
    pub fn null_window_page(&self) -> Option<PageId> {
        self.win.as_ref().map(|w| w.num as PageId)
    }

    /// Starts recording prefix-cache events (`take_cache_events`), first announcing what
    /// is cached already (the disk tier's blocks restored from an earlier process).
    pub fn record_cache_events(&mut self) {
        if self.events.is_on() {
            return;
        }
        self.events.enable();
        self.announce_persisted();
        let mut ids: Vec<LogicalId> = self.blocks.keys().copied().collect();
        ids.sort_unstable(); // allocation order: a chain's parents first
        for id in ids {
            self.sync_gpu_events(id);
        }
    }

    /// The prefix-cache events since the last call.
    pub fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        self.events.take()
    }

    /// Whether `id` is the block a prefix-cache lookup of its hash finds on the GPU.
    fn cached_on_gpu(&self, id: LogicalId) -> bool {
        self.blocks.get(&id).is_some_and(|b| {
            b.state == Residency::Gpu && b.hash.is_some_and(|h| self.by_hash.get(&h) == Some(&id))
        })
    }

    /// Tells the events what changed about `id` on the GPU since they last spoke of it:
    /// its full layers are announced while a lookup would hit it there, its windowed
    /// layers (with a window pool) while it also still holds its window page.
    fn sync_gpu_events(&mut self, id: LogicalId) {
        let Some(b) = self.blocks.get(&id) else {
            return;
        };
        let full = self.cached_on_gpu(id);
        let want = Announced {
            full,
            window: full && b.win_page.is_some(),
        };
        let window = KvGroup::Window {
            tokens: self.win.as_ref().map_or(0, |w| w.window),
        };
        let (was, hash) = (b.announced, b.hash);
        let Some(h) = hash.filter(|_| want != was) else {
            return;
        };
        if was.window && !want.window {
            self.events.removed(Medium::Gpu, window, h);
        }
        if was.full && !want.full {
            self.events.removed(Medium::Gpu, KvGroup::Full, h);
        }
        let b = self.blocks.get_mut(&id).expect("looked up above");
        b.announced = want;
        if let Some(c) = &b.content {
            if want.full && !was.full {
                self.events.stored(Medium::Gpu, KvGroup::Full, h, c);
            }
            if want.window && !was.window {
                self.events.stored(Medium::Gpu, window, h, c);
            }
        }
    }

    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// Blocks that can be handed out now: pages free or held only by the prefix cache (and
    /// as many window pages, free or idle, with a window pool).
    pub fn available_pages(&self) -> usize {
        let pages = self.free_pages.len() + self.evictable.len();
        match &self.win {
            Some(w) => pages.min(w.free.len() + w.idle.len()),
            None => pages,
        }
    }

    /// Whether loading `loads` back and allocating `new` blocks can get their pages now:
    /// a page each, and a window page for each new block and each load that brings its
    /// windowed layers' KV back.
    pub fn can_load_and_allocate(&self, loads: &[LogicalId], new: usize) -> bool {
        let wins = loads
            .iter()
            .filter(|id| self.blocks.get(id).is_some_and(|b| b.win))
            .count();
        self.free_pages.len() + self.evictable.len() >= loads.len() + new
            && self.available_window_pages() >= wins + new
    }

    /// Window pages that can be handed out now (free or idle); `usize::MAX` without a pool.
    fn available_window_pages(&self) -> usize {
        self.win
            .as_ref()
            .map_or(usize::MAX, |w| w.free.len() + w.idle.len())
    }

    pub fn free_slots(&self) -> usize {
        self.free_slots.len()
    }

    pub fn num_disk_slots(&self) -> usize {
        self.disk.num
    }

    /// Disk slots that are free (persisted prefix copies not counted).
    pub fn free_disk_slots(&self) -> usize {
        self.disk.free.len()
    }

    /// Disk slots a spill can get now: free ones plus persisted copies not being loaded.
    pub fn disk_room(&self) -> usize {
        self.disk.free.len()
            + self
                .disk
                .persisted
                .iter()
                .filter(|&(&h, p)| !self.borrowed(h, p.slot))
                .count()
    }

    /// Whether a block (being loaded from it) currently uses persisted slot `slot`.
    fn borrowed(&self, hash: BlockKey, slot: DiskSlotId) -> bool {
        self.by_hash
            .get(&hash)
            .and_then(|id| self.blocks.get(id))
            .is_some_and(|b| b.disk == Some(slot))
    }

    /// A disk slot for a spill: a free one, else the least recently used persisted copy's.
    fn take_disk_slot(&mut self) -> Option<DiskSlotId> {
        if let Some(s) = self.disk.free.pop() {
            return Some(s);
        }
        self.evict_persisted()
    }

    /// Drops the least recently used persisted copy that no block is loading; its slot.
    fn evict_persisted(&mut self) -> Option<DiskSlotId> {
        let pos = self.disk.lru.iter().position(|h| {
            let s = self.disk.persisted[h].slot;
            !self.borrowed(*h, s)
        })?;
        let h = self.disk.lru.remove(pos).expect("found");
        let p = self.disk.persisted.remove(&h).expect("lru names persisted");
        self.disk.persisted_hash.remove(&p.slot);
        self.disk.changed = true;
        if p.content.is_some() {
            self.events.removed(Medium::Disk, KvGroup::Full, h);
        }
        Some(p.slot)
    }

    /// Returns a block's disk slot, unless it is a persisted copy (which stays).
    fn free_disk_slot(&mut self, slot: DiskSlotId) {
        if !self.disk.persisted_hash.contains_key(&slot) {
            self.disk.free.push(slot);
        }
    }

    /// Blocks that can be handed out once the in-flight stores complete (their pages, and
    /// window pages, come free then).
    pub fn pages_after_stores(&self) -> usize {
        let storing = || {
            self.blocks
                .values()
                .filter(|b| matches!(b.state, Residency::MovingToCpu | Residency::MovingToSsd))
        };
        let pages = self.free_pages.len() + self.evictable.len() + storing().count();
        match &self.win {
            Some(w) => {
                let wins = storing().filter(|b| b.win_page.is_some()).count();
                pages.min(w.free.len() + w.idle.len() + wins)
            }
            None => pages,
        }
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

    /// The resolver: the physical pages of a GPU-resident block, and nothing else.
    pub fn resolve(&self, id: LogicalId) -> Result<GpuPages, BlockError> {
        let b = self.block(id)?;
        match (b.state, b.page) {
            (Residency::Gpu, Some(page)) => Ok(GpuPages {
                page,
                win: b.win_page,
            }),
            (state, _) => Err(BlockError::NotResident { id, state }),
        }
    }

    /// Whether a block's windowed layers' KV is on the device (always, without a window
    /// pool): a prefix hit may end only where every block its window reaches has it.
    pub fn has_window(&self, id: LogicalId) -> bool {
        self.win.is_none() || self.blocks.get(&id).is_some_and(|b| b.win_page.is_some())
    }

    /// Takes a page: a free one, else the least recently used cached block's.
    fn take_page(&mut self) -> Option<PageId> {
        if let Some(p) = self.free_pages.pop_front() {
            return Some(p);
        }
        let id = self.evictable.pop_front()?;
        self.drop_window(id);
        if let Some(h) = self.blocks[&id].hash {
            if self.by_hash.get(&h) == Some(&id) {
                self.by_hash.remove(&h);
            }
        }
        self.sync_gpu_events(id); // out of the cache: removed
        let b = self.blocks.remove(&id).expect("evictable blocks exist");
        b.page
    }

    /// Takes a window page (`None` without a pool): a free one, else the least recently
    /// idle block's, whose windowed layers' KV is then gone.
    fn take_window_page(&mut self) -> Option<PageId> {
        let w = self.win.as_mut()?;
        if let Some(p) = w.free.pop() {
            return Some(p);
        }
        let id = w.idle.pop_front().expect("counted by available_pages");
        let b = self.blocks.get_mut(&id).expect("idle blocks exist");
        b.win = false;
        let page = b.win_page.take();
        self.sync_gpu_events(id); // its windowed layers are no longer hittable
        page
    }

    /// Frees a block's window page, if it has one (idle or not); its windowed layers' KV
    /// is gone.
    fn drop_window(&mut self, id: LogicalId) {
        let Some(b) = self.blocks.get_mut(&id) else {
            return;
        };
        let page = b.win_page.take();
        b.win &= !b.state.holds_page(); // in a lower tier, the copy there stays valid
        if let (Some(w), Some(p)) = (self.win.as_mut(), page) {
            w.idle.retain(|&i| i != id);
            w.free.push(p);
        }
        self.sync_gpu_events(id);
    }

    /// The last window reference of `id` went: a cached block's window page idles (a later
    /// hit may want it), anyone else's is freed at once.
    fn window_unreferenced(&mut self, id: LogicalId) {
        let b = &self.blocks[&id];
        if !b.state.is_settled() {
            return; // a copy is in flight over its pages: `settled_window` decides after
        }
        if b.win_page.is_none() {
            // Off the device: its lower-tier copy need not come back with it.
            let b = self.blocks.get_mut(&id).expect("exists");
            b.win &= b.state.holds_page();
            return;
        }
        let cached = b.hash.is_some_and(|h| self.by_hash.get(&h) == Some(&id));
        if cached && b.state == Residency::Gpu {
            self.win.as_mut().expect("a window page").idle.push_back(id);
        } else {
            self.drop_window(id);
        }
    }

    /// After a copy over a block finished: a window page no holder references idles or
    /// goes (it was kept while the copy was in flight).
    fn settled_window(&mut self, id: LogicalId) {
        let idle = |w: &WindowPool| w.idle.contains(&id);
        let b = &self.blocks[&id];
        if b.win_refs == 0 && b.win_page.is_some() && !self.win.as_ref().is_some_and(idle) {
            self.window_unreferenced(id);
        }
    }

    /// New GPU blocks with one (windowed) reference each, all or nothing.
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
            let win_page = self.take_window_page();
            let id = self.next_id;
            self.next_id = self.next_id.wrapping_add(1);
            self.blocks.insert(
                id,
                Block {
                    refs: 1,
                    state: Residency::Gpu,
                    page: Some(page),
                    slot: None,
                    disk: None,
                    win_page,
                    win: true,
                    win_refs: 1,
                    hash: None,
                    content: None,
                    announced: Announced::default(),
                },
            );
            ids.push(id);
        }
        Ok(ids)
    }

    /// A prefix-cache hit: a GPU-resident block with this content hash.
    pub fn lookup(&self, hash: BlockKey) -> Option<LogicalId> {
        let id = *self.by_hash.get(&hash)?;
        (self.blocks.get(&id)?.state == Residency::Gpu).then_some(id)
    }

    /// Takes one more reference to an existing block (a prefix-cache hit); `Windowed`
    /// needs the block's windowed layers' KV to be there.
    pub fn acquire(&mut self, id: LogicalId, hold: Hold) -> Result<(), BlockError> {
        let windowed = hold == Hold::Windowed;
        let b = self.block_mut(id)?;
        if windowed && !b.win {
            return Err(BlockError::NoWindow(id));
        }
        b.refs += 1;
        if windowed {
            b.win_refs += 1;
        }
        let (first, first_win) = (b.refs == 1, windowed && b.win_refs == 1);
        if first {
            self.evictable.retain(|&e| e != id);
        }
        if let (true, Some(w)) = (first_win, self.win.as_mut()) {
            w.idle.retain(|&e| e != id);
        }
        Ok(())
    }

    /// Drops a holder's window reference (its window has moved past the block); it keeps
    /// the block (`Hold::BlockOnly` from now on).
    pub fn release_window(&mut self, id: LogicalId) -> Result<(), BlockError> {
        let b = self.block_mut(id)?;
        if b.win_refs == 0 {
            return Err(BlockError::NoWindowRef(id));
        }
        b.win_refs -= 1;
        if b.win_refs == 0 {
            self.window_unreferenced(id);
        }
        Ok(())
    }

    /// Registers a full, computed block under its content hash (first writer wins);
    /// `parent` is the previous block's hash and `tokens` the block's own, for the events.
    pub fn register(
        &mut self,
        id: LogicalId,
        hash: BlockKey,
        parent: Option<BlockKey>,
        tokens: &[u32],
    ) -> Result<(), BlockError> {
        let b = self.block_mut(id)?;
        if b.hash.is_some() {
            return Ok(());
        }
        b.hash = Some(hash);
        b.content = Some(BlockContent {
            parent,
            tokens: tokens.into(),
        });
        self.by_hash.entry(hash).or_insert(id);
        self.sync_gpu_events(id);
        Ok(())
    }

    /// Drops one reference, held as `hold`. The last one frees the block, except that a
    /// cached GPU block stays (evictable) so a later request with the same prefix can
    /// reuse it.
    pub fn release(&mut self, id: LogicalId, hold: Hold) -> Result<(), BlockError> {
        let b = self.block_mut(id)?;
        if b.refs == 0 {
            return Err(BlockError::NotReferenced(id));
        }
        if hold == Hold::Windowed && b.win_refs == 0 {
            return Err(BlockError::NoWindowRef(id));
        }
        if b.refs == 1 && !b.state.is_settled() {
            return Err(BlockError::ReleaseInFlight { id, state: b.state });
        }
        b.refs -= 1;
        if hold == Hold::Windowed {
            b.win_refs -= 1;
            if b.win_refs == 0 {
                self.window_unreferenced(id);
            }
        }
        let b = &self.blocks[&id];
        if b.refs > 0 {
            return Ok(());
        }
        let cached =
            b.state == Residency::Gpu && b.hash.is_some_and(|h| self.by_hash.get(&h) == Some(&id));
        if cached {
            self.evictable.push_back(id);
            return Ok(());
        }
        self.drop_window(id);
        let b = self.blocks.remove(&id).expect("looked up above");
        if let Some(h) = b.hash {
            if self.by_hash.get(&h) == Some(&id) {
                self.by_hash.remove(&h);
            }
        }
        self.free_pages.extend(b.page);
        self.free_slots.extend(b.slot);
        if let Some(d) = b.disk {
            self.free_disk_slot(d);
        }
        Ok(())
    }

    /// Frees whatever a block holds that its (new) state does not: the page after a store
    /// or a failed load, the lower-tier slot after a load or a failed store.
    fn settle(&mut self, id: LogicalId) -> Result<(), BlockError> {
        let b = self.block_mut(id)?;
        let state = b.state;
        let page = b.page.take_if(|_| !state.holds_page());
        let win_page = b.win_page.take_if(|_| !state.holds_page());
        let slot = b.slot.take_if(|_| !state.holds_host_slot());
        let disk = b.disk.take_if(|_| !state.holds_disk_slot());
        if let (Some(w), Some(p)) = (self.win.as_mut(), win_page) {
            w.free.push(p);
        }
        self.free_pages.extend(page);
        self.free_slots.extend(slot);
        if let Some(d) = disk {
            self.free_disk_slot(d);
        }
        Ok(())
    }

    /// Starts moving GPU blocks to `tier`: each gets a slot and keeps its page until the
    /// store completes, so the page cannot be handed out under the copy. All or nothing.
    pub fn start_store(
        &mut self,
        ids: &[LogicalId],
        tier: Tier,
    ) -> Result<Vec<(LogicalId, GpuPages, SlotId)>, BlockError> {
        let need = ids.len();
        match tier {
            Tier::Cpu if self.free_slots.len() < need => {
                return Err(BlockError::NoSlots {
                    need,
                    free: self.free_slots.len(),
                })
            }
            Tier::Ssd if self.disk_room() < need => {
                return Err(BlockError::NoDiskSlots {
                    need,
                    free: self.disk_room(),
                })
            }
            _ => {}
        }
        for &id in ids {
            self.block(id)?.state.apply(Move::StartStore(tier))?;
        }
        let mut out = Vec::with_capacity(ids.len());
        for &id in ids {
            if self.blocks[&id].win_refs == 0 {
                self.drop_window(id); // no window reaches it: not worth the copy
            }
            let slot = match tier {
                Tier::Cpu => self.free_slots.pop(),
                Tier::Ssd => self.take_disk_slot(),
            }
            .expect("counted above");
            let b = self.blocks.get_mut(&id).expect("checked above");
            b.state = b.state.apply(Move::StartStore(tier))?;
            match tier {
                Tier::Cpu => b.slot = Some(slot),
                Tier::Ssd => b.disk = Some(slot),
            }
            let page = b.page.expect("a GPU block has a page");
            out.push((
                id,
                GpuPages {
                    page,
                    win: b.win_page,
                },
                slot,
            ));
            self.sync_gpu_events(id); // moving off the GPU: no longer hittable there
        }
        Ok(out)
    }

    /// A store (or demotion) finished: on success the page (host slot) is released, only
    /// now; on failure the new slot is, and the block is back where it was, data untouched.
    pub fn finish_store(&mut self, id: LogicalId, ok: bool) -> Result<(), BlockError> {
        let b = self.block_mut(id)?;
        b.state = b.state.apply(if ok {
            Move::StoreDone
        } else {
            Move::StoreFailed
        })?;
        self.settle(id)?;
        self.settled_window(id);
        self.sync_gpu_events(id); // back on the GPU after a failed store
        Ok(())
    }

    /// Starts demoting host-resident blocks to the disk tier: each gets a disk slot and
    /// keeps its host slot until the write completes (so the slot cannot be handed out
    /// under the copy). All or nothing. Returns each block's (host slot, disk slot).
    pub fn start_demote(
        &mut self,
        ids: &[LogicalId],
    ) -> Result<Vec<(LogicalId, SlotId, DiskSlotId)>, BlockError> {
        if self.disk_room() < ids.len() {
            return Err(BlockError::NoDiskSlots {
                need: ids.len(),
                free: self.disk_room(),
            });
        }
        for &id in ids {
            self.block(id)?.state.apply(Move::Demote)?;
        }
        let mut out = Vec::with_capacity(ids.len());
        for &id in ids {
            let disk = self.take_disk_slot().expect("counted above");
            let b = self.blocks.get_mut(&id).expect("checked above");
            b.state = b.state.apply(Move::Demote)?;
            b.disk = Some(disk);
            out.push((id, b.slot.expect("a host-resident block has a slot"), disk));
        }
        Ok(out)
    }

    /// Host slots that will come free when in-flight demotions complete.
    pub fn slots_being_demoted(&self) -> usize {
        self.blocks
            .values()
            .filter(|b| b.state == Residency::MovingCpuToSsd)
            .count()
    }

    /// Starts loading lower-tier blocks back: each gets a reserved (new) page. All or
    /// nothing. Returns each block's lower-tier slot (host or disk, per its state) and page.
    pub fn start_load(
        &mut self,
        ids: &[LogicalId],
    ) -> Result<Vec<(LogicalId, SlotId, GpuPages)>, BlockError> {
        for &id in ids {
            self.block(id)?.state.apply(Move::StartLoad)?;
        }
        if !self.can_load_and_allocate(ids, 0) {
            return Err(BlockError::NoPages {
                need: ids.len(),
                free: self.available_pages(),
            });
        }
        let mut out = Vec::with_capacity(ids.len());
        for &id in ids {
            let page = self.take_page().expect("counted above");
            let win = if self.blocks[&id].win {
                self.take_window_page()
            } else {
                None
            };
            let b = self.blocks.get_mut(&id).expect("checked above");
            b.state = b.state.apply(Move::StartLoad)?;
            b.page = Some(page);
            b.win_page = win;
            let slot = b.slot.or(b.disk).expect("an offloaded block has a slot");
            out.push((id, slot, GpuPages { page, win }));
        }
        Ok(out)
    }

    /// A load finished: on success the slot is released and the block resolves to its new
    /// page; on failure the reserved page is released and the data stays in the lower tier.
    /// A persisted copy that failed to load is dropped from the persisted set: it is bad.
    pub fn finish_load(&mut self, id: LogicalId, ok: bool) -> Result<(), BlockError> {
        let b = self.block_mut(id)?;
        b.state = b
            .state
            .apply(if ok { Move::LoadDone } else { Move::LoadFailed })?;
        if let (false, Some(d)) = (ok, b.disk) {
            self.forget_persisted(d);
        }
        self.settle(id)?;
        self.settled_window(id);
        self.sync_gpu_events(id);
        Ok(())
    }

    // ---- the persisted prefix blocks of the disk tier ----

    /// Starts writing a registered GPU block through to disk for the prefix cache, if it
    /// is not persisted yet and a disk slot is free. Write-throughs never evict other
    /// persisted copies (evicting the head of a prefix chain for its tail would make the
    /// whole chain unreachable); spills reclaim persisted copies when they need room. The
    /// block is pinned (one more windowed reference) until `finish_persist`; a block whose
    /// windowed layers' KV is gone is not persisted (a hit on the copy must find it whole).
    pub fn start_persist(&mut self, id: LogicalId) -> Option<(GpuPages, DiskSlotId, BlockKey)> {
        let b = self.blocks.get(&id)?;
        let (Residency::Gpu, Some(page), Some(hash)) = (b.state, b.page, b.hash) else {
            return None;
        };
        if !b.win {
            return None;
        }
        let pages = GpuPages {
            page,
            win: b.win_page,
        };
        let d = &self.disk;
        if d.persisted.contains_key(&hash) || d.persisting.values().any(|&(h, _)| h == hash) {
            return None;
        }
        let slot = self.disk.free.pop()?;
        self.acquire(id, Hold::Windowed).ok()?;
        self.disk.persisting.insert(id, (hash, slot));
        Some((pages, slot, hash))
    }

    /// A write-through finished: the copy is persisted (and the index must be rewritten),
    /// or its slot is freed. Unpins the block.
    pub fn finish_persist(&mut self, id: LogicalId, ok: bool) -> Result<(), BlockError> {
        let (hash, slot) = self
            .disk
            .persisting
            .remove(&id)
            .ok_or(BlockError::NotReferenced(id))?;
        if ok && !self.disk.persisted.contains_key(&hash) {
            let content = self.blocks.get(&id).and_then(|b| b.content.clone());
            if let Some(c) = &content {
                self.events.stored(Medium::Disk, KvGroup::Full, hash, c);
            }
            self.disk
                .persisted
                .insert(hash, Persisted { slot, content });
            self.disk.persisted_hash.insert(slot, hash);
            self.disk.lru.push_back(hash);
            self.disk.changed = true;
        } else {
            self.disk.free.push(slot);
        }
        self.release(id, Hold::Windowed)
    }

    /// Whether the block is pinned by its write-through to disk.
    pub fn is_pinned(&self, id: LogicalId) -> bool {
        self.disk.persisting.contains_key(&id)
    }

    /// Whether the block is being loaded from a persisted prefix copy (not a spill).
    pub fn loads_persisted_copy(&self, id: LogicalId) -> bool {
        self.blocks.get(&id).is_some_and(|b| {
            b.state == Residency::MovingFromSsd
                && b.disk
                    .is_some_and(|d| self.disk.persisted_hash.contains_key(&d))
        })
    }

    /// Whether a lookup of `hash` can take a persisted copy: one is on disk and no block
    /// of this hash exists (one being copied back, say).
    pub fn persisted_hit(&self, hash: BlockKey) -> bool {
        !self.by_hash.contains_key(&hash) && self.disk.persisted.contains_key(&hash)
    }

    /// Whether a persisted copy of the block with this hash is on disk.
    pub fn is_persisted(&self, hash: BlockKey) -> bool {
        self.disk.persisted.contains_key(&hash)
    }

    /// A prefix-cache hit on disk: a new block with one reference, in the `Ssd` state over
    /// the persisted copy's slot (which it borrows: loading it back leaves the copy
    /// persisted). `None` if no copy, or if a block with this hash exists already.
    /// `parent` and `tokens` are as for `register`; with `Hold::BlockOnly` its windowed
    /// layers' KV is not loaded.
    pub fn acquire_persisted(
        &mut self,
        hash: BlockKey,
        parent: Option<BlockKey>,
        tokens: &[u32],
        hold: Hold,
    ) -> Option<LogicalId> {
        if self.by_hash.contains_key(&hash) {
            return None;
        }
        let slot = self.disk.persisted.get(&hash)?.slot;
        if let Some(pos) = self.disk.lru.iter().position(|&h| h == hash) {
            self.disk.lru.remove(pos);
            self.disk.lru.push_back(hash);
        }
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        self.blocks.insert(
            id,
            Block {
                refs: 1,
                state: Residency::Ssd,
                page: None,
                slot: None,
                disk: Some(slot),
                win_page: None,
                win: hold == Hold::Windowed,
                win_refs: u32::from(hold == Hold::Windowed),
                hash: Some(hash),
                content: Some(BlockContent {
                    parent,
                    tokens: tokens.into(),
                }),
                announced: Announced::default(),
            },
        );
        self.by_hash.insert(hash, id);
        Some(id)
    }

    /// Drops a persisted copy (it failed to load): it is never offered again.
    fn forget_persisted(&mut self, slot: DiskSlotId) {
        if let Some(h) = self.disk.persisted_hash.remove(&slot) {
            let p = self
                .disk
                .persisted
                .remove(&h)
                .expect("persisted_hash names persisted");
            self.disk.lru.retain(|&x| x != h);
            self.disk.changed = true;
            if p.content.is_some() {
                self.events.removed(Medium::Disk, KvGroup::Full, h);
            }
            if !self.blocks.values().any(|b| b.disk == Some(slot)) {
                self.disk.free.push(slot);
            }
        }
    }

    /// Takes over persisted copies from an earlier process's index, whose slots were
    /// already verified. Returns how many were adopted. The events announce them when a
    /// consumer starts recording (`record_cache_events`).
    pub fn adopt_persisted(&mut self, entries: &[PersistedBlock]) -> usize {
        let mut n = 0;
        for e in entries {
            if self.disk.persisted.contains_key(&e.hash) || !self.disk.free.take(e.slot) {
                continue; // out of range, named twice, or a hash seen already
            }
            let content = e.content.clone();
            self.disk.persisted.insert(
                e.hash,
                Persisted {
                    slot: e.slot,
                    content,
                },
            );
            self.disk.persisted_hash.insert(e.slot, e.hash);
            self.disk.lru.push_back(e.hash);
            n += 1;
        }
        n
    }

    /// The persisted set, if it changed since the last call.
    pub fn take_persisted_changes(&mut self) -> Option<Vec<PersistedBlock>> {
        if !std::mem::take(&mut self.disk.changed) {
            return None;
        }
        Some(
            self.disk
                .lru
                .iter()
                .map(|h| {
                    let p = &self.disk.persisted[h];
                    PersistedBlock {
                        hash: *h,
                        slot: p.slot,
                        content: p.content.clone(),
                    }
                })
                .collect(),
        )
    }

    /// Announces every persisted block whose content is known (oldest first, so parents
    /// come before their children).
    fn announce_persisted(&mut self) {
        for h in &self.disk.lru {
            if let Some(c) = &self.disk.persisted[h].content {
                self.events.stored(Medium::Disk, KvGroup::Full, *h, c);
            }
        }
    }

    /// Drops every cached block from the GPU (vLLM's prefix-cache reset), only when no
    /// block is held by anyone (no request has KV, no copy is in flight): false otherwise.
    /// Subscribers hear `AllBlocksCleared`, then the disk tier's blocks again (they stay).
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.blocks.values().any(|b| b.refs > 0) {
            return false;
        }
        for id in std::mem::take(&mut self.evictable) {
            let b = self.blocks.remove(&id).expect("evictable blocks exist");
            if let (Some(w), Some(p)) = (self.win.as_mut(), b.win_page) {
                w.free.push(p);
            }
            self.free_pages.extend(b.page);
        }
        debug_assert!(
            self.blocks.is_empty(),
            "unreferenced blocks are all evictable"
        );
        if let Some(w) = self.win.as_mut() {
            w.idle.clear();
        }
        self.by_hash.clear();
        self.events.cleared();
        self.announce_persisted();
        true
    }

    pub fn num_persisted(&self) -> usize {
        self.disk.persisted.len()
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
        for &id in self.disk.persisting.keys() {
            *refs.entry(id).or_default() += 1; // pinned by its write-through job
        }
        let mut page_owner = vec![None; self.num_pages];
        let mut slot_owner = vec![None; self.num_slots];
        let mut disk_owner: Vec<Option<String>> = vec![None; self.disk.num];
        for (&id, b) in &self.blocks {
            let want = refs.get(&id).copied().unwrap_or(0);
            if b.refs != want {
                return Err(format!("block {id}: {} refs, {want} holders", b.refs));
            }
            if b.refs == 0 && !self.evictable.contains(&id) {
                return Err(format!("block {id}: unreferenced but not evictable"));
            }
            if b.state.holds_page() != b.page.is_some()
                || b.state.holds_host_slot() != b.slot.is_some()
                || b.state.holds_disk_slot() != b.disk.is_some()
            {
                return Err(format!(
                    "block {id}: {:?} with {:?}/{:?}/{:?}",
                    b.state, b.page, b.slot, b.disk
                ));
            }
            if let Some(d) = b.disk {
                let o = disk_owner
                    .get_mut(d as usize)
                    .ok_or(format!("disk slot {d} out of range"))?;
                if let Some(other) = o.replace(format!("block {id}")) {
                    return Err(format!("disk slot {d} owned by {other} and block {id}"));
                }
            }
            if let Some(p) = b.page {
                claim(&mut page_owner, "page", p, id)?;
            }
            if let Some(s) = b.slot {
                claim(&mut slot_owner, "slot", s, id)?;
            }
        }
        for id in refs.keys() {
            if !self.blocks.contains_key(id) {
                return Err(format!("a sequence holds freed block {id}"));
            }
        }
        check_free(&page_owner, "page", &self.free_pages)?;
        check_free(&slot_owner, "slot", &self.free_slots)?;
        self.check_window()?;
        self.check_disk(disk_owner)
    }

    /// The window pool: each page free or owned by one block; a block on the device has
    /// one exactly while it keeps its windowed layers' KV (`win`); window references at
    /// most the references; the idle list is exactly the settled blocks with a page and no
    /// window reference.
    fn check_window(&self) -> Result<(), String> {
        let Some(w) = &self.win else {
            return match self.blocks.iter().find(|(_, b)| b.win_page.is_some()) {
                Some((id, _)) => Err(format!("block {id} has a window page and there is no pool")),
                None => Ok(()),
            };
        };
        let mut owner = vec![None; w.num];
        for (&id, b) in &self.blocks {
            if b.win_refs > b.refs {
                return Err(format!(
                    "block {id}: {} window refs > {} refs",
                    b.win_refs, b.refs
                ));
            }
            if b.win_refs > 0 && !b.win {
                return Err(format!("block {id}: window refs without its window KV"));
            }
            if b.state.holds_page() && b.win != b.win_page.is_some() {
                return Err(format!(
                    "block {id}: win {} with window page {:?}",
                    b.win, b.win_page
                ));
            }
            if !b.state.holds_page() && b.win_page.is_some() {
                return Err(format!("block {id}: {:?} with a window page", b.state));
            }
            let idle = b.win_page.is_some() && b.win_refs == 0 && b.state.is_settled();
            if idle != w.idle.contains(&id) {
                return Err(format!("block {id}: idle {idle} but listed {}", !idle));
            }
            if let Some(p) = b.win_page {
                claim(&mut owner, "window page", p, id)?;
            }
        }
        check_free(&owner, "window page", &w.free)
    }

    /// Disk slots: each one free, or owned by exactly one block, persisted copy or
    /// write-through job (a persisted copy may be borrowed by the one block of its hash).
    fn check_disk(&self, mut owner: Vec<Option<String>>) -> Result<(), String> {
        let d = &self.disk;
        if d.persisted.len() != d.persisted_hash.len() || d.persisted.len() != d.lru.len() {
            return Err("persisted maps disagree".into());
        }
        for (&h, p) in &d.persisted {
            let s = p.slot;
            if d.persisted_hash.get(&s) != Some(&h) {
                return Err(format!("persisted slot {s} maps back to another hash"));
            }
            let o = owner
                .get_mut(s as usize)
                .ok_or(format!("persisted slot {s} out of range"))?;
            if o.is_some() && !self.borrowed(h, s) {
                return Err(format!("persisted slot {s} also owned by {o:?}"));
            }
            *o = Some("persisted".into());
        }
        for (&id, &(_, s)) in &d.persisting {
            let o = owner
                .get_mut(s as usize)
                .ok_or(format!("write-through slot {s} out of range"))?;
            if let Some(other) = o.replace(format!("write-through of {id}")) {
                return Err(format!("write-through slot {s} also owned by {other}"));
            }
        }
        for s in d.free.iter() {
            match owner.get(s as usize) {
                Some(None) => {}
                Some(Some(o)) => return Err(format!("free disk slot {s} is owned by {o}")),
                None => return Err(format!("free disk slot {s} out of range")),
            }
        }
        let owned = owner.iter().flatten().count();
        if owned + d.free.len() != d.num {
            return Err(format!(
                "disk slots leaked: {owned} owned + {} free != {}",
                d.free.len(),
                d.num
            ));
        }
        Ok(())
    }
}

/// For `check`: entry `idx` of a pool (pages, host slots, window pages) claimed by block
/// `id`; an error if out of range or claimed already.
fn claim(
    owner: &mut [Option<LogicalId>],
    what: &str,
    idx: u32,
    id: LogicalId,
) -> Result<(), String> {
    let o = owner
        .get_mut(idx as usize)
        .ok_or(format!("{what} {idx} out of range"))?;
    match o.replace(id) {
        Some(other) => Err(format!("{what} {idx} owned by blocks {other} and {id}")),
        None => Ok(()),
    }
}

/// For `check`: a pool's free list against its owners: no free entry owned (or out of
/// range), none leaked (owned + free = all).
fn check_free<'a>(
    owner: &[Option<LogicalId>],
    what: &str,
    free: impl IntoIterator<Item = &'a u32>,
) -> Result<(), String> {
    let mut n = 0;
    for &i in free {
        if owner.get(i as usize).is_none_or(|o| o.is_some()) {
            return Err(format!("free {what} {i} is owned or out of range"));
        }
        n += 1;
    }
    let owned = owner.iter().flatten().count();
    if owned + n != owner.len() {
        return Err(format!(
            "{what}s leaked: {owned} owned + {n} free != {}",
            owner.len()
        ));
    }
    Ok(())
}
