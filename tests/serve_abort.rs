//! Cancelling requests in the serving engine (a client that went away): a request aborted
//! while waiting, running, preempted to the host tier, or with a transfer over its blocks
//! in flight gives back every GPU page and host slot, and the requests left running keep
//! exactly the tokens of an undisturbed run.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use common::{scratch_dir, TinySpec};
use rand::{rngs::StdRng, Rng, SeedableRng};
use strata::model::Model;
use strata::serve::scheduler::SeqStatus;
use strata::serve::transfer::ChaosBackend;
use strata::serve::{Engine, EngineConfig, RequestParams, SchedulerConfig};

fn config(gpu: usize, cpu: usize) -> EngineConfig {
    EngineConfig {
        kv_dtype: strata::device::KvDtype::F32,
        sched: SchedulerConfig {
            block_size: 4,
            num_gpu_blocks: gpu,
            max_cpu_offload_blocks: cpu,
            max_disk_offload_blocks: 0,
            max_num_seqs: 16,
            max_num_batched_tokens: 16,
            prefill_chunk: 8,
        },
        link_gbps: 0.0,
        sanitize: true,
        check_order: strata::device::order::on_by_default(),
        disk: None,
    }
}

#[test]
fn aborted_requests_in_every_state_free_all_pages_and_slots_and_spare_the_others() {
    let dir = scratch_dir("serve_abort");
    TinySpec::llama().write(&dir, 7);
    let model: Arc<Model> = Model::load(&dir, false).unwrap().0;
    let mut rng = StdRng::seed_from_u64(5);
    let n = 12;
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|_| {
            (0..rng.random_range(10..60))
                .map(|_| rng.random_range(3..300))
                .collect()
        })
        .collect();
    let params: Vec<RequestParams> = (0..n)
        .map(|_| RequestParams {
            max_tokens: rng.random_range(10..40),
            ignore_eos: true,
            ..Default::default()
        })
        .collect();
    let ws: usize = prompts
        .iter()
        .zip(&params)
        .map(|(p, r)| (p.len() + r.max_tokens).div_ceil(4))
        .sum();
    let want = Engine::new(model.clone(), config(ws, 0))
        .unwrap()
        .generate(&prompts, &params)
        .unwrap();

    let mut states_aborted = BTreeSet::new();
    let mut deferred = 0;
    for seed in 0..6u64 {
        let (gpu, cpu) = (ws / 3, 1000);
        let mut e = Engine::with_backend(model.clone(), config(gpu, cpu), |b| {
            Box::new(ChaosBackend::new(b, seed, 0.3, 0.1))
        })
        .unwrap();
        let ids: Vec<u64> = prompts
            .iter()
            .zip(&params)
            .map(|(p, r)| e.add_request(p.clone(), r).unwrap())
            .collect();
        // Every third request is aborted the first time it is seen in its target state
        // (after the first steps, so some have been preempted and offloaded by then).
        let targets = [SeqStatus::Preempted, SeqStatus::Running, SeqStatus::Waiting];
        let mut to_abort: HashMap<usize, SeqStatus> = (0..n)
            .filter(|i| i % 3 == 1)
            .map(|i| (i, targets[(i / 3 + seed as usize) % 3]))
            .collect();
        let aborted_set: BTreeSet<usize> = to_abort.keys().copied().collect();
        let mut got: HashMap<usize, Vec<u32>> = HashMap::new();
        let mut step = 0;
        while e.has_unfinished() {
            if step >= 3 {
                let due: Vec<usize> = to_abort
                    .iter()
                    .filter(|(&i, &want)| {
                        e.scheduler().seq(ids[i]).is_some_and(|s| s.status == want)
                    })
                    .map(|(&i, _)| i)
                    .collect();
                for i in due {
                    let state = to_abort.remove(&i).unwrap();
                    states_aborted.insert(format!("{state:?}"));
                    e.abort(ids[i]).unwrap();
                    if e.scheduler().seq(ids[i]).is_some() {
                        deferred += 1; // a copy over its blocks is in flight
                    }
                    e.scheduler().check().unwrap();
                }
            }
            for id in e.step().unwrap() {
                let i = ids.iter().position(|&x| x == id).unwrap();
                got.insert(i, e.take_finished(id).unwrap().output().to_vec());
            }
            e.scheduler().check().unwrap();
            step += 1;
        }
        for i in 0..n {
            if aborted_set.contains(&i) && !to_abort.contains_key(&i) {
                assert!(!got.contains_key(&i), "aborted request {i} finished");
                assert!(
                    e.scheduler().seq(ids[i]).is_none(),
                    "aborted request {i} remembered"
                );
                continue;
            }
            assert_eq!(
                got[&i], want[i],
                "seed {seed}: request {i} changed by the aborts"
            );
        }
        let bm = &e.scheduler().bm;
        assert_eq!(
            bm.available_pages(),
            bm.num_pages(),
            "seed {seed}: GPU pages leaked"
        );
        assert_eq!(
            bm.free_slots(),
            bm.num_slots(),
            "seed {seed}: host slots leaked"
        );
        assert!(
            e.stats().sched.blocks_stored > 0,
            "seed {seed}: no offload happened"
        );
    }
    for s in ["Running", "Waiting", "Preempted"] {
        assert!(
            states_aborted.contains(s),
            "no abort while {s}: {states_aborted:?}"
        );
    }
    assert!(deferred > 0, "no abort happened with a transfer in flight");
}
