//! The ring of per-layer device KV slots, as the host sees it. Layer `l` always uses slot
//! `l % num_slots`. The state machine says which uses may follow which, and which event
//! the next user of a slot must wait for: the host enqueues work ahead of the device, so
//! "free" means "free once that event completes", never "free now".

use anyhow::{bail, Result};

/// What the next user of a released slot must wait for before touching it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleasedAfter {
    /// Never used since the last reset.
    Nothing,
    /// Its last compute (decode attention read it) must finish: `slot_compute_done`.
    Compute,
    /// Its D2H offload (prefill wrote it, the offload reads it) must finish: `slot_offload_done`.
    Offload,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    Free(ReleasedAfter),
    /// An H2D prefetch of `layer` is queued (decode); ready at `slot_ready`.
    Loading {
        layer: usize,
    },
    /// `layer`'s compute is queued on it.
    Computing {
        layer: usize,
        prefill: bool,
    },
}

pub struct Ring {
    slots: Vec<SlotState>,
}

impl Ring {
    pub fn new(num_slots: usize) -> Self {
        Self {
            slots: vec![SlotState::Free(ReleasedAfter::Nothing); num_slots],
        }
    }

    pub fn num_slots(&self) -> usize {
        self.slots.len()
    }

    pub fn slot_of(&self, layer: usize) -> usize {
        layer % self.slots.len()
    }

    pub fn state(&self, slot: usize) -> SlotState {
        self.slots[slot]
    }

    /// Forget all uses (a new request, after every stream was synchronized).
    pub fn reset(&mut self) {
        self.slots.fill(SlotState::Free(ReleasedAfter::Nothing));
    }

    fn take_free(&mut self, layer: usize, what: &str) -> Result<(usize, ReleasedAfter)> {
        let s = self.slot_of(layer);
        match self.slots[s] {
            SlotState::Free(after) => Ok((s, after)),
            other => bail!("ring slot {s}: cannot {what} layer {layer} while {other:?}"),
        }
    }

    /// Decode: queue the H2D of `layer` into its slot. Returns the slot and what the copy must wait for.
    pub fn begin_load(&mut self, layer: usize) -> Result<(usize, ReleasedAfter)> {
        let (s, after) = self.take_free(layer, "load")?;
        self.slots[s] = SlotState::Loading { layer };
        Ok((s, after))
    }

    /// Decode: `layer`'s compute starts on the slot its prefetch filled (wait `slot_ready`).
    pub fn begin_decode_compute(&mut self, layer: usize) -> Result<usize> {
        let s = self.slot_of(layer);
        match self.slots[s] {
            SlotState::Loading { layer: l } if l == layer => {
                self.slots[s] = SlotState::Computing { layer, prefill: false };
                Ok(s)
            }
            other => bail!("ring slot {s}: decode compute of layer {layer} needs its prefetch, found {other:?}"),
        }
    }

    /// Prefill: `layer`'s compute writes fresh KV into its slot. Returns the slot and what
    /// the compute must wait for (the previous user's offload or compute).
    pub fn begin_prefill_compute(&mut self, layer: usize) -> Result<(usize, ReleasedAfter)> {
        let (s, after) = self.take_free(layer, "prefill")?;
        self.slots[s] = SlotState::Computing {
            layer,
            prefill: true,
        };
        Ok((s, after))
    }

    /// `layer`'s compute is queued in full; prefill slots are released behind their
    /// offload, decode slots behind their compute.
    pub fn end_compute(&mut self, layer: usize) -> Result<usize> {
        let s = self.slot_of(layer);
        match self.slots[s] {
            SlotState::Computing { layer: l, prefill } if l == layer => {
                let after = if prefill {
                    ReleasedAfter::Offload
                } else {
                    ReleasedAfter::Compute
                };
                self.slots[s] = SlotState::Free(after);
                Ok(s)
            }
            other => bail!("ring slot {s}: end of layer {layer} but the slot is {other:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ReleasedAfter::*;

    #[test]
    fn decode_cycle_load_compute_release() {
        let mut r = Ring::new(2);
        assert_eq!(r.begin_load(0).unwrap(), (0, Nothing));
        assert_eq!(r.begin_load(1).unwrap(), (1, Nothing));
        assert_eq!(r.begin_decode_compute(0).unwrap(), 0);
        assert_eq!(r.end_compute(0).unwrap(), 0);
        // Layer 2 reuses slot 0: its H2D must wait for layer 0's compute to be done.
        assert_eq!(r.begin_load(2).unwrap(), (0, Compute));
    }

    #[test]
    fn prefill_reuse_waits_for_the_offload() {
        let mut r = Ring::new(3);
        for l in 0..3 {
            assert_eq!(r.begin_prefill_compute(l).unwrap(), (l, Nothing));
            r.end_compute(l).unwrap();
        }
        // Layer 3 overwrites slot 0: it must wait for layer 0's D2H offload.
        assert_eq!(r.begin_prefill_compute(3).unwrap(), (0, Offload));
        r.end_compute(3).unwrap();
        // Decode after prefill: a prefetch into slot 1 waits for layer 1's offload too.
        assert_eq!(r.begin_load(1).unwrap(), (1, Offload));
    }

    #[test]
    fn illegal_transitions_are_errors() {
        let mut r = Ring::new(2);
        // Compute without a prefetch.
        assert!(r.begin_decode_compute(0).is_err());
        // Ending a layer that never started.
        assert!(r.end_compute(0).is_err());
        r.begin_load(0).unwrap();
        // Loading twice into a slot whose load has not been consumed.
        assert!(r.begin_load(2).is_err());
        // Prefill into a slot still being loaded.
        assert!(r.begin_prefill_compute(0).is_err());
        // Computing a different layer than the one loaded.
        assert!(r.begin_decode_compute(2).is_err());
        r.begin_decode_compute(0).unwrap();
        // A load into a slot whose compute is still being queued.
        assert!(r.begin_load(2).is_err());
        // Ending the wrong layer.
        assert!(r.end_compute(2).is_err());
        r.end_compute(0).unwrap();
        r.reset();
        assert_eq!(r.state(0), SlotState::Free(Nothing));
    }
}
