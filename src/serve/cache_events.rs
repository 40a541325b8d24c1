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
        parent: Option<BlockKey>,
        hashes: Vec<BlockKey>,
        tokens: Vec<u32>,
    },
    /// Blocks no longer hittable on `medium`.
    Removed {
        medium: Medium,
        hashes: Vec<BlockKey>,
    },
    /// Everything on the GPU is gone (the engine stopped).
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

    pub fn stored(&mut self, medium: Medium, hash: BlockKey, content: &BlockContent) {
        if !self.on {
            return;
        }
        if let Some(CacheEvent::Stored {
            medium: m,
            hashes,
            tokens,
            ..
        }) = self.events.last_mut()
        {
            if *m == medium && content.parent.is_some() && hashes.last() == content.parent.as_ref()
            {
                hashes.push(hash);
                tokens.extend_from_slice(&content.tokens);
                return;
            }
        }
        self.events.push(CacheEvent::Stored {
            medium,
            parent: content.parent,
            hashes: vec![hash],
            tokens: content.tokens.to_vec(),
        });
    }

    pub fn removed(&mut self, medium: Medium, hash: BlockKey) {
        if !self.on {
            return;
        }
        if let Some(CacheEvent::Removed { medium: m, hashes }) = self.events.last_mut() {
            if *m == medium {
                hashes.push(hash);
                return;
            }
        }
        self.events.push(CacheEvent::Removed {
            medium,
            hashes: vec![hash],
        });
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
        log.stored(Medium::Gpu, k(1), &content(None, 5));
        log.removed(Medium::Gpu, k(1));
        assert!(log.take().is_empty());
    }

    #[test]
    fn a_chain_merges_into_one_stored_event_and_a_break_starts_another() {
        let mut log = CacheEventLog::default();
        log.enable();
        log.stored(Medium::Gpu, k(1), &content(None, 5));
        log.stored(Medium::Gpu, k(2), &content(Some(k(1)), 6));
        log.stored(Medium::Disk, k(3), &content(Some(k(2)), 7)); // another tier
        log.stored(Medium::Gpu, k(9), &content(Some(k(8)), 1)); // not the last one's child
        log.removed(Medium::Gpu, k(1));
        log.removed(Medium::Gpu, k(2));
        log.removed(Medium::Disk, k(3));
        let want = vec![
            CacheEvent::Stored {
                medium: Medium::Gpu,
                parent: None,
                hashes: vec![k(1), k(2)],
                tokens: vec![5, 5, 6, 6],
            },
            CacheEvent::Stored {
                medium: Medium::Disk,
                parent: Some(k(2)),
                hashes: vec![k(3)],
                tokens: vec![7, 7],
            },
            CacheEvent::Stored {
                medium: Medium::Gpu,
                parent: Some(k(8)),
                hashes: vec![k(9)],
                tokens: vec![1, 1],
            },
            CacheEvent::Removed {
                medium: Medium::Gpu,
                hashes: vec![k(1), k(2)],
            },
            CacheEvent::Removed {
                medium: Medium::Disk,
                hashes: vec![k(3)],
            },
        ];
        assert_eq!(log.take(), want);
        assert!(log.take().is_empty());
    }
}
