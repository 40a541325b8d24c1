//! `--kv-events-replay-endpoint`: the last published batches, kept for a subscriber that
//! missed some (it joined late, or its connection dropped), served on a ZMQ ROUTER socket
//! as vLLM's `ZmqEventPublisher` serves its `replay_endpoint`:
//!
//! - a requester (DEALER) sends `[b"", start]`, `start` the first sequence number it
//!   wants (big-endian, vLLM's `int.from_bytes(.., "big")`: up to 8 bytes);
//! - the socket answers one message `[b"", topic, seq (u64 BE), payload]` per kept batch
//!   whose sequence number is `start` or later, oldest first — the very frames the PUB
//!   socket sent — then the end marker `[b"", b"", -1 (i64 BE), b""]`;
//! - a request of any other shape is ignored, as vLLM ignores it.
//!
//! What is kept is bounded twice: the last `--kv-events-replay-buffer` batches (vLLM's
//! `buffer_steps`, default 10,000) and `MAX_BYTES` in all, the oldest dropped first. A
//! requester is answered one request at a time and only as fast as it reads, so no peer
//! makes the server hold more than this buffer.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use super::zmtp;

/// Batches kept unless `--kv-events-replay-buffer` says otherwise (vLLM's default).
pub const DEFAULT_BATCHES: usize = 10_000;
/// Bytes kept at most, whatever the batch count.
pub const MAX_BYTES: usize = 64 << 20;

/// The kept batches, each framed once as the reply message it becomes.
pub struct ReplayBuffer {
    max_batches: usize,
    max_bytes: usize,
    kept: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    /// `(sequence number, framed reply)`, oldest first.
    batches: VecDeque<(u64, Arc<Vec<u8>>)>,
    bytes: usize,
}

impl ReplayBuffer {
    pub fn new(max_batches: usize, max_bytes: usize) -> Self {
        Self {
            max_batches: max_batches.max(1),
            max_bytes,
            kept: Mutex::default(),
        }
    }

    /// Keeps the batch published as `[topic, seq, payload]`, dropping the oldest past
    /// either bound (a batch larger than `max_bytes` alone is not kept at all).
    pub fn push(&self, seq: u64, topic: &[u8], payload: &[u8]) {
        let reply = zmtp::message(&[b"", topic, &seq.to_be_bytes(), payload]);
        let mut kept = self.kept.lock().expect("not poisoned");
        kept.bytes += reply.len();
        kept.batches.push_back((seq, Arc::new(reply)));
        while kept.batches.len() > self.max_batches || kept.bytes > self.max_bytes {
            let Some((_, old)) = kept.batches.pop_front() else {
                break;
            };
            kept.bytes -= old.len();
        }
    }

    /// The framed replies of every kept batch numbered `start` or later, oldest first.
    pub fn since(&self, start: u64) -> Vec<Arc<Vec<u8>>> {
        let kept = self.kept.lock().expect("not poisoned");
        let first = kept.batches.partition_point(|(seq, _)| *seq < start);
        kept.batches
            .range(first..)
            .map(|(_, r)| Arc::clone(r))
            .collect()
    }
}

/// The message that ends every answer: `[b"", b"", -1 (i64 BE), b""]`.
pub fn end_marker() -> Vec<u8> {
    zmtp::message(&[b"", b"", &(-1i64).to_be_bytes(), b""])
}

/// The start of a replay request `[b"", start]`, or `None` for any other message.
pub fn requested_start(frames: &[Vec<u8>]) -> Option<u64> {
    match frames {
        [empty, start] if empty.is_empty() && start.len() <= 8 => {
            Some(start.iter().fold(0u64, |n, &b| (n << 8) | u64::from(b)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_the_kept_batches_from_start_framed_as_vllm_sends_them() {
        let buffer = ReplayBuffer::new(10, MAX_BYTES);
        for seq in 0..4u64 {
            buffer.push(seq, b"kv", &[seq as u8; 3]);
        }
        let replies = buffer.since(2);
        assert_eq!(replies.len(), 2);
        assert_eq!(
            *replies[0],
            zmtp::message(&[b"", b"kv", &2u64.to_be_bytes(), &[2, 2, 2]])
        );
        assert_eq!(buffer.since(0).len(), 4);
        assert!(buffer.since(9).is_empty());
        assert_eq!(
            end_marker(),
            zmtp::message(&[b"", b"", &[0xFF; 8], b""]),
            "-1 as a signed 64-bit big-endian integer"
        );
    }

    #[test]
    fn the_buffer_keeps_the_newest_batches_within_both_bounds() {
        let by_count = ReplayBuffer::new(3, MAX_BYTES);
        for seq in 0..10 {
            by_count.push(seq, b"", b"payload");
        }
        assert_eq!(by_count.since(0).len(), 3);
        assert_eq!(by_count.since(0)[0], by_count.since(7)[0]);
        // Each reply is 4 frames: 2-byte headers + 8 (seq) + 100 (payload) = 116 bytes.
        let by_bytes = ReplayBuffer::new(100, 300);
        for seq in 0..10 {
            by_bytes.push(seq, b"", &[0; 100]);
        }
        assert_eq!(by_bytes.since(0).len(), 2);
        assert_eq!(by_bytes.since(8).len(), 2);
        by_bytes.push(10, b"", &[0; 1000]);
        assert!(
            by_bytes.since(0).is_empty(),
            "too large to keep: nothing is"
        );
    }

    #[test]
    fn a_request_is_an_empty_frame_then_a_big_endian_start() {
        assert_eq!(
            requested_start(&[vec![], 5u64.to_be_bytes().to_vec()]),
            Some(5)
        );
        assert_eq!(requested_start(&[vec![], vec![1, 0]]), Some(256));
        assert_eq!(requested_start(&[vec![], vec![]]), Some(0));
        for bad in [
            vec![5u64.to_be_bytes().to_vec()],
            vec![vec![1], vec![5]],
            vec![vec![], vec![0; 9]],
            vec![vec![], vec![5], vec![]],
        ] {
            assert_eq!(requested_start(&bad), None, "{bad:?}");
        }
    }
}
