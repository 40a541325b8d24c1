//! Scheduler-side tests of the serving path: block residency, jobs and their rollback,
//! logical→physical resolution, preemption policy (demotion to disk included), and the
//! randomized property test for two and three tiers.
//! No model and no KV memory: forward calls are simulated by a token function.

use std::collections::HashSet;

use rand::{rngs::StdRng, Rng, SeedableRng};
use strata::serve::block_key::{BlockKey, KeySeed};
use strata::serve::block_manager::{BlockError, BlockManager, GpuPages, Hold};
use strata::serve::cache_events::{CacheEvent, KvGroup, Medium};
use strata::serve::residency::{Move, Residency, Tier};
use strata::serve::scheduler::{window_pool_pages, Scheduler, SchedulerConfig, SeqId};
use strata::serve::transfer::{JobKind, Loc, SimBackend, TransferBackend, TransferJob};

/// The token a simulated model "samples" for sequence `seq` at output position `i`.
fn fake_token(seq: SeqId, i: usize) -> u32 {
    ((seq as usize * 31 + i * 7) % 97) as u32 + 3
}

fn cfg(bs: usize, gpu: usize, cpu: usize, chunk: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size: bs,
        num_gpu_blocks: gpu,
        max_cpu_offload_blocks: cpu,
        max_disk_offload_blocks: 0,
        max_num_seqs: 16,
        max_num_batched_tokens: 64.max(chunk),
        prefill_chunk: chunk,
    }
}

/// One engine step with a simulated model. Returns the jobs created in it.
fn step(s: &mut Scheduler, b: &mut dyn TransferBackend) -> Vec<TransferJob> {
    for c in b.poll().unwrap() {
        s.on_job_done(c.job, c.ok).unwrap();
    }
    let plan = s.schedule().unwrap();
    for j in &plan.jobs {
        b.submit(j.clone()).unwrap();
    }
    for call in &plan.batch {
        assert!(!call.block_table.is_empty() && !call.tokens.is_empty());
        let tok = call.sample.then(|| {
            let seq = s.seq(call.seq).unwrap();
            fake_token(call.seq, seq.output().len())
        });
        s.on_forward_done(call, tok).unwrap();
    }
    if plan.batch.is_empty() && b.in_flight() > 0 {
        for c in b.wait().unwrap() {
            s.on_job_done(c.job, c.ok).unwrap();
        }
    }
    s.check().unwrap();
    plan.jobs
}

#[test]
fn every_residency_transition_is_legal_or_an_error() {
    use Residency::*;
    let events = [
        Move::StartStore(Tier::Cpu),
        Move::StartStore(Tier::Ssd),
        Move::Demote,
        Move::StoreDone,
        Move::StoreFailed,
        Move::StartLoad,
        Move::LoadDone,
        Move::LoadFailed,
    ];
    let legal = [
        (Gpu, Move::StartStore(Tier::Cpu), MovingToCpu),
        (Gpu, Move::StartStore(Tier::Ssd), MovingToSsd),
        (MovingToCpu, Move::StoreDone, Cpu),
        (MovingToSsd, Move::StoreDone, Ssd),
        (MovingToCpu, Move::StoreFailed, Gpu),
        (MovingToSsd, Move::StoreFailed, Gpu),
        (Cpu, Move::StartLoad, MovingToGpu),
        (Ssd, Move::StartLoad, MovingFromSsd),
        (MovingToGpu, Move::LoadDone, Gpu),
        (MovingFromSsd, Move::LoadDone, Gpu),
        (MovingToGpu, Move::LoadFailed, Cpu),
        (MovingFromSsd, Move::LoadFailed, Ssd),
        (Cpu, Move::Demote, MovingCpuToSsd),
        (MovingCpuToSsd, Move::StoreDone, Ssd),
        (MovingCpuToSsd, Move::StoreFailed, Cpu),
    ];
    let mut illegal = 0;
    for from in Residency::ALL {
        for ev in events {
            let want = legal.iter().find(|(f, e, _)| *f == from && *e == ev);
            match (from.apply(ev), want) {
                (Ok(to), Some((_, _, want))) => assert_eq!(to, *want, "{from:?} {ev:?}"),
                (Err(e), None) => {
                    assert_eq!((e.from, e.event), (from, ev));
                    illegal += 1;
                }
                (got, want) => panic!("{from:?} {ev:?}: got {got:?}, want {want:?}"),
            }
        }
    }
    assert_eq!(illegal, Residency::ALL.len() * events.len() - legal.len());
    // Only settled states may be freed.
    assert!(Gpu.is_settled() && Cpu.is_settled() && Ssd.is_settled());
    assert!(!MovingToCpu.is_settled() && !MovingToGpu.is_settled());
    assert!(!MovingCpuToSsd.is_settled());
    // A demotion holds both ends: the host slot it reads and the disk slot it writes.
    assert!(MovingCpuToSsd.holds_host_slot() && MovingCpuToSsd.holds_disk_slot());
    assert!(!MovingCpuToSsd.holds_page());
}

