//! What enters and leaves the prefix cache, per tier: the source of the KV-cache events a
//! router reads to send each request to the instance that holds its prefix
//! (`server::kv_events` publishes them in vLLM's wire format, docs/distributed.md).
//!
//! The block manager records them, only once a consumer has asked (`enable`): a block is
//! *announced* on a tier exactly while a new request could hit it there, so a router's view
//! equals what `Scheduler::prefix_lookup` would find.

use super::block_key::BlockKey;

/// A tier of cached blocks, named as vLLM's events name it. The host tier never appears:
/// it holds preempted requests' own blocks, which no other request can hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Medium {
    /// GPU pages (the CPU device's "device" pages too): the prefix cache proper.
    Gpu,
    /// Persisted prefix copies of the disk tier (`docs/disk.md`).
    Disk,
}

impl Medium {
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Disk => "DISK",
        }
    }
}

/// Which layers' KV an event speaks of, as vLLM's KV-cache groups do: the full-attention
/// layers (every model) and, for a model with a window pool, the sliding-window layers,
/// whose KV of a block may be gone while the full layers' stays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvGroup {
    /// Group 0: the full-attention layers (all layers of a model without windows).
    Full,
    /// Group 1: the sliding-window layers (their own page pool, `docs/serving.md`), of a
    /// `tokens`-token window.
    Window { tokens: usize },
}

/// What a full block holds, kept while events are recorded so it can be announced again
/// after it comes back (a failed store, a load, a write-through to disk).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockContent {
    /// The chained hash of the block before it (`None` for a prompt's first block).
    pub parent: Option<BlockKey>,
    pub tokens: Box<[u32]>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// Blocks that became hittable on `medium`, in chain order: `hashes[0]`'s parent is
    /// `parent`, each next one's parent is the one before. `tokens` holds every block's
    /// tokens, one full block after another.
    Stored {
        medium: Medium,
        group: KvGroup,
        parent: Option<BlockKey>,
        hashes: Vec<BlockKey>,
        tokens: Vec<u32>,
    },
    /// Blocks no longer hittable on `medium`.
    Removed {
        medium: Medium,
        group: KvGroup,
        hashes: Vec<BlockKey>,
    },
    /// Everything on the GPU is gone (the engine stopped, or the prefix cache was reset).
    Cleared,
}

/// The events since the consumer last took them. Consecutive events of one kind on one
/// tier are merged (a prompt's new blocks become one `Stored`, as vLLM sends them).
#[derive(Debug, Default)]
pub struct CacheEventLog {
    on: bool,
    events: Vec<CacheEvent>,
}

impl CacheEventLog {
    pub fn enable(&mut self) {
        self.on = true;
    }

    pub fn is_on(&self) -> bool {
        self.on
    }

    pub fn stored(
        &mut self,
        medium: Medium,
        group: KvGroup,
        hash: BlockKey,
        content: &BlockContent,
    ) {
        if !self.on {
            return;
        }
        if let Some(CacheEvent::Stored {
            medium: m,
            group: g,
            hashes,
            tokens,
            ..
        }) = self.events.last_mut()
        {
            if (*m, *g) == (medium, group)
                && content.parent.is_some()
                && hashes.last() == content.parent.as_ref()
            {
                hashes.push(hash);
                tokens.extend_from_slice(&content.tokens);
                return;
            }
        }
        self.events.push(CacheEvent::Stored {
            medium,
            group,
            parent: content.parent,
            hashes: vec![hash],
            tokens: content.tokens.to_vec(),
        });
    }

    pub fn removed(&mut self, medium: Medium, group: KvGroup, hash: BlockKey) {
        if !self.on {
            return;
        }
        if let Some(CacheEvent::Removed {
            medium: m,
            group: g,
            hashes,
        }) = self.events.last_mut()
        {
            if (*m, *g) == (medium, group) {
                hashes.push(hash);
                return;
            }
        }
        self.events.push(CacheEvent::Removed {
            medium,
            group,
            hashes: vec![hash],
        });
    }

    /// Everything on the GPU is gone: what was recorded before no longer matters.
    pub fn cleared(&mut self) {
        if self.on {
            self.events.push(CacheEvent::Cleared);
        }
    }

    pub fn take(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in key.
    fn k(n: u8) -> BlockKey {
        BlockKey::from_bytes([n; 32])
    }

    fn content(parent: Option<BlockKey>, t: u32) -> BlockContent {
        BlockContent {
            parent,
            tokens: vec![t, t].into(),
        }
    }

    #[test]
    fn nothing_is_recorded_until_a_consumer_enables_the_log() {
        let mut log = CacheEventLog::default();
        log.stored(Medium::Gpu, KvGroup::Full, k(1), &content(None, 5));
        log.removed(Medium::Gpu, KvGroup::Full, k(1));
        log.cleared();
        assert!(log.take().is_empty());
    }

    #[test]
    fn a_chain_merges_into_one_stored_event_and_a_break_starts_another() {
        let mut log = CacheEventLog::default();
        log.enable();
        let (gpu, disk, full, win) = (
            Medium::Gpu,
            Medium::Disk,
            KvGroup::Full,
            KvGroup::Window { tokens: 4 },
        );
        log.stored(gpu, full, k(1), &content(None, 5));
        log.stored(gpu, full, k(2), &content(Some(k(1)), 6));
        log.stored(gpu, win, k(2), &content(Some(k(1)), 6)); // another group
        log.stored(disk, full, k(3), &content(Some(k(2)), 7)); // another tier
        log.stored(gpu, full, k(9), &content(Some(k(8)), 1)); // not the last one's child
        log.removed(gpu, full, k(1));
        log.removed(gpu, full, k(2));
        log.removed(gpu, win, k(2));
        log.removed(disk, full, k(3));
        let stored = |medium, group, parent, hashes, tokens| CacheEvent::Stored {
            medium,
            group,
            parent,
            hashes,
            tokens,
        };
        let removed = |medium, group, hashes| CacheEvent::Removed {
            medium,
            group,
            hashes,
        };
        let want = vec![
            stored(gpu, full, None, vec![k(1), k(2)], vec![5, 5, 6, 6]),
            stored(gpu, win, Some(k(1)), vec![k(2)], vec![6, 6]),
            stored(disk, full, Some(k(2)), vec![k(3)], vec![7, 7]),
            stored(gpu, full, Some(k(8)), vec![k(9)], vec![1, 1]),
            removed(gpu, full, vec![k(1), k(2)]),
            removed(gpu, win, vec![k(2)]),
            removed(disk, full, vec![k(3)]),
        ];
        assert_eq!(log.take(), want);
        assert!(log.take().is_empty());
    }
}
