//! Each kernel against its CPU twin on random inputs (step 1 of `scripts/gpu-check.sh`).
//! Inputs are random bf16; the twin runs in f32 on the same (widened) values, so the
//! difference is the kernel's own rounding: outputs stored in bf16 carry ~2⁻⁸ relative
//! error, hence the tolerances below (a row passes when |gpu − cpu| ≤ atol + rtol·|cpu|).

use super::context::{download, linear, upload, CudaDevice};
use crate::device::cpu::{ops, twins};
use anyhow::Result;
use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::Arc;

/// One line of the summary table.
#[derive(Clone, Debug)]
pub struct CheckRow {
    pub name: String,
    pub shape: String,
    pub max_abs_err: f32,
    pub tolerance: String,
    pub pass: bool,
    pub note: String,
}

/// Runs every kernel check; a check that errors becomes a failing row, not an abort.
pub fn run_kernel_checks() -> Result<Vec<CheckRow>> {
    let dev = CudaDevice::new(0)?;
    let st = dev.new_stream()?;
    let checks: Vec<(&str, Check)> = vec![
        ("embedding_gather", check_embedding),
        ("rms_norm", check_rms_norm),
        ("add_rms_norm", check_add_rms_norm),
        ("head_rms_norm", check_head_rms_norm),
        ("rope_neox", check_rope),
        ("silu_mul", check_silu_mul),
        ("kv_store", check_kv_store),
        ("argmax", check_argmax),
        ("sample", check_sample),
        ("attn_prefill_hd128", |d, s, r| {
            check_prefill(d, s, r, 32, 8, 128)
        }),
        ("attn_prefill_hd64", |d, s, r| {
            check_prefill(d, s, r, 9, 3, 64)
        }),
        ("attn_decode_hd128", |d, s, r| {
            check_decode(d, s, r, 32, 8, 128, 16)
        }),
        ("attn_decode_hd64 (ring slot)", |d, s, r| {
            check_decode(d, s, r, 9, 3, 64, 0)
        }),
        ("cublas linear bf16→f32", check_linear),
    ];
    let mut rows = Vec::new();
    for (i, (name, f)) in checks.into_iter().enumerate() {
        let mut rng = StdRng::seed_from_u64(1000 + i as u64);
        rows.push(f(&dev, &st, &mut rng).unwrap_or_else(|e| CheckRow {
            name: name.into(),
            shape: String::new(),
            max_abs_err: f32::NAN,
            tolerance: String::new(),
            pass: false,
            note: format!("error: {e:#}"),
        }));
    }
    Ok(rows)
}

/// The summary table printed by the check command.
pub fn format_table(rows: &[CheckRow]) -> String {
    let mut s = format!(
        "{:<30} {:<34} {:>12} {:<22} {}\n",
        "check", "shape", "max |err|", "tolerance", "result"
    );
    for r in rows {
        let verdict = if r.pass { "ok" } else { "FAIL" };
        s += &format!(
            "{:<30} {:<34} {:>12.3e} {:<22} {verdict} {}\n",
            r.name, r.shape, r.max_abs_err, r.tolerance, r.note
        );
    }
    s
}

type Check = fn(&CudaDevice, &Arc<CudaStream>, &mut StdRng) -> Result<CheckRow>;

/// Random bf16 values in [-scale, scale): (bits for the GPU, widened for the twin).
fn rand_bf16(rng: &mut StdRng, n: usize, scale: f32) -> (Vec<u16>, Vec<f32>) {
    let bits: Vec<u16> = (0..n)
        .map(|_| twins::f32_to_bf16(rng.random_range(-scale..scale)))
        .collect();
    let f = bits.iter().map(|&b| twins::bf16_to_f32(b)).collect();
    (bits, f)
}

fn widen(v: &[u16]) -> Vec<f32> {
    v.iter().map(|&b| twins::bf16_to_f32(b)).collect()
}