#[test]
fn illegal_block_moves_are_errors_and_change_nothing() {
    let mut bm = BlockManager::new(2, 2);
    let ids = bm.allocate(1).unwrap();
    // Loading a GPU block, finishing a store that never started: errors.
    assert!(matches!(bm.start_load(&ids), Err(BlockError::Illegal(_))));
    assert!(matches!(
        bm.finish_store(ids[0], true),
        Err(BlockError::Illegal(_))
    ));
    assert_eq!(bm.state(ids[0]).unwrap(), Residency::Gpu);
    bm.start_store(&ids, Tier::Cpu).unwrap();
    // Storing twice, or freeing mid-copy: errors.
    assert!(matches!(
        bm.start_store(&ids, Tier::Cpu),
        Err(BlockError::Illegal(_))
    ));
    assert!(matches!(
        bm.release(ids[0], Hold::Windowed),
        Err(BlockError::ReleaseInFlight { .. })
    ));
    bm.check(&[&ids]).unwrap();
}

#[test]
fn failed_jobs_roll_back_without_half_moved_blocks() {
    let mut bm = BlockManager::new(3, 2);
    let ids = bm.allocate(2).unwrap();
    let pages: Vec<_> = ids.iter().map(|&i| bm.resolve(i).unwrap()).collect();
    // A store keeps the page while in flight; failure puts the block back on the GPU.
    bm.start_store(&ids, Tier::Cpu).unwrap();
    assert_eq!((bm.available_pages(), bm.free_slots()), (1, 0));
    assert!(
        bm.resolve(ids[0]).is_err(),
        "a moving block must not resolve"
    );
    for &i in &ids {
        bm.finish_store(i, false).unwrap();
    }
    assert_eq!(bm.state(ids[0]).unwrap(), Residency::Gpu);
    assert_eq!(
        ids.iter()
            .map(|&i| bm.resolve(i).unwrap())
            .collect::<Vec<_>>(),
        pages
    );
    assert_eq!((bm.available_pages(), bm.free_slots()), (1, 2));
    bm.check(&[&ids]).unwrap();
    // A successful store frees the pages; a failed load releases the reserved pages.
    bm.start_store(&ids, Tier::Cpu).unwrap();
    for &i in &ids {
        bm.finish_store(i, true).unwrap();
    }
    assert_eq!((bm.available_pages(), bm.free_slots()), (3, 0));
    bm.start_load(&ids).unwrap();
    assert_eq!(bm.available_pages(), 1);
    for &i in &ids {
        bm.finish_load(i, false).unwrap();
        assert_eq!(bm.state(i).unwrap(), Residency::Cpu);
    }
    assert_eq!((bm.available_pages(), bm.free_slots()), (3, 0));
    bm.check(&[&ids]).unwrap();
    // Not enough host slots: all or nothing.
    let more = bm.allocate(3).unwrap();
    assert!(matches!(
        bm.start_store(&more, Tier::Cpu),
        Err(BlockError::NoSlots { .. })
    ));
    assert!(more.iter().all(|&i| bm.state(i).unwrap() == Residency::Gpu));
    for &i in ids.iter().chain(&more) {
        bm.release(i, Hold::Windowed).unwrap();
    }
    assert_eq!((bm.available_pages(), bm.free_slots()), (3, 2));
    bm.check(&[]).unwrap();
}

#[test]
fn a_loaded_back_block_resolves_to_its_new_page() {
    let mut bm = BlockManager::new(2, 1);
    let a = bm.allocate(1).unwrap()[0];
    let b = bm.allocate(1).unwrap()[0];
    let old = bm.resolve(a).unwrap();
    bm.start_store(&[a], Tier::Cpu).unwrap();
    bm.finish_store(a, true).unwrap();
    let c = bm.allocate(1).unwrap()[0];
    assert_eq!(bm.resolve(c).unwrap(), old, "the freed page is reused");
    bm.release(b, Hold::Windowed).unwrap();
    let moves = bm.start_load(&[a]).unwrap();
    assert!(matches!(bm.resolve(a), Err(BlockError::NotResident { .. })));
    bm.finish_load(a, true).unwrap();
    let new = bm.resolve(a).unwrap();
    assert_eq!(new, moves[0].2);
    assert_ne!(new, old, "block a now lives on a different page");
    assert_eq!(bm.resolve(c).unwrap(), old);
    bm.check(&[&[a], &[c]]).unwrap();
}

