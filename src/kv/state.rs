//! The state kind's memory (docs/architecture.md, "Layer kinds"): per sequence, per state
//! layer, a fixed-size f32 recurrent state `[conv tail | matrix state]`
//! (`DeltaShape::seq_state_len`), whatever the context length. A recurrence folds every
//! position in, so a state is valid at exactly one position: a step must continue from
//! where the last one ended (or start a sequence at 0), and nothing can rewind it.

use std::collections::HashMap;

use anyhow::{bail, Result};

use crate::model::ModelConfig;

/// The recurrent states of the sequences a cache runs, by state slot (CPU memory; a
/// single-sequence cache uses slot 0, the serving pool a sequence's id). A slot's state
/// is created zeroed by a step at position 0 and lives until `release`.
#[derive(Clone, Debug, Default)]
pub struct RecurrentStates {
    /// Floats of one sequence's state in each layer (0: an attention layer); empty for
    /// a model without state layers, which holds nothing here.
    len: Vec<usize>,
    slots: HashMap<usize, SeqState>,
}

/// One sequence's states, and the position they are valid at.
#[derive(Clone, Debug, PartialEq)]
struct SeqState {
    /// Positions folded in: the next step must start here.
    pos: usize,
    /// Per layer, `len[layer]` floats (empty for an attention layer).
    layers: Vec<Vec<f32>>,
}

impl RecurrentStates {
    /// No states yet, for `cfg`'s state layers.
    pub fn for_model(cfg: &ModelConfig) -> Self {
        let len: Vec<usize> = (0..cfg.num_layers)
            .map(|l| cfg.state(l).map_or(0, |s| s.seq_state_len()))
            .collect();
        Self {
            len: if len.iter().any(|&n| n > 0) {
                len
            } else {
                Vec::new()
            },
            slots: HashMap::new(),
        }
    }

    /// Whether the model has state layers.
    pub fn any(&self) -> bool {
        !self.len.is_empty()
    }

    /// Bytes held (every slot's).
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
        if !self.any() {
            return Ok(());
        }
        if pos0 == 0 {
            let fresh = || SeqState {
                pos: 0,
                layers: self.len.iter().map(|&n| vec![0.0; n]).collect(),
            };
            let s = self.slots.entry(slot).or_insert_with(fresh);
            s.layers.iter_mut().for_each(|l| l.fill(0.0));
            s.pos = tokens;
            return Ok(());
        }
        match self.slots.get_mut(&slot) {
            Some(s) if s.pos == pos0 => {
                s.pos = pos0 + tokens;
                Ok(())
            }
            s => bail!(
                "a state layer's recurrence holds position {}, the step starts at {pos0}: it can only continue (a recurrent state cannot rewind or skip)",
                s.map_or(0, |s| s.pos)
            ),
        }
    }

    /// Layer `layer`'s state of slot `slot` (`DeltaShape::seq_state_len` floats).
    pub fn layer(&mut self, layer: usize, slot: usize) -> Result<&mut [f32]> {
        match self
            .slots
            .get_mut(&slot)
            .and_then(|s| s.layers.get_mut(layer))
        {
            Some(st) if !st.is_empty() => Ok(st),
            _ => bail!("no recurrent state for layer {layer}, slot {slot}"),
        }
    }

    /// Forgets positions `len..`: only possible when there are none (a state cannot
    /// rewind; speculative drafts over a state model are refused here).
    pub fn truncate(&self, slot: usize, len: usize) -> Result<()> {
        match self.slots.get(&slot) {
            Some(s) if len < s.pos => bail!(
                "cannot rewind to position {len}: a state layer's recurrence holds {} positions and cannot forget any",
                s.pos
            ),
            _ => Ok(()),
        }
    }

    /// Drops slot `slot`'s state (its sequence finished or was cancelled).
    pub fn release(&mut self, slot: usize) {
        self.slots.remove(&slot);
    }

    /// Drops every state.
    pub fn reset(&mut self) {
        self.slots.clear();
    }
}
