//! The ring of per-layer device KV slots, as the host sees it. Layer visits take slots in
//! turn across steps: the `v`-th layer computed since the reset uses slot `v % num_slots`,
//! so a decode step's first layers can be prefetched while the previous step's last
//! layers still compute. The state machine says which uses may follow which, and which
//! event the next user of a slot must wait for: the host enqueues work ahead of the
//! device, so "free" means "free once that event completes", never "free now".

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
    /// `layer`'s compute is queued on it; `offloads`: it writes new rows that an offload
    /// stream then copies out of the slot (prefill, and a decode step's extension).
    Computing {
        layer: usize,
        offloads: bool,
    },
}

pub struct Ring {
    slots: Vec<SlotState>,
    /// Slot of layer 0 in the current step.
    base: usize,
    num_layers: usize,
}

impl Ring {
    pub fn new(num_slots: usize, num_layers: usize) -> Self {
        Self {
            slots: vec![SlotState::Free(ReleasedAfter::Nothing); num_slots],
            base: 0,
            num_layers,
        }
    }

    /// The step is over: the next step's layer 0 takes the slot after this step's last layer.
    pub fn advance(&mut self) {
        self.base = (self.base + self.num_layers) % self.slots.len();
    }

    pub fn num_slots(&self) -> usize {
        self.slots.len()
    }

    /// Slot of `layer` in the current step.
    pub fn slot_of(&self, layer: usize) -> usize {
        (self.base + layer) % self.slots.len()
    }

    /// Slot of `layer` in the next step.
    pub fn next_step_slot_of(&self, layer: usize) -> usize {
        (self.base + self.num_layers + layer) % self.slots.len()
    }

    pub fn state(&self, slot: usize) -> SlotState {
        self.slots[slot]
    }

    /// Forget all uses (a new request, after every stream was synchronized).
    pub fn reset(&mut self) {
        self.slots.fill(SlotState::Free(ReleasedAfter::Nothing));
        self.base = 0;
    }

    fn take_free(&mut self, s: usize, layer: usize, what: &str) -> Result<(usize, ReleasedAfter)> {
        match self.slots[s] {
            SlotState::Free(after) => Ok((s, after)),
            other => bail!("ring slot {s}: cannot {what} layer {layer} while {other:?}"),
        }
    }

    /// Decode: queue the H2D of `layer` into its slot (this step's, or the next step's when
    /// `next_step`). Returns the slot and what the copy must wait for.
    pub fn begin_load(&mut self, layer: usize, next_step: bool) -> Result<(usize, ReleasedAfter)> {
        let s = if next_step {
            self.next_step_slot_of(layer)
        } else {
            self.slot_of(layer)
        };
        let (s, after) = self.take_free(s, layer, "load")?;
        self.slots[s] = SlotState::Loading { layer };
        Ok((s, after))
    }

    /// Decode: `layer`'s compute starts on the slot its prefetch filled (wait `slot_ready`);
    /// `offloads` when the step's new rows are copied out of the slot afterwards (several
    /// tokens after a stored context: `OffloadEngine`'s extension).
    pub fn begin_decode_compute(&mut self, layer: usize, offloads: bool) -> Result<usize> {
        let s = self.slot_of(layer);
        match self.slots[s] {
            SlotState::Loading { layer: l } if l == layer => {
                self.slots[s] = SlotState::Computing { layer, offloads };
                Ok(s)
            }
            other => bail!("ring slot {s}: decode compute of layer {layer} needs its prefetch, found {other:?}"),
        }
    }

    /// Prefill: `layer`'s compute writes fresh KV into its slot. Returns the slot and what
    /// the compute must wait for (the previous user's offload or compute).
    pub fn begin_prefill_compute(&mut self, layer: usize) -> Result<(usize, ReleasedAfter)> {
        let (s, after) = self.take_free(self.slot_of(layer), layer, "prefill")?;
        self.slots[s] = SlotState::Computing {
            layer,
            offloads: true,
        };
        Ok((s, after))
    }