/// Runs `n` sequences of `prompt` tokens and `out` outputs on a tight pool to completion,
/// returning the scheduler and every job created.
fn run_tight(
    c: SchedulerConfig,
    prompts: &[Vec<u32>],
    out: usize,
    seed: u64,
) -> (Scheduler, Vec<TransferJob>, Vec<SeqId>) {
    let mut s = Scheduler::new(c).unwrap();
    let mut b = SimBackend::new(seed, 0.5, 0.0);
    let ids: Vec<_> = prompts
        .iter()
        .map(|p| s.add(p.clone(), out, vec![]).unwrap())
        .collect();
    let mut jobs = Vec::new();
    for _ in 0..10_000 {
        if !s.has_unfinished() {
            break;
        }
        jobs.extend(step(&mut s, &mut b));
    }
    assert!(!s.has_unfinished(), "did not finish");
    (s, jobs, ids)
}

#[test]
fn preemption_recomputes_when_the_host_tier_is_full() {
    // Each sequence ends at 12 blocks; 16 pages for 3 of them; host room for 1 block only.
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| vec![5 + i; 24]).collect();
    let (s, jobs, ids) = run_tight(cfg(4, 16, 1, 8), &prompts, 24, 1);
    assert!(s.stats.preemptions > 0);
    assert_eq!(s.stats.recomputations, s.stats.preemptions);
    assert!(jobs.is_empty(), "no store fits the host tier: {jobs:?}");
    for id in ids {
        let out = s.seq(id).unwrap().output().to_vec();
        assert_eq!(out, (0..24).map(|i| fake_token(id, i)).collect::<Vec<_>>());
    }
}

#[test]
fn preemption_offloads_when_the_host_tier_has_room() {
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| vec![5 + i; 24]).collect();
    let (s, jobs, ids) = run_tight(cfg(4, 16, 64, 8), &prompts, 24, 2);
    assert!(s.stats.preemptions > 0);
    assert_eq!(s.stats.recomputations, 0);
    assert!(s.stats.blocks_stored > 0);
    assert_eq!(s.stats.blocks_stored, s.stats.blocks_loaded);
    assert!(jobs.iter().any(|j| j.kind == JobKind::Store));
    for id in ids {
        let out = s.seq(id).unwrap().output().to_vec();
        assert_eq!(out, (0..24).map(|i| fake_token(id, i)).collect::<Vec<_>>());
    }
}

/// Runs the scheduler until nothing is left to do (jobs complete at once).
fn run_to_end(s: &mut Scheduler) {
    let mut b = SimBackend::new(0, 1.0, 0.0);
    for _ in 0..10_000 {
        if !s.has_unfinished() {
            return;
        }
        step(s, &mut b);
    }
    panic!("the scheduler did not finish");
}

#[test]
fn prefix_hits_and_registration_are_per_block_whatever_the_chunk() {
    // vLLM's counts (block 16): a repeated 161-token prompt hits 10 blocks (160 tokens:
    // the last token is always computed); its 64-token prefill chunks do not matter.
    let c = cfg(16, 64, 0, 64);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let prompt: Vec<u32> = (100..261).collect();
    let first = s.add(prompt.clone(), 1, vec![]).unwrap();
    run_to_end(&mut s);
    s.remove_finished(first);
    let second = s.add(prompt.clone(), 1, vec![]).unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(s.stats.prefix_hit_blocks, 10);
    let call = &plan.batch[0];
    assert_eq!((call.seq, call.pos0, call.tokens.len()), (second, 160, 1));
    // A 117-token prompt registers its 7 full blocks (the 8th holds 5 tokens).
    let mut s = Scheduler::new(c.clone()).unwrap();
    let p117: Vec<u32> = (500..617).collect();
    s.add(p117.clone(), 1, vec![]).unwrap();
    run_to_end(&mut s);
    let hashes = prompt_hashes(std::slice::from_ref(&p117), 16);
    assert_eq!(hashes.len(), 7);
    assert!(hashes.iter().all(|&h| s.bm.lookup(h).is_some()));
    // 64 prompt tokens and 100 generated: the 163 computed positions fill 10 blocks, all
    // registered, the 6 of generated tokens included, so a request continuing the
    // conversation hits them.
    let mut s = Scheduler::new(c).unwrap();
    let p64: Vec<u32> = (700..764).collect();
    let id = s.add(p64, 100, vec![]).unwrap();
    run_to_end(&mut s);
    let all = s.remove_finished(id).unwrap().tokens;
    assert_eq!(all.len(), 164);
    let hashes = prompt_hashes(&[all[..160].to_vec()], 16);
    assert!(hashes.iter().all(|&h| s.bm.lookup(h).is_some()));
    assert!(
        s.bm.lookup(prompt_hashes(std::slice::from_ref(&all), 16)[9])
            .is_some(),
        "the last full block"
    );
    let mut follow_up = all.clone();
    follow_up.extend([1, 2, 3]);
    s.add(follow_up, 1, vec![]).unwrap();
    s.schedule().unwrap();
    assert_eq!(s.stats.prefix_hit_blocks, 10);
}