fn compare(name: &str, shape: String, got: &[f32], want: &[f32], atol: f32, rtol: f32) -> CheckRow {
    let mut max_abs = 0.0f32;
    let mut pass = got.len() == want.len();
    for (g, w) in got.iter().zip(want) {
        let e = (g - w).abs();
        max_abs = max_abs.max(e);
        pass &= e <= atol + rtol * w.abs(); // false for NaN
    }
    CheckRow {
        name: name.into(),
        shape,
        max_abs_err: max_abs,
        tolerance: format!("{atol:.0e} + {rtol:.0e}·|x|"),
        pass,
        note: String::new(),
    }
}

fn grid(n: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(block), 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn rows_cfg(rows: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn check_embedding(dev: &CudaDevice, st: &Arc<CudaStream>, rng: &mut StdRng) -> Result<CheckRow> {
    let (vocab, dim, tokens) = (1000usize, 2560usize, 37usize);
    let (tb, tf) = rand_bf16(rng, vocab * dim, 1.0);
    let mut ids: Vec<i32> = (0..tokens)
        .map(|_| rng.random_range(0..vocab as i32))
        .collect();
    ids[5] = -1; // out of range: a zero row
    let f = dev.function("embedding.cu", "embedding_gather")?;
    let (t_d, ids_d) = (upload(st, &tb)?, upload(st, &ids)?);
    let mut out_d = dev.alloc_zeros::<u16>(st, tokens * dim)?;
    let (v, d) = (vocab as i32, dim as i32);
    // SAFETY: argument types and sizes match the kernel's signature (see embedding.cu).
    unsafe {
        st.launch_builder(&f)
            .arg(&t_d)
            .arg(&ids_d)
            .arg(&mut out_d)
            .arg(&v)
            .arg(&d)
            .launch(rows_cfg(tokens, 256))?;
    }
    let got = widen(&download(st, &out_d)?);
    let mut want = vec![0.0; tokens * dim];
    twins::embedding_gather(&tf, &ids, dim, &mut want);
    Ok(compare(
        "embedding_gather",
        format!("vocab {vocab}, [{tokens}, {dim}]"),
        &got,
        &want,
        0.0,
        0.0,
    ))
}

fn check_rms_norm(dev: &CudaDevice, st: &Arc<CudaStream>, rng: &mut StdRng) -> Result<CheckRow> {
    let (rows, dim, eps) = (37usize, 2560usize, 1e-6f32);
    let (xb, xf) = rand_bf16(rng, rows * dim, 2.0);
    let (wb, wf) = rand_bf16(rng, dim, 1.5);
    let f = dev.function("norm.cu", "rms_norm")?;
    let (x_d, w_d) = (upload(st, &xb)?, upload(st, &wb)?);
    let mut out_d = dev.alloc_zeros::<u16>(st, rows * dim)?;
    let d = dim as i32;
    // SAFETY: matches norm.cu `rms_norm`.
    unsafe {
        st.launch_builder(&f)
            .arg(&x_d)
            .arg(&w_d)
            .arg(&mut out_d)
            .arg(&d)
            .arg(&eps)
            .launch(rows_cfg(rows, 256))?;
    }
    let got = widen(&download(st, &out_d)?);
    let mut want = vec![0.0; rows * dim];
    ops::rms_norm(&xf, &wf, eps, &mut want);
    Ok(compare(
        "rms_norm",
        format!("[{rows}, {dim}]"),
        &got,
        &want,
        1e-2,
        1e-2,
    ))
}

fn check_add_rms_norm(
    dev: &CudaDevice,
    st: &Arc<CudaStream>,
    rng: &mut StdRng,
) -> Result<CheckRow> {
    let (rows, dim, eps) = (37usize, 2560usize, 1e-6f32);
    let (xb, xf) = rand_bf16(rng, rows * dim, 2.0);
    let (db, df) = rand_bf16(rng, rows * dim, 2.0);
    let (wb, wf) = rand_bf16(rng, dim, 1.5);
    let f = dev.function("norm.cu", "add_rms_norm")?;
    let (mut x_d, d_d, w_d) = (upload(st, &xb)?, upload(st, &db)?, upload(st, &wb)?);
    let mut out_d = dev.alloc_zeros::<u16>(st, rows * dim)?;
    let d = dim as i32;
    // SAFETY: matches norm.cu `add_rms_norm`.
    unsafe {
        st.launch_builder(&f)
            .arg(&mut x_d)
            .arg(&d_d)
            .arg(&w_d)
            .arg(&mut out_d)
            .arg(&d)
            .arg(&eps)
            .launch(rows_cfg(rows, 256))?;
    }
    let mut got = widen(&download(st, &x_d)?); // the residual, then the normed output
    got.extend(widen(&download(st, &out_d)?));
    let (mut x, mut want) = (xf, vec![0.0; rows * dim]);
    ops::add_rms_norm(&mut x, &df, &wf, eps, &mut want);
    x.extend(want);
    Ok(compare(
        "add_rms_norm",
        format!("[{rows}, {dim}] (+ residual)"),
        &got,
        &x,
        1e-2,
        1e-2,
    ))
}

/// Fused QKV rows: [tokens, (heads + kv_heads + kv_heads) × head_dim].
const QKV: (usize, usize, usize, usize) = (37, 32, 8, 128); // tokens, heads, kv heads, head_dim

fn check_head_rms_norm(
    dev: &CudaDevice,
    st: &Arc<CudaStream>,
    rng: &mut StdRng,
) -> Result<CheckRow> {
    let (tokens, nh, nkv, hd) = QKV;
    let stride = (nh + 2 * nkv) * hd;
    let eps = 1e-6f32;
    let (xb, mut xf) = rand_bf16(rng, tokens * stride, 2.0);
    let (wb, wf) = rand_bf16(rng, hd, 1.5);
    let f = dev.function("norm.cu", "head_rms_norm")?;
    let (mut x_d, w_d) = (upload(st, &xb)?, upload(st, &wb)?);
    let (t, h, d, s) = (tokens as i32, nh as i32, hd as i32, stride as i32);
    // SAFETY: matches norm.cu `head_rms_norm`; 4 warps per block, one per (token, head).
    unsafe {
        st.launch_builder(&f)
            .arg(&mut x_d)
            .arg(&w_d)
            .arg(&t)
            .arg(&h)
            .arg(&d)
            .arg(&s)
            .arg(&eps)
            .launch(grid(tokens * nh * 32, 128))?;
    }
    let got = widen(&download(st, &x_d)?);
    ops::head_rms_norm(&mut xf, tokens, nh, hd, stride, &wf, eps);
    Ok(compare(
        "head_rms_norm",
        format!("q of fused QKV [{tokens}, {stride}]"),
        &got,
        &xf,
        1e-2,
        1e-2,
    ))
}

fn check_rope(dev: &CudaDevice, st: &Arc<CudaStream>, rng: &mut StdRng) -> Result<CheckRow> {
    let (tokens, nh, nkv, hd) = QKV;
    let stride = (nh + 2 * nkv) * hd;
    let (half, max_pos) = (hd / 2, 4096usize);
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1.0 / 1e6f32.powf(2.0 * i as f32 / hd as f32))
        .collect();
    let (cos, sin) = ops::rope_tables(&inv_freq, 0, max_pos);
    let pos: Vec<i32> = (0..tokens)
        .map(|_| rng.random_range(0..max_pos as i32))
        .collect();
    let (xb, mut xf) = rand_bf16(rng, tokens * stride, 2.0);
    let f = dev.function("rope.cu", "rope_neox")?;
    let (mut x_d, p_d, c_d, s_d) = (
        upload(st, &xb)?,
        upload(st, &pos)?,
        upload(st, &cos)?,
        upload(st, &sin)?,
    );
    let heads = nh + nkv; // q and k are adjacent in the fused buffer: one launch rotates both
    let (t, h, d, s) = (tokens as i32, heads as i32, hd as i32, stride as i32);
    // SAFETY: matches rope.cu `rope_neox`.
    unsafe {
        st.launch_builder(&f)
            .arg(&mut x_d)
            .arg(&p_d)
            .arg(&c_d)
            .arg(&s_d)
            .arg(&t)
            .arg(&h)
            .arg(&d)
            .arg(&s)
            .launch(grid(tokens * heads * half, 256))?;
    }
    let got = widen(&download(st, &x_d)?);
    let gather = |tab: &[f32]| -> Vec<f32> {
        pos.iter()
            .flat_map(|&p| tab[p as usize * half..][..half].to_vec())
            .collect()
    };
    ops::rope(
        &mut xf,
        tokens,
        heads,
        hd,
        stride,
        &gather(&cos),
        &gather(&sin),
    );
    Ok(compare(
        "rope_neox",
        format!("q+k of fused QKV [{tokens}, {stride}]"),
        &got,
        &xf,
        2e-2,
        1e-2,
    ))
}

fn check_silu_mul(dev: &CudaDevice, st: &Arc<CudaStream>, rng: &mut StdRng) -> Result<CheckRow> {
    let (tokens, inter) = (37usize, 9728usize);
    let (gb, gf) = rand_bf16(rng, tokens * 2 * inter, 4.0);
    let f = dev.function("activation.cu", "silu_mul")?;
    let g_d = upload(st, &gb)?;
    let mut out_d = dev.alloc_zeros::<u16>(st, tokens * inter)?;
    let (t, i) = (tokens as i32, inter as i32);
    // SAFETY: matches activation.cu `silu_mul`.
    unsafe {
        st.launch_builder(&f)
            .arg(&g_d)
            .arg(&mut out_d)
            .arg(&t)
            .arg(&i)
            .launch(grid(tokens * inter, 256))?;
    }
    let got = widen(&download(st, &out_d)?);
    let mut want = vec![0.0; tokens * inter];
    ops::silu_mul(&gf, inter, &mut want);
    Ok(compare(
        "silu_mul",
        format!("[{tokens}, 2 × {inter}]"),
        &got,
        &want,
        1e-2,
        1e-2,
    ))
}

fn check_kv_store(dev: &CudaDevice, st: &Arc<CudaStream>, rng: &mut StdRng) -> Result<CheckRow> {
    let (tokens, nh, nkv, hd) = QKV;
    let (stride, kv_dim, n_slots) = ((nh + 2 * nkv) * hd, nkv * hd, 256usize);
    let (qkvb, qkvf) = rand_bf16(rng, tokens * stride, 1.0);
    let mut perm: Vec<i32> = (0..n_slots as i32).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, rng.random_range(0..=i));
    }
    let mut slots = perm[..tokens].to_vec();
    slots[3] = -1; // padding
    let f = dev.function("kv_store.cu", "kv_store")?;
    let qkv_d = upload(st, &qkvb)?;
    let (k_view, v_view) = (qkv_d.slice(nh * hd..), qkv_d.slice((nh + nkv) * hd..));
    let s_d = upload(st, &slots)?;
    let mut kc = dev.alloc_zeros::<u16>(st, n_slots * kv_dim)?;
    let mut vc = dev.alloc_zeros::<u16>(st, n_slots * kv_dim)?;
    let (t, d, s) = (tokens as i32, kv_dim as i32, stride as i32);
    // SAFETY: matches kv_store.cu; K and V are views into the fused QKV rows.
    unsafe {
        st.launch_builder(&f)
            .arg(&k_view)
            .arg(&v_view)
            .arg(&mut kc)
            .arg(&mut vc)
            .arg(&s_d)
            .arg(&t)
            .arg(&d)
            .arg(&s)
            .launch(grid(tokens * kv_dim, 256))?;
    }
    let mut got = widen(&download(st, &kc)?);
    got.extend(widen(&download(st, &vc)?));
    let (mut kw, mut vw) = (vec![0.0; n_slots * kv_dim], vec![0.0; n_slots * kv_dim]);
    twins::kv_store(
        &qkvf[nh * hd..],
        &qkvf[(nh + nkv) * hd..],
        stride,
        kv_dim,
        &slots,
        &mut kw,
        &mut vw,
    );
    kw.extend(vw);
    Ok(compare(
        "kv_store",
        format!("{tokens} tokens → {n_slots} slots × {kv_dim}"),
        &got,
        &kw,
        0.0,
        0.0,
    ))
}

