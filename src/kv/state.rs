//! The state kind's memory (docs/architecture.md, "Layer kinds"): per sequence, per state
//! layer, a fixed-size f32 recurrent state `[conv tail | matrix state]`
//! (`DeltaShape::seq_state_len`), whatever the context length. A recurrence folds every
//! position in, so a state is valid at exactly one position: a step must continue from
//! where the last one ended (or start a sequence at 0), and nothing can rewind it.
//!
//! The states live where the model's compute reads them (`StateMemory`): host memory for
//! the CPU device (and the kernel emulator, whose "device" memory is host memory), the
//! GPU's for the CUDA device. The bookkeeping (slots, positions) is the same for both.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, Result};

use crate::device::cuda::exec::{Buf, Exec};
use crate::device::DevPtr;
use crate::model::ModelConfig;

/// One sequence's state in one layer while the layer runs (`KvCache::layer_state`): `len`
/// f32 at `ptr`, in the memory the model computes in (host memory on the CPU device).
#[derive(Clone, Copy, Debug)]
pub struct StateSlot {
    pub ptr: DevPtr<f32>,
    pub len: usize,
}

impl StateSlot {
    /// The state as a slice, on the CPU device.
    ///
    /// # Safety
    /// The slot must come from `KvCache::layer_state` of a cache whose states are host
    /// memory, between the layer's `begin_layer` and `end_layer`, with no other view of
    /// it alive.
    pub unsafe fn as_host_mut<'a>(self) -> &'a mut [f32] {
        std::slice::from_raw_parts_mut(self.ptr.as_host_ptr(), self.len)
    }
}

/// Where a cache keeps its recurrent states, and how the host writes and reads them in
/// order with the compute stream's work (zeroing a sequence that starts; a benchmark's
/// snapshot).
pub trait StateMemory: Send + Sync {
    /// `len` zeroed f32 and their address, fixed while the `Buf` lives.
    fn alloc(&self, len: usize) -> Result<(Buf, DevPtr<f32>)>;
    /// Zeroes `len` f32 at `dst`, after the compute stream's work queued so far.
    ///
    /// # Safety
    /// `dst` must hold `len` f32 of this memory.
    unsafe fn zero(&self, dst: DevPtr<f32>, len: usize) -> Result<()>;
    /// Writes `v` at `dst`, after the compute stream's work queued so far.
    ///
    /// # Safety
    /// `dst` must hold `v.len()` f32 of this memory.
    unsafe fn write(&self, dst: DevPtr<f32>, v: &[f32]) -> Result<()>;
    /// Reads `len` f32 at `src` once the compute stream's work queued so far has run.
    ///
    /// # Safety
    /// `src` must hold `len` f32 of this memory.
    unsafe fn read(&self, src: DevPtr<f32>, len: usize) -> Result<Vec<f32>>;
}

/// Host memory: the CPU device's compute stream is the calling thread, so in order with
/// it means now.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostMemory;

impl StateMemory for HostMemory {
    fn alloc(&self, len: usize) -> Result<(Buf, DevPtr<f32>)> {
        let buf = vec![0u128; (4 * len).div_ceil(16).max(1)];
        let ptr = DevPtr::from_addr(buf.as_ptr() as u64);
        Ok((Buf::Host(buf), ptr))
    }

    unsafe fn zero(&self, dst: DevPtr<f32>, len: usize) -> Result<()> {
        std::slice::from_raw_parts_mut(dst.as_host_ptr(), len).fill(0.0);
        Ok(())
    }

    unsafe fn write(&self, dst: DevPtr<f32>, v: &[f32]) -> Result<()> {
        std::slice::from_raw_parts_mut(dst.as_host_ptr(), v.len()).copy_from_slice(v);
        Ok(())
    }

    unsafe fn read(&self, src: DevPtr<f32>, len: usize) -> Result<Vec<f32>> {
        Ok(std::slice::from_raw_parts(src.as_host_ptr(), len).to_vec())
    }
}

/// An executor's memory (the GPU's, on the model's compute stream; the emulator's), for
/// the CUDA model's caches.
pub struct ExecMemory(pub Arc<dyn Exec>);

impl StateMemory for ExecMemory {
    fn alloc(&self, len: usize) -> Result<(Buf, DevPtr<f32>)> {
        let (b, p) = self.0.alloc(4 * len)?;
        Ok((b, p.cast()))
    }

    unsafe fn zero(&self, dst: DevPtr<f32>, len: usize) -> Result<()> {
        self.0.zero(dst.cast(), 4 * len)
    }

    unsafe fn write(&self, dst: DevPtr<f32>, v: &[f32]) -> Result<()> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_ne_bytes()).collect();
        self.0.htod(dst.cast(), &bytes)
    }

    unsafe fn read(&self, src: DevPtr<f32>, len: usize) -> Result<Vec<f32>> {
        let mut bytes = vec![0u8; 4 * len];
        self.0.download(src.cast(), &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_ne_bytes(b.try_into().expect("4 bytes")))
            .collect())
    }
}

