//! The state kind's memory (docs/architecture.md, "Layer kinds"): per sequence, per state
//! layer, a fixed-size f32 recurrent state `[conv tail | matrix state]`
//! (`DeltaShape::seq_state_len`), whatever the context length. A recurrence folds every
//! position in, so a state is valid at exactly one position: a step must continue from
//! where the last one ended (or start a sequence at 0), and nothing can rewind it.

use anyhow::{bail, Result};

use crate::model::ModelConfig;

/// The recurrent states of `slots` sequences of one model (CPU memory; each cache that
/// runs a state-layer model holds one: a single-sequence cache one slot, the serving
/// pool one per running sequence).
#[derive(Clone, Debug, Default)]
pub struct RecurrentStates {
    /// Floats of one sequence's state in each layer (0: an attention layer).
    len: Vec<usize>,
    slots: Vec<SeqState>,
}

/// One sequence's states, and the position they are valid at.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqState {
    /// Positions folded in: the next step must start here.
    pub pos: usize,
    /// Per layer, `len[layer]` floats (empty for an attention layer).
    pub layers: Vec<Vec<f32>>,
}

impl RecurrentStates {
    /// `slots` zeroed states for `cfg`'s state layers (none at all without any: a model
    /// of attention layers only holds nothing here).
    pub fn for_model(cfg: &ModelConfig, slots: usize) -> Self {
        let len: Vec<usize> = (0..cfg.num_layers)
            .map(|l| cfg.state(l).map_or(0, |s| s.seq_state_len()))
            .collect();
        let slots = match len.iter().any(|&n| n > 0) {
            true => slots,
            false => 0,
        };
        let fresh = SeqState {
            pos: 0,
            layers: len.iter().map(|&n| vec![0.0; n]).collect(),
        };
        Self {
            len,
            slots: vec![fresh; slots],
        }
    }

    /// Whether the model has state layers (so a step must name a slot).
    pub fn any(&self) -> bool {
        !self.slots.is_empty()
    }

    pub fn num_slots(&self) -> usize {
        self.slots.len()
    }

    /// Bytes held (every slot).
    pub fn bytes(&self) -> usize {
        self.slots.len() * self.seq_bytes()
    }

    /// Bytes of one sequence's states, every state layer.
    pub fn seq_bytes(&self) -> usize {
        4 * self.len.iter().sum::<usize>()
    }

    /// A step over positions `pos0..pos0 + tokens` of slot `slot`'s sequence begins: a
    /// step at 0 starts the sequence from zero states; any other must continue where
    /// the states are.
    pub fn begin_step(&mut self, slot: usize, pos0: usize, tokens: usize) -> Result<()> {
        let Some(s) = self.slots.get_mut(slot) else {
            if self.slots.is_empty() {
                return Ok(());
            }
            bail!("recurrent state slot {slot} out of range");
        };
        if pos0 == 0 {
            s.layers.iter_mut().for_each(|l| l.fill(0.0));
        } else if pos0 != s.pos {
            bail!(
                "a state layer's recurrence holds position {}, the step starts at {pos0}: it can only continue (a recurrent state cannot rewind or skip)",
                s.pos
            );
        }
        s.pos = pos0 + tokens;
        Ok(())
    }

    /// Layer `layer`'s state of slot `slot` (`DeltaShape::seq_state_len` floats).
    pub fn layer(&mut self, layer: usize, slot: usize) -> Result<&mut [f32]> {
        match self.slots.get_mut(slot).map(|s| &mut s.layers[layer]) {
            Some(st) if !st.is_empty() => Ok(st),
            _ => bail!("no recurrent state for layer {layer}, slot {slot}"),
        }
    }

    /// Forgets positions `len..`: only possible when there are none (a state cannot
    /// rewind; speculative drafts over a state model are refused here).
    pub fn truncate(&self, slot: usize, len: usize) -> Result<()> {
        match self.slots.get(slot) {
            Some(s) if len < s.pos => bail!(
                "cannot rewind to position {len}: a state layer's recurrence holds {} positions and cannot forget any",
                s.pos
            ),
            _ => Ok(()),
        }
    }

    /// Every slot back to position 0.
    pub fn reset(&mut self) {
        for s in &mut self.slots {
            s.pos = 0;
        }
    }

    /// A copy of slot `slot`'s states (a preempted sequence's, to restore later).
    pub fn save(&self, slot: usize) -> Option<SeqState> {
        self.slots.get(slot).cloned()
    }

    /// Slot `slot` takes `state` (what `save` gave, or read back from a tier).
    pub fn restore(&mut self, slot: usize, state: SeqState) -> Result<()> {
        let lens: Vec<usize> = state.layers.iter().map(Vec::len).collect();
        if lens != self.len {
            bail!("a saved recurrent state of another shape");
        }
        match self.slots.get_mut(slot) {
            Some(s) => *s = state,
            None => bail!("recurrent state slot {slot} out of range"),
        }
        Ok(())
    }
}
