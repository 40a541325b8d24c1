//! The KV seam, pull-shaped: the model's layer loop asks a cache where layer `l`'s K and V
//! are (`begin_layer`), enqueues its own work on the compute stream against them, and says
//! when it is done (`end_layer`). The CPU model and the CUDA model use the same seam; the
//! resident caches, the offload engine and the serving path's page pool implement it.
//!
//! ```text
//! begin_step(pos0, tokens) → [ begin_layer(l) → layer l's work → end_layer(l) ]* (l = 0..L)
//! ```

pub mod cuda;
pub mod state;

pub use state::{RecurrentStates, StateSlot};

use std::marker::PhantomData;

use anyhow::{bail, Result};

pub use crate::device::cpu::rows::KvRows;
use crate::device::{DevPtr, KvElem};

/// Where one layer's K and V live while it computes: `[rows, kv_dim]` each, in the
/// cache's KV element type (`--kv-dtype` on the CPU device, bf16 on CUDA).
#[derive(Debug)]
pub struct LayerSlot<T> {
    pub k: DevPtr<T>,
    pub v: DevPtr<T>,
    pub rows: usize,
    /// The rows are a sliding-window layer's ring: position `p` lives at row `p % rows`
    /// (one sequence's step only; `KvCache::max_step_tokens` keeps a step inside it).
    /// Otherwise the sequence's layout (by position, or its pages) places it.
    pub ring: bool,
}

impl<T> Clone for LayerSlot<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for LayerSlot<T> {}

/// Sparse decode: the slot row where the step's new token's K/V goes. The slot holds the
/// compacted context (sink page, selected pages, recent window) in position order in rows
/// `0..row`, so the layer attends rows `0..=row`; K is stored after RoPE, so no position
/// changes (RoPE still uses the token's true position).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NewRow(pub usize);

/// One token's query at a layer where the compute stream left it (`[num_heads, head_dim]`,
/// post-RoPE, in the KV element type; host memory on the CPU device): what sparse decode
/// scores pages with. `len` counts elements.
#[derive(Debug)]
pub struct Query<T> {
    pub ptr: DevPtr<T>,
    pub len: usize,
}

impl<T> Clone for Query<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Query<T> {}

impl<'a, T> From<&'a [T]> for Query<T> {
    /// The CPU model's query, in host memory.
    fn from(q: &'a [T]) -> Self {
        Self {
            ptr: DevPtr::from_addr(q.as_ptr() as u64),
            len: q.len(),
        }
    }
}

/// What the layer loop needs from a KV cache during one forward step.
///
/// # Safety
/// Implementors promise that from `begin_layer(l)` returning until `end_layer(l)`, the
/// slot's memory is valid for `rows` rows, and the rows the step stores and attends (its
/// sequences' positions) are touched by nothing but the compute stream: every copy into
/// them has completed (as seen by the compute stream) and none out of them is pending.
pub unsafe trait KvCache<T> {
    /// Forgets everything of the previous request (called before each request's prefill).
    fn reset(&mut self) -> Result<()>;
    /// Tokens one sequence may hold.
    fn capacity(&self) -> usize;
    /// A forward step over positions `pos0..pos0 + tokens` begins (e.g. start prefetching).
    fn begin_step(&mut self, pos0: usize, tokens: usize) -> Result<()>;
    /// Makes layer `layer`'s KV usable by the compute stream (waits queued there, or on the
    /// CPU device, where the calling thread is the compute stream, waited for) and returns
    /// where it is.
    fn begin_layer(&mut self, layer: usize) -> Result<LayerSlot<T>>;
    /// The layer's work is enqueued: record, offload, prefetch ahead.
    fn end_layer(&mut self, layer: usize) -> Result<()>;
    /// Forgets positions `len..` between steps, so that the next step may start at `len`
    /// (speculative decoding's rejected drafts). Caches that address rows by position
    /// need do nothing; the default refuses.
    fn truncate(&mut self, len: usize) -> Result<()> {
        bail!("this KV cache cannot forget stored positions (truncate to {len})")
    }
    /// The next step attends every stored position, even a one-token step of a sparse
    /// cache (the verify step of sparse decode's drafts; several tokens always do).
    /// Caches that always attend everything need do nothing.
    fn attend_all_next_step(&mut self) {}
    /// Called by the model between `begin_layer` and attention with the query of the
    /// step's last token (`[num_heads, head_dim]`), once it is queued on the compute
    /// stream (valid until the call returns). In decode, a sparse cache picks the rows to
    /// attend from it, makes them ready on the compute stream and returns where the new
    /// token goes; `None` (every other cache, and prefill: a sparse cache may keep the
    /// prompt's last query to predict the first decode step): attend every position as
    /// usual.
    fn select_rows(&mut self, _layer: usize, _query: Query<T>) -> Result<Option<NewRow>> {
        Ok(None)
    }
    /// The most tokens one step may add: a sliding-window ring holds its window and one
    /// step's new rows. `Model::forward` cuts a longer step (a long prompt) into steps of
    /// at most this many, with bitwise the same logits (every kernel is row- and
    /// chunk-invariant).
    fn max_step_tokens(&self) -> usize {
        usize::MAX
    }
    /// A state layer's recurrent state of the step's sequence in state slot `slot` (f32,
    /// `DeltaShape::seq_state_len` floats, in the memory the model computes in), between
    /// `begin_layer(layer)` and `end_layer(layer)`: the layer reads and updates it in
    /// place, on the compute stream, which is the only one to touch it. Caches without
    /// state slots refuse (a model of attention layers never asks).
    fn layer_state(&mut self, layer: usize, slot: usize) -> Result<StateSlot> {
        bail!("this KV cache keeps no recurrent state (layer {layer}, slot {slot})")
    }
    /// A step over positions `pos0..pos0 + tokens` of the sequence in state slot `slot`
    /// begins (`RecurrentStates::begin_step`: from zero at 0, else only where the state
    /// is). The model calls it for each sequence of a step, state-layer models only.
    fn begin_state(&mut self, slot: usize, pos0: usize, tokens: usize) -> Result<()> {
        bail!(
            "this KV cache keeps no recurrent state (slot {slot}, positions {pos0}..{})",
            pos0 + tokens
        )
    }
}