/// The recurrent states of the sequences a cache runs, by state slot (a single-sequence
/// cache uses slot 0, the serving pool a sequence's id). A slot's state is created zeroed
/// by a step at position 0 and lives until `release`.
pub struct RecurrentStates {
    /// Floats of one sequence's state in each layer (0: an attention layer); empty for
    /// a model without state layers, which holds nothing here.
    len: Vec<usize>,
    mem: Arc<dyn StateMemory>,
    slots: HashMap<usize, SeqState>,
}

impl Default for RecurrentStates {
    /// No state layers.
    fn default() -> Self {
        Self {
            len: Vec::new(),
            mem: Arc::new(HostMemory),
            slots: HashMap::new(),
        }
    }
}

/// One sequence's states, and the position they are valid at.
struct SeqState {
    /// Positions folded in: the next step must start here.
    pos: usize,
    /// Per layer, `len[layer]` floats (none for an attention layer).
    layers: Vec<Option<(Buf, DevPtr<f32>)>>,
}

/// A copy of one sequence's states (`RecurrentStates::save`), to put back with `restore`.
#[derive(Clone, Debug, PartialEq)]
pub struct SavedStates {
    pos: usize,
    layers: Vec<Vec<f32>>, // per layer, empty for an attention layer
}

impl RecurrentStates {
    /// No states yet, for `cfg`'s state layers, in host memory.
    pub fn for_model(cfg: &ModelConfig) -> Self {
        Self::in_memory(cfg, Arc::new(HostMemory))
    }

    /// No states yet, for `cfg`'s state layers, kept in `mem`.
    pub fn in_memory(cfg: &ModelConfig, mem: Arc<dyn StateMemory>) -> Self {
        let len: Vec<usize> = (0..cfg.num_layers)
            .map(|l| cfg.state(l).map_or(0, |s| s.seq_state_len()))
            .collect();
        Self {
            len: if len.iter().any(|&n| n > 0) {
                len
            } else {
                Vec::new()
            },
            mem,
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
            if let Some(s) = self.slots.get_mut(&slot) {
                for (l, buf) in s.layers.iter().enumerate() {
                    if let Some((_, p)) = buf {
                        // SAFETY: this memory's allocation of `len[l]` floats.
                        unsafe { self.mem.zero(*p, self.len[l])? };
                    }
                }
                s.pos = tokens;
                return Ok(());
            }
            let layers = self
                .len
                .iter()
                .map(|&n| (n > 0).then(|| self.mem.alloc(n)).transpose())
                .collect::<Result<_>>()?;
            self.slots.insert(
                slot,
                SeqState {
                    pos: tokens,
                    layers,
                },
            );
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
    pub fn layer(&self, layer: usize, slot: usize) -> Result<StateSlot> {
        match self
            .slots
            .get(&slot)
            .and_then(|s| s.layers.get(layer))
            .and_then(Option::as_ref)
        {
            Some(&(_, ptr)) => Ok(StateSlot {
                ptr,
                len: self.len[layer],
            }),
            None => bail!("no recurrent state for layer {layer}, slot {slot}"),
        }
    }

    /// A copy of slot `slot`'s states (waits for the compute queued so far); nothing for
    /// a model without state layers.
    pub fn save(&self, slot: usize) -> Result<SavedStates> {
        if !self.any() {
            return Ok(SavedStates {
                pos: 0,
                layers: Vec::new(),
            });
        }
        let Some(s) = self.slots.get(&slot) else {
            bail!("no recurrent state for slot {slot}");
        };
        let layers = s
            .layers
            .iter()
            .zip(&self.len)
            .map(|(buf, &n)| match buf {
                // SAFETY: this memory's allocation of `n` floats.
                Some((_, p)) => unsafe { self.mem.read(*p, n) },
                None => Ok(Vec::new()),
            })
            .collect::<Result<_>>()?;
        Ok(SavedStates { pos: s.pos, layers })
    }

    /// Puts back states `save` gave (a benchmark's rounds each decode from the same
    /// prefilled context: a recurrence cannot be rewound, only restored).
    pub fn restore(&mut self, slot: usize, saved: &SavedStates) -> Result<()> {
        if !self.any() {
            return Ok(());
        }
        let Some(s) = self.slots.get_mut(&slot) else {
            bail!("no recurrent state for slot {slot}");
        };
        for (buf, v) in s.layers.iter().zip(&saved.layers) {
            if let Some((_, p)) = buf {
                // SAFETY: the allocation of this layer's floats, which `save` read whole.
                unsafe { self.mem.write(*p, v)? };
            }
        }
        s.pos = saved.pos;
        Ok(())
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
