//! Routed experts in host memory, streamed to the device a layer at a time
//! (`--offload-experts`): the mirror of layerwise KV offload for the weights that, in a
//! mixture of experts, are what does not fit (llama.cpp's `--cpu-moe` keeps them on the
//! CPU and computes there; here they stay on the GPU's compute path and ride the link).
//!
//! Each experts layer's stacked bf16 tensors (`weights::ExpertMats`' layout: gate/up,
//! down, then gpt-oss's biases) sit in one host allocation (pinned on CUDA). A ring of
//! `slots` device buffers, each one layer's experts, is filled on the prefetch stream:
//! the `v`-th experts layer computed since the reset (visit `v`) uses slot `v % slots`,
//! and as soon as a visit's MLP is queued its slot is refilled with the layer of visit
//! `v + slots` — the next step's first layers while this step's last ones compute, since
//! every forward visits the experts layers in the same order whatever its tokens. Events
//! order it: a copy into a slot waits for the compute that read the slot's previous layer
//! (`done`), the compute waits for the copy (`ready`). With at least as many slots as
//! experts layers each slot keeps its layer and is filled once.
//!
//! Under the stream-ordering checker (`Checked`) the compute's reads of a slot are
//! declared at `begin`, so a missing wait is a reported hazard on any device; under the
//! sanitizer the CPU device delays copies at random, so a missing `ready` wait also reads
//! a half-copied slot.

use anyhow::{bail, Context, Result};
use half::bf16;

use super::checked::Checked;
use super::device::{EventId, MemId, OffloadDevice, Space, Span, StreamRole};
use crate::device::order::Access;
use crate::model::cuda::weights::ExpertStacks;
use crate::model::cuda::{ExpertPtrs, ExpertSource};
use crate::model::weights::Mlp;
use crate::model::Model;

/// `--offload-experts`' settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertOffload {
    /// Device slots, each one layer's experts (prefetch depth = slots − 1).
    pub slots: usize,
    /// The stream-ordering checker on the stream's device.
    pub check_order: bool,
    /// The CPU device's sanitizer (copies delayed at random), for the kernel emulator.
    pub sanitize: bool,
}

/// Offsets of one layer's tensors in its allocation, in elements.
#[derive(Clone, Copy, Debug)]
struct Layout {
    gate_up: usize,
    down: usize,
    biases: Option<(usize, usize)>,
    len: usize,
}

struct Slot {
    mem: MemId,
    /// Recorded on the prefetch stream after the slot's last copy.
    ready: EventId,
    /// Recorded on the compute stream after the last MLP that read the slot.
    done: EventId,
    /// The layer the slot holds (or is being filled with).
    holds: Option<usize>,
}

pub struct ExpertStream<D: OffloadDevice<Elem = bf16>> {
    d: Checked<D>,
    /// Per model layer: its experts' host allocation (`None`: not an experts layer).
    host: Vec<Option<MemId>>,
    /// The model layers with experts, in the order a forward visits them.
    order: Vec<usize>,
    layout: Layout,
    slots: Vec<Slot>,
    /// The visit the next `begin` serves, and the first visit whose copy is not queued.
    next: usize,
    issued: usize,
}