/// Rows a resident sliding-window layer's ring adds past its window: the longest step
/// over such a cache (a longer prompt is prefilled in steps of this many).
pub const RING_STEP_TOKENS: usize = 256;

/// The first block of `block_size` tokens a query at `pos` reads through a sliding window
/// of `window` tokens (0 without one): the block holding its first key, `pos + 1 − window`.
/// One rule for the offload engine's prefetch and the serving window pool's releases.
pub fn first_window_block(window: Option<usize>, pos: usize, block_size: usize) -> usize {
    window.map_or(0, |w| (pos + 1).saturating_sub(w) / block_size)
}

/// Which layers of a resident cache keep a sliding-window ring instead of every position,
/// and so how long a step and how deep a rewind may be: the geometry the CPU's
/// `ContiguousKv` and the CUDA device's `ResidentKv` share. A ring of
/// `window − 1 + RING_STEP_TOKENS` rows holds position `p` at row `p % rows`.
#[derive(Clone, Debug)]
pub struct WindowRings {
    /// Per layer: the ring's rows and the window (`None`: every position kept).
    ring: Vec<Option<(usize, usize)>>,
    /// Positions stored (what a rewind must find a ring's window in).
    stored: usize,
}

impl WindowRings {
    /// Every layer keeps every position.
    pub fn none(num_layers: usize) -> Self {
        Self {
            ring: vec![None; num_layers],
            stored: 0,
        }
    }

    /// A ring for each sliding-window layer of `cfg` whose ring is smaller than
    /// `capacity` (a window as long as the context gains nothing from one).
    pub fn for_model(cfg: &crate::model::ModelConfig, capacity: usize) -> Self {
        Self {
            ring: (0..cfg.num_layers)
                .map(|l| {
                    cfg.window(l)
                        .map(|w| (w - 1 + RING_STEP_TOKENS, w))
                        .filter(|&(rows, _)| rows < capacity)
                })
                .collect(),
            stored: 0,
        }
    }

    pub fn layers(&self) -> usize {
        self.ring.len()
    }

    /// Layer `layer`'s ring rows (`None`: not a ring).
    pub fn rows(&self, layer: usize) -> Option<usize> {
        self.ring[layer].map(|(rows, _)| rows)
    }

    /// The longest step every ring keeps its window through.
    pub fn max_step_tokens(&self) -> usize {
        self.ring
            .iter()
            .flatten()
            .map(|&(rows, window)| rows + 1 - window)
            .min()
            .unwrap_or(usize::MAX)
    }

    /// A step over `pos0..end` begins: refused when longer than a ring allows.
    pub fn begin_step(&mut self, pos0: usize, end: usize) -> Result<()> {
        let tokens = end - pos0;
        if tokens > self.max_step_tokens() {
            bail!(
                "a step of {tokens} tokens overruns a sliding-window ring (at most {})",
                self.max_step_tokens()
            );
        }
        self.stored = end;
        Ok(())
    }

