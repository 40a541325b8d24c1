//! Gated DeltaNet, the linear-attention token mixer of Qwen3.5 / Qwen3-Next's state layers
//! (docs/architecture.md, "Layer kinds": the state kind), on the CPU device: each piece a
//! step over one token of one sequence and its fixed-size state, in f32, as transformers'
//! `modeling_qwen3_5` computes it (`torch_recurrent_gated_delta_rule`,
//! `causal_conv1d_update`, `Qwen3_5RMSNormGated`; tested against them on recorded
//! inputs). `Model`'s state-layer body runs them over each sequence's rows in order.

pub use crate::device::delta::{DeltaShape, ValueHeadOrder};

/// Sizes a model file may give: each bounded like the attention's (so every product
/// the loader forms stays far from wrapping), value heads a multiple of key heads.
pub fn validate(s: &DeltaShape) -> anyhow::Result<()> {
    use crate::model::config::limits::{MAX_HEADS, MAX_HEAD_DIM};
    for (key, value, max) in [
        ("linear_num_key_heads", s.k_heads, MAX_HEADS),
        ("linear_num_value_heads", s.v_heads, MAX_HEADS),
        ("linear_key_head_dim", s.dk, MAX_HEAD_DIM),
        ("linear_value_head_dim", s.dv, MAX_HEAD_DIM),
        ("linear_conv_kernel_dim", s.kernel, 64),
    ] {
        if !(1..=max).contains(&value) {
            anyhow::bail!("invalid model config: {key} must be in 1..={max}, got {value}");
        }
    }
    if s.kernel < 2 {
        anyhow::bail!("invalid model config: linear_conv_kernel_dim must be at least 2, got 1");
    }
    if !s.v_heads.is_multiple_of(s.k_heads) {
        anyhow::bail!(
            "invalid model config: linear_num_value_heads ({}) is not a multiple of linear_num_key_heads ({})",
            s.v_heads,
            s.k_heads
        );
    }
    Ok(())
}

/// One token through the depthwise causal conv and SiLU: `x[C]` the token's q/k/v
/// projections, `tail[kernel − 1, C]` the previous inputs (zeros before the first token),
/// shifted here to end with `x`; `w[C, kernel]`, tap `kernel − 1` on the newest input;
/// `out[C]`.
pub fn conv_step(s: DeltaShape, tail: &mut [f32], x: &[f32], w: &[f32], out: &mut [f32]) {
    let (c, kn) = (s.conv_channels(), s.kernel);
    assert_eq!(
        (tail.len(), x.len(), w.len(), out.len()),
        (s.conv_tail_len(), c, c * kn, c)
    );
    for ch in 0..c {
        let taps = &w[ch * kn..(ch + 1) * kn];
        let mut acc = 0.0f32;
        for (j, t) in taps[..kn - 1].iter().enumerate() {
            acc += t * tail[j * c + ch];
        }
        acc += taps[kn - 1] * x[ch];
        out[ch] = silu(acc);
    }
    tail.copy_within(c.., 0);
    tail[(kn - 2) * c..].copy_from_slice(x);
}

/// The decay (log space, ≤ 0) and the write strength of each value head from the token's
/// `a`, `b` projections `[v_heads]`: `g = A · softplus(a + dt_bias)` with the layer's
/// `A = −exp(A_log)` (`DeltaWeights::decay_rate`), `β = σ(b)`.
pub fn gates(
    a: &[f32],
    b: &[f32],
    decay_rate: &[f32],
    dt_bias: &[f32],
    g: &mut [f32],
    beta: &mut [f32],
) {
    for h in 0..a.len() {
        g[h] = decay_rate[h] * softplus(a[h] + dt_bias[h]);
        beta[h] = 1.0 / (1.0 + (-b[h]).exp());
    }
}