#[test]
fn a_prefix_cache_reset_drops_every_cached_block_only_when_idle() {
    let mut s = Scheduler::new(cfg(4, 32, 0, 8)).unwrap();
    s.bm.record_cache_events();
    let prompt: Vec<u32> = (10..30).collect();
    let id = s.add(prompt.clone(), 4, vec![]).unwrap();
    let mut b = SimBackend::new(0, 1.0, 0.0);
    step(&mut s, &mut b);
    assert!(!s.reset_prefix_cache(), "a running request holds KV");
    run_to_end(&mut s);
    s.remove_finished(id);
    let _ = s.bm.take_cache_events();
    let hashes = prompt_hashes(std::slice::from_ref(&prompt), 4);
    assert!(hashes.iter().all(|&h| s.bm.lookup(h).is_some()));
    assert!(s.reset_prefix_cache());
    assert!(hashes.iter().all(|&h| s.bm.lookup(h).is_none()));
    assert_eq!(s.bm.available_pages(), 32);
    assert_eq!(s.bm.take_cache_events(), vec![CacheEvent::Cleared]);
    s.check().unwrap();
    // The same prompt again computes from its first token.
    s.add(prompt, 1, vec![]).unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(plan.batch[0].pos0, 0);
}

#[test]
fn a_recomputation_replays_its_generated_tokens_in_chunks() {
    // A request with 40 generated tokens that loses its KV (no host tier) and cannot hit
    // the cache (its blocks were evicted) recomputes prompt and output in chunks of 8,
    // not one output token per step.
    let mut s = Scheduler::new(cfg(4, 64, 0, 8)).unwrap();
    let id = s.add((10..18).collect(), 60, vec![]).unwrap();
    let mut b = SimBackend::new(0, 1.0, 0.0);
    while s.seq(id).unwrap().output().len() < 40 {
        step(&mut s, &mut b);
    }
    let seq = s.seq(id).unwrap().clone();
    let chunk = |from: usize| {
        let mut q = seq.clone();
        q.num_computed = from;
        q.next_chunk(8)
    };
    assert_eq!(chunk(0), 0..8, "the prompt");
    assert_eq!(
        chunk(8),
        8..16,
        "generated tokens known already: a whole chunk"
    );
    assert_eq!(chunk(40), 40..48, "up to the last known token");
    assert_eq!(chunk(45), 45..48);
    assert_eq!(chunk(47), 47..48, "decode: one token");
}

#[test]
fn a_victims_shared_prefix_blocks_are_never_offloaded() {
    // Two sequences share a 16-token prefix (4 blocks, 2 chunks); the second is admitted
    // after the first computed it, so it reuses those blocks; pages run out in decode.
    let c = cfg(4, 14, 64, 8);
    let mut s = Scheduler::new(c).unwrap();
    let mut b = SimBackend::new(3, 0.3, 0.0);
    let prefix: Vec<u32> = (10..26).collect();
    let p0: Vec<u32> = prefix.iter().copied().chain([1, 2, 3]).collect();
    let p1: Vec<u32> = prefix.iter().copied().chain([4, 5, 6, 7]).collect();
    let a = s.add(p0, 30, vec![]).unwrap();
    while s.seq(a).unwrap().num_computed < 16 {
        step(&mut s, &mut b);
    }
    let second = s.add(p1, 30, vec![]).unwrap();
    let mut saw_store = false;
    let mut shared_checked = false;
    for _ in 0..10_000 {
        if !s.has_unfinished() {
            break;
        }
        let shared: HashSet<u32> = match (s.seq(a), s.seq(second)) {
            (Some(x), Some(y)) => x
                .block_ids
                .iter()
                .filter(|id| y.block_ids.contains(id))
                .copied()
                .collect(),
            _ => HashSet::new(),
        };
        shared_checked |= !shared.is_empty();
        for j in step(&mut s, &mut b) {
            if j.kind == JobKind::Store {
                saw_store = true;
                for c in &j.copies {
                    assert!(
                        !shared.contains(&c.block),
                        "shared block {} offloaded",
                        c.block
                    );
                }
            }
        }
    }
    assert!(shared_checked, "the prefix was never shared");
    assert!(saw_store, "no preemption offloaded anything");
    assert!(s.stats.prefix_hit_blocks >= 4);
    for id in [a, second] {
        let out = s.seq(id).unwrap().output().to_vec();
        assert_eq!(out, (0..30).map(|i| fake_token(id, i)).collect::<Vec<_>>());
    }
}