    /// Forgets positions `len..`. A ring keeps `RING_STEP_TOKENS` rows past its window,
    /// so a rewind of up to that many tokens still finds the window (sparse decode rewinds
    /// a few drafts); a deeper one is refused.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        let back = self.stored.saturating_sub(len);
        if back > self.max_step_tokens() {
            bail!(
                "cannot rewind {back} tokens: a sliding-window ring keeps {} tokens past its window",
                self.max_step_tokens()
            );
        }
        self.stored = self.stored.min(len);
        Ok(())
    }

    pub fn reset(&mut self) {
        self.stored = 0;
    }
}

/// One layer's K and V memory on the CPU device, `[rows, kv_dim]` elements `T` each, as
/// the model stores into it. It holds raw pointers and hands out one row-sized slice at a
/// time, never a reference spanning rows that another stream may be writing (the serving
/// pool's other pages, a ring slot's neighbours).
pub struct LayerKv<'a, T> {
    k: *mut T,
    v: *mut T,
    len: usize, // elements in each of K and V
    _borrow: PhantomData<&'a mut [T]>,
}

impl<'a, T: KvElem> LayerKv<'a, T> {
    /// # Safety
    /// `slot` must come from a `KvCache::begin_layer` whose `end_layer` has not been
    /// called yet, on the CPU device (its addresses are host memory).
    pub unsafe fn from_slot(slot: LayerSlot<T>, kv_dim: usize) -> Self {
        Self {
            k: slot.k.as_host_ptr(),
            v: slot.v.as_host_ptr(),
            len: slot.rows * kv_dim,
            _borrow: PhantomData,
        }
    }

    /// Over two buffers the caller owns (tests, references).
    pub fn from_slices(k: &'a mut [T], v: &'a mut [T]) -> Self {
        assert_eq!(k.len(), v.len(), "K and V hold the same rows");
        Self {
            k: k.as_mut_ptr(),
            v: v.as_mut_ptr(),
            len: k.len(),
            _borrow: PhantomData,
        }
    }

    /// Writes one position's K and V row at `at` (an offset in elements), each value
    /// rounded to `T` (`KvElem::from_f32`; f32 stores it as is).
    pub fn store(&mut self, at: usize, k: &[f32], v: &[f32]) {
        assert!(
            k.len() == v.len() && at + k.len() <= self.len,
            "KV store out of range"
        );
        // SAFETY: in bounds; the row is the compute stream's (the `KvCache` contract, or
        // the caller's own buffers); the sources are activations, never the cache.
        let (kd, vd) = unsafe {
            (
                std::slice::from_raw_parts_mut(self.k.add(at), k.len()),
                std::slice::from_raw_parts_mut(self.v.add(at), v.len()),
            )
        };
        for (d, s) in kd.iter_mut().zip(k).chain(vd.iter_mut().zip(v)) {
            *d = T::from_f32(*s);
        }
    }

    /// The same memory, to read.
    pub fn read(&self) -> KvRows<'_, T> {
        // SAFETY: `len` elements at each pointer (the slot, or the caller's buffers),
        // borrowed from `self` for the view's life, so nothing stores through it meanwhile.
        unsafe { KvRows::from_raw(self.k, self.v, self.len) }
    }
}

/// A contiguous per-sequence cache in CPU memory: `num_layers × [capacity, kv_dim]`
/// elements `T` for K and for V, grown as positions are used. Everything is resident and
/// the calling thread is the compute stream, so `begin_layer`/`end_layer` wait for nothing.
///
/// `for_model` keeps a sliding-window layer in a ring of `window − 1 + RING_STEP_TOKENS`
/// rows instead (position `p` at row `p % rows`), so its KV never outgrows its window.
pub struct ContiguousKv<T = f32> {
    row: usize, // kv_heads * head_dim
    capacity: usize,
    k: Vec<Vec<T>>, // [num_layers][rows * row]
    v: Vec<Vec<T>>,
    /// The sliding-window layers' rings (`for_model`; none in `of`).
    rings: WindowRings,
    /// The state layers' recurrent states, one slot (`for_model`; none in `of`).
    states: RecurrentStates,
    /// Per layer: a state layer, which keeps no K/V rows.
    state_layer: Vec<bool>,
}

impl ContiguousKv<f32> {
    /// Room for `capacity` tokens per layer in f32, the reference (allocated lazily as
    /// positions are used).
    pub fn new(num_layers: usize, kv_heads: usize, head_dim: usize, capacity: usize) -> Self {
        Self::of(num_layers, kv_heads, head_dim, capacity)
    }
}

