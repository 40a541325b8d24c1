//! The forward side of the serving path: one batched forward per engine step over every
//! scheduled sequence's pages, by a model whose KV element is the pages' (the CPU model in
//! any `KvElem`, the CUDA model in bf16), declared to the stream-ordering checker first.

use std::marker::PhantomData;
use std::sync::Arc;

use anyhow::Result;
use half::bf16;

use super::device_pages::{lock, SharedPages};
use super::scheduler::{ScheduledSeq, SeqId};
use crate::device::KvElem;
use crate::model::cuda::CudaModel;
use crate::model::{BatchSeq, Model, PagePool};
use crate::offload::device::OffloadDevice;

/// One batched forward per engine step over every scheduled sequence's pages. The kernels
/// are batch-invariant, so each sequence's logits do not depend on the batch.
pub trait BatchRunner: Send {
    /// One forward over all `calls`; the logits `[rows, vocab]` of each call's rows that
    /// `ScheduledSeq::want_logits` names (`None` for none: replayed calls of a
    /// recomputation, prompt chunks before the last).
    fn forward(&mut self, calls: &[ScheduledSeq]) -> Result<Vec<Option<Vec<f32>>>>;
    /// Sequence `seq` is gone (finished, cancelled): drop what the runner keeps for it
    /// beyond its pages (a state-layer model's recurrent state).
    fn release(&mut self, _seq: SeqId) {}
    /// Bytes of the recurrent states the runner holds for live sequences (0 for a model
    /// without state layers).
    fn state_bytes(&self) -> usize {
        0
    }
}

/// The scheduled calls as the models' batched forward takes them.
pub fn batch_seqs(calls: &[ScheduledSeq]) -> Vec<BatchSeq<'_>> {
    calls
        .iter()
        .map(|c| BatchSeq {
            tokens: &c.tokens,
            pos0: c.pos0,
            pages: &c.block_table,
            window_pages: &c.window_table,
            logits: c.want_logits(),
            // A sequence's recurrent state is keyed by its id (`RecurrentStates`).
            state_slot: c.seq as usize,
        })
        .collect()
}

/// A model's batched forward over a page pool of its KV element.
pub trait BatchForward: Send {
    type Elem;
    fn forward_batch(
        &mut self,
        seqs: &[BatchSeq<'_>],
        pool: &mut dyn PagePool<Self::Elem>,
    ) -> Result<Vec<Option<Vec<f32>>>>;
}

/// The CPU model over pages of elements `T` (the CPU device's compute stream is the
/// calling thread).
pub struct CpuForward<T> {
    model: Arc<Model>,
    _elem: PhantomData<fn() -> T>,
}

impl<T> CpuForward<T> {
    pub fn new(model: Arc<Model>) -> Self {
        Self {
            model,
            _elem: PhantomData,
        }
    }
}

impl<T: KvElem> BatchForward for CpuForward<T> {
    type Elem = T;
    fn forward_batch(
        &mut self,
        seqs: &[BatchSeq<'_>],
        pool: &mut dyn PagePool<T>,
    ) -> Result<Vec<Option<Vec<f32>>>> {
        self.model.forward_batch(seqs, pool)
    }
}

/// The CUDA model (bf16 KV; on the GPU, or on the kernel emulator).
impl BatchForward for CudaModel {
    type Elem = bf16;
    fn forward_batch(
        &mut self,
        seqs: &[BatchSeq<'_>],
        pool: &mut dyn PagePool<bf16>,
    ) -> Result<Vec<Option<Vec<f32>>>> {
        CudaModel::forward_batch(self, seqs, pool)
    }
}

/// `M`'s batched forward over the device tier's pages.
pub struct DeviceRunner<M, D: OffloadDevice> {
    pub model: M,
    pub pages: SharedPages<D>,
}

impl<M, D> BatchRunner for DeviceRunner<M, D>
where
    M: BatchForward,
    D: OffloadDevice<Elem = M::Elem> + Send,
{
    fn forward(&mut self, calls: &[ScheduledSeq]) -> Result<Vec<Option<Vec<f32>>>> {
        let mut pages = lock(&self.pages);
        let seqs = batch_seqs(calls);
        pages.declare_forward(&seqs)?;
        self.model.forward_batch(&seqs, &mut *pages)
    }

    fn release(&mut self, seq: SeqId) {
        lock(&self.pages).release_state(seq as usize);
    }

    fn state_bytes(&self) -> usize {
        lock(&self.pages).state_bytes()
    }
}