#[test]
fn a_page_under_an_in_flight_store_is_not_reused() {
    // Completions arrive late (5% per poll) and in random order.
    for seed in 0..8 {
        let mut s = Scheduler::new(cfg(4, 20, 64, 8)).unwrap();
        let mut b = SimBackend::new(seed, 0.05, 0.0);
        let mut rng = StdRng::seed_from_u64(seed);
        for _ in 0..5 {
            let n = rng.random_range(5..30);
            s.add(
                (0..n).map(|_| rng.random_range(3..90)).collect(),
                20,
                vec![],
            )
            .unwrap();
        }
        let mut stores: Vec<TransferJob> = Vec::new();
        let mut checked = 0;
        for _ in 0..20_000 {
            if !s.has_unfinished() {
                break;
            }
            for c in b.poll().unwrap() {
                stores.retain(|j| j.id != c.job);
                s.on_job_done(c.job, c.ok).unwrap();
            }
            let plan = s.schedule().unwrap();
            for j in &plan.jobs {
                b.submit(j.clone()).unwrap();
                if j.kind == JobKind::Store {
                    stores.push(j.clone());
                }
            }
            let busy: HashSet<u32> = stores
                .iter()
                .flat_map(|j| j.copies.iter())
                .map(|c| match c.src {
                    Loc::Gpu(p) => p.page,
                    _ => unreachable!(),
                })
                .collect();
            for j in plan.jobs.iter().filter(|j| j.kind == JobKind::Load) {
                for c in &j.copies {
                    let Loc::Gpu(GpuPages { page: p, .. }) = c.dst else {
                        unreachable!()
                    };
                    assert!(!busy.contains(&p), "load into page {p} under a store");
                }
            }
            for call in &plan.batch {
                for p in &call.block_table {
                    assert!(
                        !busy.contains(p),
                        "page {p} scheduled under an in-flight store"
                    );
                }
                checked += usize::from(!busy.is_empty());
                let tok = call
                    .sample
                    .then(|| fake_token(call.seq, s.seq(call.seq).unwrap().output().len()));
                s.on_forward_done(call, tok).unwrap();
            }
            if plan.batch.is_empty() && b.in_flight() > 0 {
                for c in b.wait().unwrap() {
                    stores.retain(|j| j.id != c.job);
                    s.on_job_done(c.job, c.ok).unwrap();
                }
            }
            s.check().unwrap();
        }
        assert!(!s.has_unfinished());
        assert!(
            s.stats.blocks_stored > 0,
            "seed {seed}: nothing was offloaded"
        );
        assert!(
            checked > 0,
            "seed {seed}: nothing ran while a store was in flight"
        );
    }
}

/// The tiers a property run has below the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tiers {
    /// Host memory only (or nothing: some cases have no host tier).
    Host,
    /// Host memory and disk: victims, demotions from a full host tier, write-throughs.
    HostAndDisk,
}

/// What a property run moved, summed over its cases (so the test can insist that every
/// path it claims to cover was taken).
#[derive(Debug, Default)]
struct Moved {
    stored: usize,
    to_disk: usize,
    from_disk: usize,
    demoted: usize,
    demotion_failures: usize,
    persisted: usize,
    events_stored: usize,
    events_removed: usize,
    /// Sliding-window group removals while the block's full layers were still announced.
    window_events_removed: usize,
    /// Block-steps where a held, resident block had let its window page go.
    window_dropped: usize,
}

/// A router's view of the prefix cache, rebuilt from nothing but the cache events: the
/// full layers' blocks on the GPU and on disk, and (with a window pool) the blocks whose
/// windowed layers' KV is still on the GPU too (the sliding-window group).
#[derive(Default)]
struct EventMirror {
    gpu: HashSet<BlockKey>,
    gpu_window: HashSet<BlockKey>,
    disk: HashSet<BlockKey>,
    /// The window the sliding-window group's events must name.
    window: Option<usize>,
    stored: usize,
    removed: usize,
    /// Sliding-window group removals while the full layers were still announced.
    window_removed: usize,
}

impl EventMirror {
    fn tier(&mut self, medium: Medium, group: KvGroup, case: u64) -> &mut HashSet<BlockKey> {
        match (medium, group) {
            (Medium::Gpu, KvGroup::Full) => &mut self.gpu,
            (Medium::Gpu, KvGroup::Window { tokens }) => {
                assert_eq!(Some(tokens), self.window, "case {case}: the group's window");
                &mut self.gpu_window
            }
            (Medium::Disk, KvGroup::Full) => &mut self.disk,
            (Medium::Disk, g) => panic!("case {case}: a disk copy is whole, not {g:?}"),
        }
    }