impl<T: KvElem> ContiguousKv<T> {
    /// Room for `capacity` tokens per layer in elements `T`.
    /// Every layer keeps every position: the reference the rings are checked against.
    pub fn of(num_layers: usize, kv_heads: usize, head_dim: usize, capacity: usize) -> Self {
        Self {
            row: kv_heads * head_dim,
            capacity,
            k: vec![Vec::new(); num_layers],
            v: vec![Vec::new(); num_layers],
            rings: WindowRings::none(num_layers),
            states: RecurrentStates::default(),
            state_layer: vec![false; num_layers],
        }
    }

    /// Room for `capacity` tokens of `cfg`'s model: a full layer keeps every position, a
    /// sliding-window layer a ring of its window plus one step (`RING_STEP_TOKENS`).
    pub fn for_model(cfg: &crate::model::ModelConfig, capacity: usize) -> Self {
        Self {
            rings: WindowRings::for_model(cfg, capacity),
            states: RecurrentStates::for_model(cfg),
            state_layer: (0..cfg.num_layers).map(|l| !cfg.keeps_kv(l)).collect(),
            ..Self::of(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity)
        }
    }

    /// Room for `capacity` tokens of `cfg`'s model with every attention layer keeping
    /// every position (no rings: the reference `for_model`'s rings are checked against);
    /// a state layer keeps its state.
    pub fn plain(cfg: &crate::model::ModelConfig, capacity: usize) -> Self {
        Self {
            rings: WindowRings::none(cfg.num_layers),
            ..Self::for_model(cfg, capacity)
        }
    }

    /// The state layers' recurrent states (`save` a snapshot to `restore` later: a
    /// benchmark's rounds each decode from the same prefilled context).
    pub fn states(&mut self) -> &mut RecurrentStates {
        &mut self.states
    }

    /// Bytes currently held (recurrent states included).
    pub fn bytes(&self) -> usize {
        let elems: usize = self.k.iter().chain(&self.v).map(Vec::len).sum();
        elems * std::mem::size_of::<T>() + self.states.bytes()
    }
}

// SAFETY: the buffers are this cache's alone and only grow in `begin_step`, between steps.
unsafe impl<T: KvElem> KvCache<T> for ContiguousKv<T> {
    fn reset(&mut self) -> Result<()> {
        self.rings.reset();
        self.states.reset();
        Ok(())
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn begin_step(&mut self, pos0: usize, tokens: usize) -> Result<()> {
        let end = pos0 + tokens;
        if end > self.capacity {
            bail!(
                "KV cache full: {end} tokens needed, room for {}",
                self.capacity
            );
        }
        self.rings.begin_step(pos0, end)?;
        for l in (0..self.k.len()).filter(|&l| !self.state_layer[l]) {
            // A ring stops growing at its rows: positions past them wrap.
            let cap = self.rings.rows(l).unwrap_or(self.capacity) * self.row;
            let need = (end * self.row).min(cap);
            for buf in [&mut self.k[l], &mut self.v[l]] {
                if buf.len() < need {
                    // Grow geometrically so decode does not reallocate every step.
                    let target = need.max(buf.len() * 2).min(cap);
                    buf.resize(target, T::default());
                }
            }
        }
        Ok(())
    }

    fn begin_layer(&mut self, layer: usize) -> Result<LayerSlot<T>> {
        let (k, v) = (&mut self.k[layer], &mut self.v[layer]);
        Ok(LayerSlot {
            k: DevPtr::from_addr(k.as_mut_ptr() as u64),
            v: DevPtr::from_addr(v.as_mut_ptr() as u64),
            rows: k.len() / self.row.max(1),
            // Until it has grown to its rows, a ring's positions sit at their own rows.
            ring: self.rings.rows(layer) == Some(k.len() / self.row.max(1)),
        })
    }

    fn end_layer(&mut self, _layer: usize) -> Result<()> {
        Ok(())
    }

    /// Rows are addressed by position: the next step overwrites from `len` (a ring's
    /// rewind: `WindowRings::truncate`).
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.states.truncate(0, len)?;
        self.rings.truncate(len)
    }

    fn max_step_tokens(&self) -> usize {
        self.rings.max_step_tokens()
    }

    fn layer_state(&mut self, layer: usize, slot: usize) -> Result<StateSlot> {
        self.states.layer(layer, slot)
    }

    fn begin_state(&mut self, slot: usize, pos0: usize, tokens: usize) -> Result<()> {
        self.states.begin_step(slot, pos0, tokens)
    }
}