    /// `layer`'s compute is queued in full; slots whose rows are offloaded are released
    /// behind their offload, the others behind their compute.
    pub fn end_compute(&mut self, layer: usize) -> Result<usize> {
        let s = self.slot_of(layer);
        match self.slots[s] {
            SlotState::Computing { layer: l, offloads } if l == layer => {
                let after = if offloads {
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
        let mut r = Ring::new(2, 4);
        assert_eq!(r.begin_load(0, false).unwrap(), (0, Nothing));
        assert_eq!(r.begin_load(1, false).unwrap(), (1, Nothing));
        assert_eq!(r.begin_decode_compute(0, false).unwrap(), 0);
        assert_eq!(r.end_compute(0).unwrap(), 0);
        // Layer 2 reuses slot 0: its H2D must wait for layer 0's compute to be done.
        assert_eq!(r.begin_load(2, false).unwrap(), (0, Compute));
    }

    #[test]
    fn the_next_step_is_prefetched_into_the_slots_that_follow() {
        // 3 layers, 2 slots: step 0 uses slots 0 1 0, step 1 starts at slot 1.
        let mut r = Ring::new(2, 3);
        r.begin_load(0, false).unwrap();
        for l in 0..3 {
            assert_eq!(r.begin_decode_compute(l, false).unwrap(), l % 2);
            r.end_compute(l).unwrap();
            if l + 1 < 3 {
                r.begin_load(l + 1, false).unwrap();
            } else {
                // After the last layer: the next step's layer 0, into slot 1.
                assert_eq!(r.begin_load(0, true).unwrap(), (1, Compute));
            }
        }
        r.advance();
        assert_eq!(r.slot_of(0), 1);
        assert_eq!(
            r.begin_decode_compute(0, false).unwrap(),
            1,
            "the prefetched slot is the one computed on"
        );
    }

    #[test]
    fn prefill_reuse_waits_for_the_offload() {
        let mut r = Ring::new(3, 4);
        for l in 0..3 {
            assert_eq!(r.begin_prefill_compute(l).unwrap(), (l, Nothing));
            r.end_compute(l).unwrap();
        }
        // Layer 3 overwrites slot 0: it must wait for layer 0's D2H offload.
        assert_eq!(r.begin_prefill_compute(3).unwrap(), (0, Offload));
        r.end_compute(3).unwrap();
        // Decode after prefill: a prefetch into slot 1 waits for layer 1's offload too.
        assert_eq!(r.begin_load(1, false).unwrap(), (1, Offload));
    }

    #[test]
    fn a_prefetched_slot_whose_rows_are_offloaded_is_released_behind_the_offload() {
        let mut r = Ring::new(2, 4);
        r.begin_load(0, false).unwrap();
        assert_eq!(r.begin_decode_compute(0, true).unwrap(), 0);
        r.end_compute(0).unwrap();
        assert_eq!(r.state(0), SlotState::Free(Offload));
        assert_eq!(r.begin_load(2, false).unwrap(), (0, Offload));
    }

    #[test]
    fn illegal_transitions_are_errors() {
        let mut r = Ring::new(2, 4);
        // Compute without a prefetch.
        assert!(r.begin_decode_compute(0, false).is_err());
        // Ending a layer that never started.
        assert!(r.end_compute(0).is_err());
        r.begin_load(0, false).unwrap();
        // Loading twice into a slot whose load has not been consumed.
        assert!(r.begin_load(2, false).is_err());
        // Prefill into a slot still being loaded.
        assert!(r.begin_prefill_compute(0).is_err());
        // Computing a different layer than the one loaded.
        assert!(r.begin_decode_compute(2, false).is_err());
        r.begin_decode_compute(0, false).unwrap();
        // A load into a slot whose compute is still being queued.
        assert!(r.begin_load(2, false).is_err());
        // Ending the wrong layer.
        assert!(r.end_compute(2).is_err());
        r.end_compute(0).unwrap();
        r.reset();
        assert_eq!(r.state(0), SlotState::Free(Nothing));
    }
}
