//! A mixture-of-experts block on the CPU device: the router picks each token's experts,
//! each expert runs once over the rows routed to it (prefill groups tokens by expert;
//! decode reads only the chosen experts' weights), and each token sums its experts'
//! outputs in a fixed order, so a row's result never depends on the rest of the batch.

use super::config::{ExpertAct, Moe};
use super::op_times::{timed, Op};
use super::weights::{Experts, SharedExpert};
use crate::device::cpu::ops;

/// One token's choice: an expert and its weight.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    pub expert: usize,
    pub weight: f32,
}

/// Each row's `top_k` experts from its router logits `[rows, num_experts]`: the largest
/// logits (a tie goes to the lower index), weighted by a softmax over the chosen logits
/// (transformers' `GptOssTopKRouter`), in ascending expert order (the order the outputs
/// are summed in, as transformers' loop over the experts adds them).
pub fn route(logits: &[f32], moe: Moe) -> Vec<Vec<Choice>> {
    logits
        .chunks_exact(moe.num_experts)
        .map(|row| {
            // A NaN logit ranks below every number: never chosen over one.
            let key = |x: usize| {
                if row[x].is_nan() {
                    f32::NEG_INFINITY
                } else {
                    row[x]
                }
            };
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
            let chosen = &order[..moe.top_k];
            let max = row[chosen[0]];
            let e: Vec<f32> = chosen.iter().map(|&x| (row[x] - max).exp()).collect();
            let sum: f32 = e.iter().sum();
            let mut c: Vec<Choice> = chosen
                .iter()
                .zip(&e)
                .map(|(&expert, &e)| Choice {
                    expert,
                    weight: e / sum,
                })
                .collect();
            c.sort_by_key(|c| c.expert);
            c
        })
        .collect()
}

/// `out[rows, hidden]` = the experts' weighted outputs for the normalised rows
/// `x[rows, hidden]`; each expert's `inter` is `ModelConfig::intermediate_size`.
pub fn forward(w: &Experts, moe: Moe, inter: usize, x: &[f32], out: &mut [f32], rows: usize) {
    let h = x.len() / rows.max(1);
    let mut logits = vec![0.0f32; rows * moe.num_experts]; // [rows, num_experts]
    timed(Op::GateUp, || {
        ops::linear_weight(x, &w.router, w.router_bias.as_deref(), &mut logits, rows)
    });
    let choices = route(&logits, moe);
    // Which (row, slot) each expert serves, rows ascending.
    let mut served: Vec<Vec<(usize, usize)>> = vec![Vec::new(); moe.num_experts];
    for (r, c) in choices.iter().enumerate() {
        for (slot, c) in c.iter().enumerate() {
            served[c.expert].push((r, slot));
        }
    }
    let mut y = vec![0.0f32; rows * moe.top_k * h]; // [rows, top_k, hidden]: each slot's output
    for (e, rs) in served.iter().enumerate().filter(|(_, rs)| !rs.is_empty()) {
        let ex = &w.experts[e];
        let m = rs.len();
        let xin: Vec<f32> = rs
            .iter()
            .flat_map(|&(r, _)| &x[r * h..(r + 1) * h])
            .copied()
            .collect(); // [m, hidden]
        let mut gu = vec![0.0f32; m * 2 * inter]; // [m, gate | up]
        timed(Op::GateUp, || {
            ops::linear_weight(&xin, &ex.gate_up, ex.gate_up_bias.as_deref(), &mut gu, m)
        });
        let mut act = vec![0.0f32; m * inter]; // [m, inter]
        match moe.act {
            ExpertAct::ClampedSwiglu { alpha, limit } => {
                ops::clamped_swiglu_mul(&gu, inter, alpha, limit, &mut act)
            }
            ExpertAct::Silu => ops::gated_act(crate::device::MlpAct::Silu, &gu, inter, &mut act),
        }
        let mut down = vec![0.0f32; m * h]; // [m, hidden]
        timed(Op::Down, || {
            ops::linear_weight(&act, &ex.down, ex.down_bias.as_deref(), &mut down, m)
        });
        for (&(r, slot), d) in rs.iter().zip(down.chunks_exact(h)) {
            y[(r * moe.top_k + slot) * h..][..h].copy_from_slice(d);
        }
    }
    for (r, (o, c)) in out.chunks_exact_mut(h).zip(&choices).enumerate() {
        o.fill(0.0);
        for (slot, c) in c.iter().enumerate() {
            let ys = &y[(r * moe.top_k + slot) * h..][..h];
            for (o, y) in o.iter_mut().zip(ys) {
                *o += y * c.weight;
            }
        }
    }
    if let (Some(s), Some(si)) = (&w.shared, moe.shared_intermediate) {
        shared_expert(s, si, x, out, rows);
    }
}

/// Adds the shared expert's output, scaled by σ(its gate), to each row of `out`
/// (transformers' `Qwen3_5MoeSparseMoeBlock`: routed + σ(g·x) · shared(x)).
fn shared_expert(s: &SharedExpert, inter: usize, x: &[f32], out: &mut [f32], rows: usize) {
    let h = x.len() / rows.max(1);
    let mut gu = vec![0.0f32; rows * 2 * inter]; // [rows, gate | up]
    timed(Op::GateUp, || {
        ops::linear_weight(x, &s.gate_up, None, &mut gu, rows)
    });
    let mut act = vec![0.0f32; rows * inter]; // [rows, inter]
    ops::gated_act(crate::device::MlpAct::Silu, &gu, inter, &mut act);
    let mut down = vec![0.0f32; rows * h]; // [rows, hidden]
    timed(Op::Down, || {
        ops::linear_weight(&act, &s.down, None, &mut down, rows)
    });
    let mut gate = vec![0.0f32; rows]; // [rows, 1]
    ops::linear_weight(x, &s.gate, None, &mut gate, rows);
    for ((o, d), g) in out.chunks_exact_mut(h).zip(down.chunks_exact(h)).zip(&gate) {
        let g = ops::sigmoid(*g);
        for (o, d) in o.iter_mut().zip(d) {
            *o += g * d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOE: Moe = Moe {
        num_experts: 5,
        top_k: 2,
        act: ExpertAct::ClampedSwiglu {
            alpha: 1.702,
            limit: 7.0,
        },
        shared_intermediate: None,
        biases: true,
    };

    #[test]
    fn routes_to_the_largest_logits_with_a_softmax_over_them() {
        let c = route(&[0.5, 3.0, -1.0, 2.0, 2.0], MOE);
        // 3.0 (expert 1), then the tie at 2.0 goes to expert 3; listed by expert.
        let (a, b) = (
            1.0 / (1.0 + (-1.0f32).exp()),
            (-1.0f32).exp() / (1.0 + (-1.0f32).exp()),
        );
        assert_eq!(c[0][0].expert, 1);
        assert_eq!(c[0][1].expert, 3);
        assert!((c[0][0].weight - a).abs() < 1e-6 && (c[0][1].weight - b).abs() < 1e-6);
    }

    #[test]
    fn a_nan_logit_is_never_chosen() {
        let c = route(&[f32::NAN, 0.0, 1.0, -1.0, f32::NAN], MOE);
        let chosen: Vec<usize> = c[0].iter().map(|c| c.expert).collect();
        assert_eq!(chosen, vec![1, 2]);
    }
}