/// One token of the gated delta rule for every value head (value head `h` reads key head
/// `s.key_head(h)`): q, k `[k_heads, dk]` as the conv left them (L2-normalised
/// here, q also scaled by dk^-½), v `[v_heads, dv]`, `g`, `beta` `[v_heads]`;
/// `state[v_heads, dk, dv]` becomes `S·e^g + k δᵀ` with `δ = β (v − Sᵀk)` (S decayed);
/// `out[v_heads, dv] = Sᵀq` (the new S).
#[allow(clippy::too_many_arguments)]
pub fn delta_step(
    s: DeltaShape,
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    out: &mut [f32],
) {
    let (dk, dv) = (s.dk, s.dv);
    assert_eq!(state.len(), s.state_len());
    assert_eq!((q.len(), k.len()), (s.k_heads * dk, s.k_heads * dk));
    assert_eq!((v.len(), out.len()), (s.v_heads * dv, s.v_heads * dv));
    let scale = 1.0 / (dk as f32).sqrt();
    let mut qn = vec![0.0f32; dk];
    let mut kn = vec![0.0f32; dk];
    let mut delta = vec![0.0f32; dv];
    for h in 0..s.v_heads {
        let kh = s.key_head(h);
        l2_normalise(&q[kh * dk..(kh + 1) * dk], &mut qn);
        qn.iter_mut().for_each(|x| *x *= scale);
        l2_normalise(&k[kh * dk..(kh + 1) * dk], &mut kn);
        let st = &mut state[h * dk * dv..(h + 1) * dk * dv]; // [dk, dv]
        let decay = g[h].exp();
        st.iter_mut().for_each(|x| *x *= decay);
        // δ = β (v − Sᵀk)
        let vh = &v[h * dv..(h + 1) * dv];
        for (j, d) in delta.iter_mut().enumerate() {
            let mem: f32 = (0..dk).map(|i| st[i * dv + j] * kn[i]).sum();
            *d = (vh[j] - mem) * beta[h];
        }
        for (i, ki) in kn.iter().enumerate() {
            for (x, d) in st[i * dv..(i + 1) * dv].iter_mut().zip(&delta) {
                *x += ki * d;
            }
        }
        for (j, o) in out[h * dv..(h + 1) * dv].iter_mut().enumerate() {
            *o = (0..dk).map(|i| st[i * dv + j] * qn[i]).sum();
        }
    }
}

/// Qwen3.5's gated RMSNorm of each `w.len()`-wide row of `x`: `x̂ · w · SiLU(z)` (a plain
/// weight, not the zero-centred `1 + w` of its other norms).
pub fn gated_rms_norm(x: &[f32], z: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for ((o, x), z) in out
        .chunks_exact_mut(n)
        .zip(x.chunks_exact(n))
        .zip(z.chunks_exact(n))
    {
        let mean = x.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let inv = 1.0 / (mean + eps).sqrt();
        for (((o, x), w), z) in o.iter_mut().zip(x).zip(w).zip(z) {
            *o = w * (x * inv) * silu(*z);
        }
    }
}