fn rand_logits(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

fn check_argmax(dev: &CudaDevice, st: &Arc<CudaStream>, rng: &mut StdRng) -> Result<CheckRow> {
    let (rows, vocab) = (8usize, 151_936usize);
    let logits = rand_logits(rng, rows * vocab, 10.0);
    let f = dev.function("sampling.cu", "argmax")?;
    let l_d = upload(st, &logits)?;
    let mut out_d = dev.alloc_zeros::<i32>(st, rows)?;
    let v = vocab as i32;
    // SAFETY: matches sampling.cu `argmax`.
    unsafe {
        st.launch_builder(&f)
            .arg(&l_d)
            .arg(&mut out_d)
            .arg(&v)
            .launch(rows_cfg(rows, 1024))?;
    }
    let got: Vec<f32> = download(st, &out_d)?.iter().map(|&i| i as f32).collect();
    let want: Vec<f32> = logits
        .chunks(vocab)
        .map(|r| twins::argmax(r) as f32)
        .collect();
    Ok(compare(
        "argmax",
        format!("[{rows}, {vocab}] f32"),
        &got,
        &want,
        0.0,
        0.0,
    ))
}

fn check_sample(dev: &CudaDevice, st: &Arc<CudaStream>, rng: &mut StdRng) -> Result<CheckRow> {
    let (rows, vocab) = (64usize, 151_936usize);
    let f = dev.function("sampling.cu", "sample")?;
    let mut mismatches = 0;
    let mut total = 0;
    // (temperature, top_k, top_p): the CLI's defaults and typical chat settings.
    for &(temp, top_k, top_p) in &[
        (1.0f32, 0i32, 1.0f32),
        (0.7, 50, 0.9),
        (0.6, 20, 0.95),
        (1.0, 0, 0.8),
    ] {
        let logits = rand_logits(rng, rows * vocab, 8.0);
        let u: Vec<f32> = (0..rows).map(|_| rng.random::<f32>()).collect();
        let (l_d, u_d) = (upload(st, &logits)?, upload(st, &u)?);
        let mut out_d = dev.alloc_zeros::<i32>(st, rows)?;
        let v = vocab as i32;
        // SAFETY: matches sampling.cu `sample`.
        unsafe {
            st.launch_builder(&f)
                .arg(&l_d)
                .arg(&u_d)
                .arg(&mut out_d)
                .arg(&v)
                .arg(&temp)
                .arg(&top_k)
                .arg(&top_p)
                .launch(rows_cfg(rows, 1024))?;
        }
        let got = download(st, &out_d)?;
        for (r, &g) in got.iter().enumerate() {
            let want = twins::sample(
                &logits[r * vocab..(r + 1) * vocab],
                temp,
                top_k as usize,
                top_p,
                u[r],
            );
            mismatches += (g as usize != want) as usize;
            total += 1;
        }
    }
    // f32 sums in a different order can move a cut-off or the CDF boundary by one token.
    let allowed = total / 32;
    Ok(CheckRow {
        name: "sample".into(),
        shape: format!("4 × [{rows}, {vocab}] f32"),
        max_abs_err: mismatches as f32,
        tolerance: format!("≤ {allowed} of {total} differ"),
        pass: mismatches <= allowed,
        note: format!("{mismatches} tokens differ"),
    })
}

/// A paged cache with scattered blocks for `ctx` lengths; returns (tables, max_blocks, slots).
fn block_tables(rng: &mut StdRng, ctx: &[i32], block_size: usize) -> (Vec<i32>, usize, usize) {
    let max_blocks = ctx
        .iter()
        .map(|&c| (c as usize).div_ceil(block_size))
        .max()
        .unwrap_or(1);
    let n_blocks = max_blocks * ctx.len();
    let mut perm: Vec<i32> = (0..n_blocks as i32).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, rng.random_range(0..=i));
    }
    (perm, max_blocks, n_blocks * block_size)
}