impl<D: OffloadDevice<Elem = bf16>> ExpertStream<D> {
    /// Every experts layer of `model` converted to bf16 into host memory of `d`, and
    /// `cfg.slots` device slots.
    pub fn new(d: D, model: &Model, cfg: ExpertOffload) -> Result<Self> {
        if cfg.slots == 0 {
            bail!("--num-expert-buffers must be at least 1");
        }
        let mut d = Checked::new(d, cfg.check_order);
        let (mut host, mut order, mut layout) = (Vec::new(), Vec::new(), None);
        for (l, lw) in model.weights.layers.iter().enumerate() {
            let Mlp::Experts(x) = &lw.mlp else {
                host.push(None);
                continue;
            };
            let st = ExpertStacks::of(model, x);
            let parts = st.parts();
            let here = Layout {
                gate_up: 0,
                down: parts[0].len(),
                biases: st.biases.as_ref().map(|(g, _)| {
                    let at = parts[0].len() + parts[1].len();
                    (at, at + g.len())
                }),
                len: parts.iter().map(|p| p.len()).sum(),
            };
            if layout.is_some_and(|l: Layout| l.len != here.len) {
                bail!("layer {l}: its experts differ in size from the layers' before it");
            }
            layout = Some(here);
            let mem = d.alloc(Space::Host, here.len)?;
            let span = Span {
                mem,
                off: 0,
                len: here.len,
            };
            d.host_access("experts-host", Access::Write, span)?;
            let dst = d.host_ptr(mem)? as *mut u16;
            let mut at = 0;
            for p in parts {
                // SAFETY: `mem` is a fresh host allocation of `here.len` bf16; the parts
                // add up to that length.
                unsafe { std::ptr::copy_nonoverlapping(p.as_ptr(), dst.add(at), p.len()) };
                at += p.len();
            }
            host.push(Some(mem));
            order.push(l);
        }
        let layout = layout.context("--offload-experts: the model has no experts")?;
        let slots = (0..cfg.slots.min(order.len()))
            .map(|_| {
                Ok(Slot {
                    mem: d.alloc(Space::Device, layout.len)?,
                    ready: d.new_event()?,
                    done: d.new_event()?,
                    holds: None,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            d,
            host,
            order,
            layout,
            slots,
            next: 0,
            issued: 0,
        })
    }

    /// Device bytes the slots take.
    pub fn device_bytes(&self) -> usize {
        2 * self.layout.len * self.slots.len()
    }

    fn slot_span(&self, s: usize) -> Span {
        Span {
            mem: self.slots[s].mem,
            off: 0,
            len: self.layout.len,
        }
    }

    /// Queues visit `v`'s layer into its slot, unless the slot holds it already.
    fn issue(&mut self, v: usize) -> Result<()> {
        let (s, layer) = (v % self.slots.len(), self.order[v % self.order.len()]);
        if self.slots[s].holds != Some(layer) {
            let p = StreamRole::Prefetch;
            self.d.wait(p, self.slots[s].done, "experts-slot-free")?;
            let src = Span {
                mem: self.host[layer].expect("an experts layer"),
                off: 0,
                len: self.layout.len,
            };
            self.d
                .copy(p, "h2d-experts", layer, src, self.slot_span(s))?;
            self.d.record(p, self.slots[s].ready)?;
            self.slots[s].holds = Some(layer);
        }
        Ok(())
    }

    /// Queues every visit up to `v + slots − 1` not queued yet.
    fn issue_through(&mut self, v: usize) -> Result<()> {
        while self.issued < v + self.slots.len() {
            self.issue(self.issued)?;
            self.issued += 1;
        }
        Ok(())
    }
}

impl<D: OffloadDevice<Elem = bf16> + Send> ExpertSource for ExpertStream<D> {
    fn begin(&mut self, layer: usize) -> Result<ExpertPtrs> {
        let m = self.order.len();
        let at = self
            .order
            .iter()
            .position(|&l| l == layer)
            .with_context(|| format!("layer {layer} has no streamed experts"))?;
        if self.next % m != at {
            // Out of the forward's order (a block checked alone): start the visits over
            // at this layer, once everything queued has run.
            self.d.sync_all()?;
            self.next = at;
            self.issued = at;
        }
        let v = self.next;
        self.issue_through(v)?;
        let s = v % self.slots.len();
        self.d
            .wait(StreamRole::Compute, self.slots[s].ready, "experts-ready")?;
        let span = self.slot_span(s);
        self.d.declare(
            StreamRole::Compute,
            "experts",
            layer,
            &[(Access::Read, span)],
        )?;
        let base = self.d.ptr(self.slots[s].mem);
        let l = self.layout;
        Ok(ExpertPtrs {
            gate_up: base.at(l.gate_up),
            down: base.at(l.down),
            biases: l.biases.map(|(g, d)| (base.at(g), base.at(d))),
        })
    }

    fn end(&mut self, layer: usize) -> Result<()> {
        let v = self.next;
        if self.order[v % self.order.len()] != layer {
            bail!("expert stream: end({layer}) without its begin");
        }
        let s = v % self.slots.len();
        self.d.record(StreamRole::Compute, self.slots[s].done)?;
        self.next = v + 1;
        // The slot just released takes visit v + slots at once.
        self.issue_through(self.next)
    }
}

impl<D: OffloadDevice<Elem = bf16>> Drop for ExpertStream<D> {
    fn drop(&mut self) {
        // Copies still queued write into the slots: let them finish first.
        let _ = self.d.sync_all();
    }
}