    /// Applies the events since the last step (each `Stored` block's hash must be its
    /// parent's and tokens' chained hash; nothing stored twice or removed unseen), then
    /// checks the view against what a lookup finds, for every hash a prompt can make.
    fn sync(&mut self, s: &mut Scheduler, universe: &HashSet<BlockKey>, bs: usize, case: u64) {
        for e in s.bm.take_cache_events() {
            match e {
                CacheEvent::Stored {
                    medium,
                    group,
                    parent,
                    hashes,
                    tokens,
                } => {
                    assert_eq!(tokens.len(), hashes.len() * bs, "case {case}");
                    let mut prev = parent;
                    for (h, t) in hashes.iter().zip(tokens.chunks(bs)) {
                        assert_eq!(
                            block_key(prev, t),
                            *h,
                            "case {case}: a hash is not its tokens'"
                        );
                        prev = Some(*h);
                    }
                    for h in hashes {
                        assert!(
                            self.tier(medium, group, case).insert(h),
                            "case {case}: {medium:?} {group:?} block {h} stored twice"
                        );
                        self.stored += 1;
                    }
                }
                CacheEvent::Removed {
                    medium,
                    group,
                    hashes,
                } => {
                    for h in hashes {
                        assert!(
                            self.tier(medium, group, case).remove(&h),
                            "case {case}: {medium:?} {group:?} block {h} removed unseen"
                        );
                        if group != KvGroup::Full && self.gpu.contains(&h) {
                            self.window_removed += 1;
                        }
                        self.removed += 1;
                    }
                }
                CacheEvent::Cleared => panic!("case {case}: the scheduler never clears"),
            }
        }
        for &h in universe {
            let on_gpu = s.bm.lookup(h);
            let (gpu, disk) = (on_gpu.is_some(), s.bm.is_persisted(h));
            assert_eq!(self.gpu.contains(&h), gpu, "case {case}: GPU view of {h}");
            let window = on_gpu.is_some_and(|id| {
                self.window.is_some() && s.bm.block(id).unwrap().win_page.is_some()
            });
            assert_eq!(
                self.gpu_window.contains(&h),
                window,
                "case {case}: GPU window-group view of {h}"
            );
            assert_eq!(
                self.disk.contains(&h),
                disk,
                "case {case}: disk view of {h}"
            );
        }
    }
}

/// A block's key in a scheduler made by `Scheduler::new` (the anonymous seed).
fn block_key(parent: Option<BlockKey>, tokens: &[u32]) -> BlockKey {
    BlockKey::chained(&KeySeed::default(), parent.as_ref(), tokens)
}

/// Every full block's chained key of every token sequence.
fn prompt_hashes(prompts: &[Vec<u32>], bs: usize) -> Vec<BlockKey> {
    let mut all = Vec::new();
    for p in prompts {
        let mut prev = None;
        for block in p.chunks_exact(bs) {
            let h = block_key(prev, block);
            all.push(h);
            prev = Some(h);
        }
    }
    all
}