fn check_prefill(
    dev: &CudaDevice,
    st: &Arc<CudaStream>,
    rng: &mut StdRng,
    nh: usize,
    nkv: usize,
    hd: usize,
) -> Result<CheckRow> {
    // A fresh prompt, a chunk after a 263-token prefix, and a one-token tail.
    let (q_lens, ctx) = ([100i32, 37, 1], [100i32, 300, 20]);
    let block_size = 16usize;
    let cu: Vec<i32> = std::iter::once(0)
        .chain(q_lens.iter().scan(0, |a, &l| {
            *a += l;
            Some(*a)
        }))
        .collect();
    let total_q = cu[q_lens.len()] as usize;
    let (tables, max_blocks, n_slots) = block_tables(rng, &ctx, block_size);
    let kv_dim = nkv * hd;
    let (qb, qf) = rand_bf16(rng, total_q * nh * hd, 1.0);
    let (kb, kf) = rand_bf16(rng, n_slots * kv_dim, 1.0);
    let (vb, vf) = rand_bf16(rng, n_slots * kv_dim, 1.0);
    let name = format!("attn_prefill_hd{hd}");
    let f = dev.function("attention_prefill.cu", &name)?;
    let (q_d, k_d, v_d) = (upload(st, &qb)?, upload(st, &kb)?, upload(st, &vb)?);
    let (cu_d, ctx_d, t_d) = (upload(st, &cu)?, upload(st, &ctx)?, upload(st, &tables)?);
    let mut out_d = dev.alloc_zeros::<u16>(st, total_q * nh * hd)?;
    let (mb, bs, h, kvh, qs) = (
        max_blocks as i32,
        block_size as i32,
        nh as i32,
        nkv as i32,
        (nh * hd) as i32,
    );
    let scale = 1.0 / (hd as f32).sqrt();
    let max_q = *q_lens.iter().max().unwrap() as u32;
    let cfg = LaunchConfig {
        grid_dim: (max_q.div_ceil(16), nh as u32, q_lens.len() as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: matches attention_prefill.cu's INSTANTIATE signature.
    unsafe {
        st.launch_builder(&f)
            .arg(&q_d)
            .arg(&k_d)
            .arg(&v_d)
            .arg(&mut out_d)
            .arg(&cu_d)
            .arg(&ctx_d)
            .arg(&t_d)
            .arg(&mb)
            .arg(&bs)
            .arg(&h)
            .arg(&kvh)
            .arg(&qs)
            .arg(&scale)
            .launch(cfg)?;
    }
    let got = widen(&download(st, &out_d)?);
    let mut want = vec![0.0; total_q * nh * hd];
    let shape = twins::PagedShape {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
        block_size,
        max_blocks,
    };
    twins::paged_attention(&qf, &kf, &vf, &cu, &ctx, &tables, shape, &mut want);
    Ok(compare(
        &name,
        format!("q {q_lens:?} ctx {ctx:?} {nh}/{nkv} heads"),
        &got,
        &want,
        2e-2,
        2e-2,
    ))
}

/// `block_size` 0: the contiguous ring-slot layout (one block per sequence).
fn check_decode(
    dev: &CudaDevice,
    st: &Arc<CudaStream>,
    rng: &mut StdRng,
    nh: usize,
    nkv: usize,
    hd: usize,
    block_size: usize,
) -> Result<CheckRow> {
    let ctx = [1i32, 700, 5000];
    let batch = ctx.len();
    let block_size = if block_size == 0 {
        *ctx.iter().max().unwrap() as usize
    } else {
        block_size
    };
    let (tables, max_blocks, n_slots) = block_tables(rng, &ctx, block_size);
    let (split_len, kv_dim) = (512usize, nkv * hd);
    let max_splits = (*ctx.iter().max().unwrap() as usize).div_ceil(split_len);
    let (qb, qf) = rand_bf16(rng, batch * nh * hd, 1.0);
    let (kb, kf) = rand_bf16(rng, n_slots * kv_dim, 1.0);
    let (vb, vf) = rand_bf16(rng, n_slots * kv_dim, 1.0);
    let name = format!("attn_decode_hd{hd}");
    let f = dev.function("attention_decode.cu", &name)?;
    let reduce = dev.function("attention_decode.cu", "attn_decode_reduce")?;
    let (q_d, k_d, v_d) = (upload(st, &qb)?, upload(st, &kb)?, upload(st, &vb)?);
    let (ctx_d, t_d) = (upload(st, &ctx)?, upload(st, &tables)?);
    let mut part_o = dev.alloc_zeros::<f32>(st, batch * nh * max_splits * hd)?;
    let mut part_ml = dev.alloc_zeros::<f32>(st, batch * nh * max_splits * 2)?;
    let mut out_d = dev.alloc_zeros::<u16>(st, batch * nh * hd)?;
    let (mb, bs, h, kvh, qs) = (
        max_blocks as i32,
        block_size as i32,
        nh as i32,
        nkv as i32,
        (nh * hd) as i32,
    );
    let (sl, ms, d) = (split_len as i32, max_splits as i32, hd as i32);
    let scale = 1.0 / (hd as f32).sqrt();
    let cfg = LaunchConfig {
        grid_dim: (nh as u32, max_splits as u32, batch as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let cfg_r = LaunchConfig {
        grid_dim: (nh as u32, batch as u32, 1),
        ..cfg
    };
    // SAFETY: match attention_decode.cu's kernels; the partials are sized for max_splits.
    unsafe {
        st.launch_builder(&f)
            .arg(&q_d)
            .arg(&k_d)
            .arg(&v_d)
            .arg(&mut part_o)
            .arg(&mut part_ml)
            .arg(&ctx_d)
            .arg(&t_d)
            .arg(&mb)
            .arg(&bs)
            .arg(&h)
            .arg(&kvh)
            .arg(&qs)
            .arg(&sl)
            .arg(&ms)
            .arg(&scale)
            .launch(cfg)?;
        st.launch_builder(&reduce)
            .arg(&part_o)
            .arg(&part_ml)
            .arg(&mut out_d)
            .arg(&ctx_d)
            .arg(&h)
            .arg(&d)
            .arg(&sl)
            .arg(&ms)
            .launch(cfg_r)?;
    }
    let got = widen(&download(st, &out_d)?);
    let mut want = vec![0.0; batch * nh * hd];
    let cu: Vec<i32> = (0..=batch as i32).collect();
    let shape = twins::PagedShape {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
        block_size,
        max_blocks,
    };
    twins::paged_attention(&qf, &kf, &vf, &cu, &ctx, &tables, shape, &mut want);
    Ok(compare(
        &name,
        format!("ctx {ctx:?} {nh}/{nkv} heads, block {block_size}"),
        &got,
        &want,
        2e-2,
        2e-2,
    ))
}

fn check_linear(dev: &CudaDevice, st: &Arc<CudaStream>, rng: &mut StdRng) -> Result<CheckRow> {
    let (m, k, n) = (37usize, 2560usize, 1024usize);
    let (xb, xf) = rand_bf16(rng, m * k, 1.0);
    let (wb, wf) = rand_bf16(rng, n * k, 0.05);
    let blas = dev.blas(st)?;
    let (x_d, w_d) = (upload(st, &xb)?, upload(st, &wb)?);
    let mut out_d = dev.alloc_zeros::<f32>(st, m * n)?;
    linear(&blas, st, &x_d, &w_d, &mut out_d, m, k, n)?;
    let got = download(st, &out_d)?;
    let mut want = vec![0.0; m * n];
    ops::linear(&xf, &wf, None, &mut want, m, k, n);
    Ok(compare(
        "cublas linear bf16→f32",
        format!("[{m}, {k}] · [{n}, {k}]ᵀ"),
        &got,
        &want,
        1e-3,
        1e-3,
    ))
}
