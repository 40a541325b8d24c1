//! Where a CPU step's time goes, op by op: wall time of each of a layer's matmuls, its
//! attention and the LM head, summed while a [`Recording`] is open on the thread that runs
//! the model (`strata bench decode --ops`). The ops run on that thread (their parallel
//! parts join before they return), so a thread-local sum sees all of each op and nothing
//! of another model's steps on another thread. Off, an op costs one thread-local read.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// The timed ops of a CPU step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// The fused Q/K/V projection.
    Qkv,
    /// Storing the new K/V rows and attending over the cache (sparse decode: choosing the
    /// rows too).
    Attention,
    /// The attention output projection.
    OutProj,
    /// The MLP's fused gate and up projection.
    GateUp,
    /// The MLP's down projection.
    Down,
    /// The LM head on the rows sampled from.
    LmHead,
}

impl Op {
    pub const ALL: [Op; 6] = [
        Op::Qkv,
        Op::Attention,
        Op::OutProj,
        Op::GateUp,
        Op::Down,
        Op::LmHead,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::Qkv => "qkv",
            Op::Attention => "attention",
            Op::OutProj => "out_proj",
            Op::GateUp => "gate_up",
            Op::Down => "down",
            Op::LmHead => "lm_head",
        }
    }
}

/// Time spent in each op (indexed as `Op::ALL`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpTimes([Duration; Op::ALL.len()]);

impl OpTimes {
    pub fn get(&self, op: Op) -> Duration {
        self.0[op as usize]
    }

    pub fn total(&self) -> Duration {
        self.0.iter().sum()
    }

    fn add(&mut self, op: Op, d: Duration) {
        self.0[op as usize] += d;
    }
}

impl std::ops::AddAssign for OpTimes {
    fn add_assign(&mut self, other: Self) {
        for op in Op::ALL {
            self.add(op, other.get(op));
        }
    }
}

thread_local! {
    /// The open recording's sums on this thread, if one is open.
    static OPEN: Cell<Option<OpTimes>> = const { Cell::new(None) };
}

/// Runs `f` as `op`, adding its wall time to this thread's open recording, if any.
#[inline]
pub fn timed<R>(op: Op, f: impl FnOnce() -> R) -> R {
    if OPEN.get().is_none() {
        return f();
    }
    let start = Instant::now();
    let r = f();
    let d = start.elapsed();
    OPEN.with(|open| {
        if let Some(mut t) = open.get() {
            t.add(op, d);
            open.set(Some(t));
        }
    });
    r
}

/// Records the ops this thread runs from `start` to `finish` (dropped unfinished, it just
/// stops). One at a time per thread: a second `start` restarts the sums.
pub struct Recording(());

impl Recording {
    pub fn start() -> Self {
        OPEN.set(Some(OpTimes::default()));
        Self(())
    }

    /// The sums so far; recording stops.
    pub fn finish(self) -> OpTimes {
        OPEN.take().unwrap_or_default()
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        OPEN.set(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spin(d: Duration) {
        let t = Instant::now();
        while t.elapsed() < d {}
    }

    #[test]
    fn a_recording_sums_each_op_and_only_while_open() {
        let ms = Duration::from_millis(1);
        timed(Op::Qkv, || spin(ms)); // before: not counted
        let rec = Recording::start();
        timed(Op::Down, || spin(2 * ms));
        timed(Op::Down, || spin(ms));
        assert_eq!(timed(Op::LmHead, || 7), 7, "the op's result passes through");
        let t = rec.finish();
        assert!(t.get(Op::Down) >= 3 * ms, "{t:?}");
        assert!(t.get(Op::Down) < 50 * ms, "{t:?}");
        assert_eq!(t.get(Op::Qkv), Duration::ZERO, "an op before start counted");
        assert!(t.total() >= t.get(Op::Down) + t.get(Op::LmHead));
        timed(Op::Qkv, || spin(ms)); // after finish: not counted anywhere
        assert_eq!(Recording::start().finish(), OpTimes::default());
    }

    /// Every op of a decode step is timed (an op left unwrapped would read zero), their sum
    /// fits in the step, and recording changes no result.
    #[test]
    fn a_decode_step_records_every_op_and_the_same_logits() {
        use crate::kv::ContiguousKv;
        use crate::model::random::{random_weights, Shape};
        use crate::model::Model;
        let cfg = Shape::tiny().config();
        let model = Model::new(cfg.clone(), random_weights(&cfg, 5, Shape::tiny().qk_gain));
        let prompt: Vec<u32> = (0..24).map(|i| (i * 31 % cfg.vocab_size) as u32).collect();
        let step = |record: bool| {
            let mut kv =
                ContiguousKv::<f32>::of(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 32);
            model.forward(&prompt, 0, &mut kv).unwrap();
            let rec = record.then(Recording::start);
            let t = Instant::now();
            let logits = model.forward(&[7], prompt.len(), &mut kv).unwrap();
            let wall = t.elapsed();
            (logits, rec.map(Recording::finish), wall)
        };
        let (plain, none, _) = step(false);
        let (recorded, times, wall) = step(true);
        assert!(none.is_none());
        assert_eq!(
            plain.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            recorded.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let times = times.unwrap();
        for op in Op::ALL {
            assert!(times.get(op) > Duration::ZERO, "{} not timed", op.name());
        }
        assert!(times.total() <= wall, "{times:?} > {wall:?}");
    }

    #[test]
    fn another_threads_ops_are_not_in_this_threads_recording() {
        let rec = Recording::start();
        std::thread::spawn(|| timed(Op::Attention, || spin(Duration::from_millis(2))))
            .join()
            .unwrap();
        assert_eq!(rec.finish().get(Op::Attention), Duration::ZERO);
    }
}