/// The randomized property test, for either tier set: random arrivals, lengths, shared
/// prefixes, tier capacities, batch limits, and completion orders and failures (the
/// simulated backend finishes jobs late, in random order, and fails some, demotions
/// included). After every step `Scheduler::check` verifies reference counts, one owner per
/// page / host slot / disk slot, every scheduled block resident, and the host LRU naming
/// exactly the host-resident requests, and the cache events rebuild exactly the blocks a
/// lookup finds on each tier (`EventMirror`); at the end every request has exactly its
/// expected tokens and every page and slot is free. `windowed`: a sliding-window model
/// (random window) with a window pool of random size, so window pages run short too; the
/// check then also verifies every block's window references against its holders' windows.
fn property_run(tiers: Tiers, cases: u64, windowed: bool) -> Moved {
    let mut moved = Moved::default();
    for case in 0..cases {
        let mut rng = StdRng::seed_from_u64(1000 + case);
        let bs: usize = [1, 2, 4, 8][rng.random_range(0..4)];
        let chunk = bs * rng.random_range(1..4);
        let max_len: usize = rng.random_range(4..60);
        let gpu = max_len.div_ceil(bs) + rng.random_range(0..20);
        let cpu = [0, 1, 3, 8, 100][rng.random_range(0..5)];
        let disk = match tiers {
            Tiers::Host => 0,
            Tiers::HostAndDisk => [1, 4, 16, 100][rng.random_range(0..4)],
        };
        let c = SchedulerConfig {
            block_size: bs,
            num_gpu_blocks: gpu,
            max_cpu_offload_blocks: cpu,
            max_disk_offload_blocks: disk,
            max_num_seqs: rng.random_range(1..8),
            max_num_batched_tokens: chunk * rng.random_range(1..4),
            prefill_chunk: chunk,
        };
        let window = windowed.then(|| {
            let w = rng.random_range(1..=max_len + 2);
            let per_seq = (w - 1 + chunk).div_ceil(bs) + 1;
            let most = window_pool_pages(&c, w);
            (w, rng.random_range(per_seq.min(most)..=most))
        });
        let mut s = Scheduler::new(c).unwrap();
        if let Some((w, pages)) = window {
            s.use_window_pool(w, pages).unwrap();
        }
        s.bm.record_cache_events();
        let mut mirror = EventMirror {
            window: window.map(|(w, _)| w),
            ..EventMirror::default()
        };
        let mut b = SimBackend::new(
            case,
            rng.random_range(0.05..1.0),
            rng.random_range(0.0..0.3),
        );
        let n = rng.random_range(1..12);
        // Shared prefixes are common, so the prefix cache is exercised.
        let prefix: Vec<u32> = (0..max_len).map(|_| rng.random_range(3..20)).collect();
        let mut pending: Vec<(usize, Vec<u32>, usize)> = (0..n)
            .map(|_| {
                let total = rng.random_range(2..=max_len);
                let out = rng.random_range(1..total);
                let plen = total - out;
                let keep = rng.random_range(0..=plen);
                let mut p = prefix[..keep].to_vec();
                p.extend((keep..plen).map(|_| rng.random_range(3..20)));
                (rng.random_range(0..40), p, out)
            })
            .collect();
        let prompts: Vec<Vec<u32>> = pending.iter().map(|(_, p, _)| p.clone()).collect();
        // Every full block a sequence can have, generated ones included (they enter the
        // prefix cache too), collected as the outputs grow.
        let mut universe: HashSet<BlockKey> = prompt_hashes(&prompts, bs).into_iter().collect();
        let mut ids = Vec::new();
        let mut t = 0;
        while (s.has_unfinished() || !pending.is_empty()) && t < 50_000 {
            pending.retain(|(at, p, out)| {
                let due = *at <= t;
                if due {
                    ids.push((s.add(p.clone(), *out, vec![]).unwrap(), *out));
                }
                !due
            });
            step(&mut s, &mut b);
            for &(id, _) in &ids {
                if let Some(q) = s.seq(id) {
                    universe.extend(prompt_hashes(std::slice::from_ref(&q.tokens), bs));
                }
            }
            mirror.sync(&mut s, &universe, bs, case);
            for &(id, _) in &ids {
                for &block in s.seq(id).map_or(&[][..], |q| &q.block_ids[..]) {
                    let b = s.bm.block(block).unwrap();
                    let pool = s.bm.num_window_pages().is_some();
                    if pool && b.state == Residency::Gpu && b.win_page.is_none() {
                        moved.window_dropped += 1;
                    }
                }
            }
            t += 1;
        }
        assert!(
            !s.has_unfinished() && pending.is_empty(),
            "{tiers:?} case {case} did not finish"
        );
        while b.in_flight() > 0 {
            for c in b.wait().unwrap() {
                s.on_job_done(c.job, c.ok).unwrap();
            }
        }
        s.check().unwrap();
        mirror.sync(&mut s, &universe, bs, case);
        moved.events_stored += mirror.stored;
        moved.window_events_removed += mirror.window_removed;
        moved.events_removed += mirror.removed;
        for (id, out) in ids {
            let want: Vec<u32> = (0..out).map(|i| fake_token(id, i)).collect();
            assert_eq!(
                s.seq(id).unwrap().output(),
                &want[..],
                "{tiers:?} case {case}"
            );
        }
        let bm = &s.bm;
        assert_eq!(
            bm.available_pages(),
            bm.num_pages()
                .min(bm.num_window_pages().unwrap_or(usize::MAX)),
            "case {case}: pages (or window pages) leaked"
        );
        assert_eq!(
            bm.free_slots(),
            bm.num_slots(),
            "case {case}: host slots leaked"
        );
        assert_eq!(
            bm.free_disk_slots() + bm.num_persisted(),
            bm.num_disk_slots(),
            "case {case}: disk slots leaked"
        );
        if let Some((_, pages)) = window {
            assert_eq!(bm.num_window_pages(), Some(pages));
        }
        let st = &s.stats;
        moved.stored += st.blocks_stored;
        moved.to_disk += st.blocks_stored_disk;
        moved.from_disk += st.blocks_loaded_disk;
        moved.demoted += st.blocks_demoted;
        moved.demotion_failures += st.demotion_failures;
        moved.persisted += st.prefix_blocks_persisted;
    }
    moved
}

#[test]
fn property_two_tiers_random_arrivals_lengths_capacities_and_completion_orders() {
    let m = property_run(Tiers::Host, 60, false);
    assert!(m.stored > 0, "{m:?}");
    assert_eq!(m.window_dropped, 0, "{m:?}");
    assert!(m.events_stored > 0 && m.events_removed > 0, "{m:?}");
    assert_eq!(
        m.to_disk + m.from_disk + m.demoted + m.persisted,
        0,
        "{m:?}"
    );
}

#[test]
fn property_three_tiers_with_demotions_and_faults_in_random_orders() {
    let m = property_run(Tiers::HostAndDisk, 1000, false);
    assert!(m.events_stored > 0 && m.events_removed > 0, "{m:?}");
    assert!(
        m.to_disk > 0 && m.from_disk > 0 && m.persisted > 0,
        "the disk tier was not exercised: {m:?}"
    );
    assert!(
        m.demoted > 0 && m.demotion_failures > 0,
        "demotions (and failed ones) were not exercised: {m:?}"
    );
}