/// `x · rsqrt(Σx² + 1e-6)` (transformers' `l2norm`, FLA's).
fn l2_normalise(x: &[f32], out: &mut [f32]) {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    for (o, x) in out.iter_mut().zip(x) {
        *o = x * inv;
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// torch's softplus (β 1, threshold 20: linear above it).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn reference() -> Value {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/qwen3_5/deltanet_reference.json"
        );
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    fn floats(v: &Value) -> Vec<f32> {
        serde_json::from_value(v.clone()).unwrap()
    }

    fn shape(r: &Value) -> DeltaShape {
        let n = |k: &str| r["shape"][k].as_u64().unwrap() as usize;
        DeltaShape {
            k_heads: n("k_heads"),
            v_heads: n("v_heads"),
            dk: n("dk"),
            dv: n("dv"),
            kernel: n("kernel"),
            value_heads: ValueHeadOrder::Grouped,
        }
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// 40 tokens from a random state, token by token: every output and the final state
    /// within 1e-5 of transformers' recurrent form (and of its chunked prefill form), the
    /// gates formed from the raw projections as Qwen3.5 forms them.
    #[test]
    fn the_delta_rule_matches_transformers() {
        let r = reference();
        let s = shape(&r);
        let d = &r["delta"];
        let (q, k, v) = (floats(&d["q"]), floats(&d["k"]), floats(&d["v"]));
        let (a, b) = (floats(&d["a"]), floats(&d["b"]));
        let (a_log, dt_bias) = (floats(&d["A_log"]), floats(&d["dt_bias"]));
        let decay_rate: Vec<f32> = a_log.iter().map(|x| -x.exp()).collect();
        let (want_g, want_beta) = (floats(&d["g"]), floats(&d["beta"]));
        let mut state = floats(&d["state0"]);
        let (kd, vd, nv) = (s.k_heads * s.dk, s.v_heads * s.dv, s.v_heads);
        let tokens = r["shape"]["tokens"].as_u64().unwrap() as usize;
        let mut out = vec![0.0f32; tokens * vd];
        let (mut g, mut beta) = (vec![0.0f32; nv], vec![0.0f32; nv]);
        for t in 0..tokens {
            let at = |x: &[f32], w: usize| x[t * w..(t + 1) * w].to_vec();
            gates(
                &at(&a, nv),
                &at(&b, nv),
                &decay_rate,
                &dt_bias,
                &mut g,
                &mut beta,
            );
            assert!(
                max_diff(&g, &at(&want_g, nv)) < 1e-5
                    && max_diff(&beta, &at(&want_beta, nv)) < 1e-6
            );
            let o = &mut out[t * vd..(t + 1) * vd];
            delta_step(
                s,
                &mut state,
                &at(&q, kd),
                &at(&k, kd),
                &at(&v, vd),
                &g,
                &beta,
                o,
            );
        }
        for (what, out_key, state_key) in [
            ("recurrent", "out", "state"),
            ("chunked", "chunk_out", "chunk_state"),
        ] {
            let (o, st) = (
                max_diff(&out, &floats(&d[out_key])),
                max_diff(&state, &floats(&d[state_key])),
            );
            assert!(o < 1e-5 && st < 1e-5, "{what}: outputs {o:e}, state {st:e}");
        }
    }

    /// The causal conv over 40 tokens from a zero tail, then one decode step from the tail
    /// the sequence left: transformers' `causal_conv1d_fn` and `causal_conv1d_update`.
    #[test]
    fn the_causal_conv_matches_transformers() {
        let r = reference();
        let s = shape(&r);
        let c = &r["conv"];
        let (x, w, want) = (floats(&c["x"]), floats(&c["w"]), floats(&c["out"]));
        let ch = s.conv_channels();
        let mut tail = vec![0.0f32; s.conv_tail_len()];
        let mut out = vec![0.0f32; x.len()];
        for (xt, o) in x.chunks_exact(ch).zip(out.chunks_exact_mut(ch)) {
            conv_step(s, &mut tail, xt, &w, o);
        }
        assert!(max_diff(&out, &want) < 1e-5, "{:e}", max_diff(&out, &want));
        let mut o = vec![0.0f32; ch];
        conv_step(s, &mut tail, &floats(&c["x_next"]), &w, &mut o);
        assert!(max_diff(&o, &floats(&c["out_next"])) < 1e-5);
        assert_eq!(tail, floats(&c["state_next"]));
    }

    #[test]
    fn the_gated_norm_matches_transformers() {
        let r = reference();
        let n = &r["gated_norm"];
        let (x, z, w) = (floats(&n["x"]), floats(&n["z"]), floats(&n["w"]));
        let mut out = vec![0.0f32; x.len()];
        gated_rms_norm(&x, &z, &w, 1e-6, &mut out);
        assert!(max_diff(&out, &floats(&n["out"])) < 1e-5);
    }
}