/// A sliding-window model with a window pool (random windows, random pool sizes down to
/// one sequence's window): everything the two property tests check, and every block's
/// window references equal its holders whose window reaches it, each holder letting go of
/// a block as soon as its window moves past (`Scheduler::check`); blocks do drop their
/// window pages while held.
#[test]
fn property_window_pool_frees_blocks_out_of_every_window_across_all_tiers() {
    for tiers in [Tiers::Host, Tiers::HostAndDisk] {
        let m = property_run(tiers, 80, true);
        assert!(m.window_dropped > 0, "{tiers:?}: {m:?}");
        assert!(m.stored > 0 && m.events_stored > 0, "{tiers:?}: {m:?}");
        assert!(m.window_events_removed > 0, "{tiers:?}: {m:?}");
        if tiers == Tiers::HostAndDisk {
            assert!(m.to_disk > 0 && m.from_disk > 0 && m.persisted > 0, "{m:?}");
        }
    }
}

#[test]
fn demotion_takes_the_least_recently_preempted_request_first() {
    // Jobs complete at the next poll and never fail, so every store of an earlier step is
    // done when the scheduler picks what to demote. The test keeps its own model of the
    // host tier's order from the jobs alone and checks each demotion against it.
    let mut demoted = 0;
    for case in 0..40u64 {
        let mut rng = StdRng::seed_from_u64(500 + case);
        let c = SchedulerConfig {
            block_size: 4,
            num_gpu_blocks: rng.random_range(14..30),
            max_cpu_offload_blocks: rng.random_range(4..16),
            max_disk_offload_blocks: 200,
            max_num_seqs: 8,
            max_num_batched_tokens: 16,
            prefill_chunk: 4,
        };
        let mut s = Scheduler::new(c).unwrap();
        let mut b = SimBackend::new(case, 1.0, 0.0);
        let ids: Vec<SeqId> = (0..rng.random_range(6..10))
            .map(|_| {
                let p = (0..rng.random_range(4..16))
                    .map(|_| rng.random_range(3..90))
                    .collect();
                s.add(p, rng.random_range(10..40), vec![]).unwrap()
            })
            .collect();
        let owner = |s: &Scheduler, block: u32| -> SeqId {
            *ids.iter()
                .find(|&&id| s.seq(id).unwrap().block_ids.contains(&block))
                .expect("a job's blocks belong to a request")
        };
        let mut lru: Vec<SeqId> = Vec::new(); // host-resident, least recently preempted first
        for _ in 0..20_000 {
            if !s.has_unfinished() {
                break;
            }
            for c in b.poll().unwrap() {
                s.on_job_done(c.job, c.ok).unwrap();
            }
            let plan = s.schedule().unwrap();
            let mut stored_now = Vec::new();
            for j in &plan.jobs {
                let (src, dst) = (j.copies[0].src, j.copies[0].dst);
                // (A write-through to disk may copy a finished request's blocks: no owner.)
                let seq = || owner(&s, j.copies[0].block);
                match (src, dst) {
                    (Loc::Gpu(_), Loc::Host(..)) => {
                        lru.push(seq());
                        stored_now.push(seq());
                    }
                    (Loc::Host(..), Loc::Gpu(_)) => {
                        let seq = seq();
                        lru.retain(|&x| x != seq)
                    }
                    (Loc::Host(..), Loc::Disk { .. }) => {
                        let seq = seq();
                        let want = lru.iter().find(|x| !stored_now.contains(x)).copied();
                        assert_eq!(Some(seq), want, "case {case}: demoted out of order");
                        lru.retain(|&x| x != seq);
                        demoted += 1;
                    }
                    _ => {}
                }
                b.submit(j.clone()).unwrap();
            }
            for call in &plan.batch {
                let tok = call
                    .sample
                    .then(|| fake_token(call.seq, s.seq(call.seq).unwrap().output().len()));
                s.on_forward_done(call, tok).unwrap();
            }
            if plan.batch.is_empty() && b.in_flight() > 0 {
                for c in b.wait().unwrap() {
                    s.on_job_done(c.job, c.ok).unwrap();
                }
            }
            s.check().unwrap();
            // A request recomputed while host-resident leaves the host tier.
            lru.retain(|&x| {
                s.seq(x).unwrap().block_ids.iter().any(|&id| {
                    matches!(
                        s.bm.state(id).unwrap(),
                        Residency::Cpu | Residency::MovingToCpu
                    )
                })
            });
        }
        assert!(!s.has_unfinished(), "case {case} did not finish");
    }
    assert!(demoted > 0, "no demotion happened");
}
