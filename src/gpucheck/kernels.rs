//! Each kernel against its CPU twin on random inputs (step 1 of `scripts/gpu-check.sh`),
//! on any `Exec` that runs launches: the GPU (`run_kernel_checks`), or a CPU emulator of
//! the `.cu` sources. Every launch comes from the `ops` builders, the same values the
//! model runs, so a wrong argument order or grid there fails a check here.
//!
//! Inputs are random bf16; the twin runs in f32 on the same (widened) values, so the
//! difference is the kernel's own rounding: outputs stored in bf16 carry ~2⁻⁸ relative
//! error, hence the tolerances below (a row passes when |gpu − cpu| ≤ atol + rtol·|cpu|).

use crate::device::cpu::{ops, twins};
use crate::device::cuda::context::CudaDevice;
use crate::device::cuda::exec::{Buf, CudaExec, Exec};
use crate::device::cuda::ops::{self as kernels, DecodeScratch, GemmOut, GemmShape, PagedAttn};
use crate::device::delta::{DeltaShape, ValueHeadOrder};
use crate::device::DevPtr;
use crate::device::{ExpertAct, MlpAct};
use crate::model::delta_net;
use anyhow::{bail, Result};
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

/// The shapes the checks run at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckSizes {
    /// Model-sized rows and vocabularies (the GPU).
    Full,
    /// The same code paths on smaller shapes, for a slow CPU emulator: fewer heads, rows
    /// and tokens, shorter contexts, but still several query and key tiles, several
    /// decode splits, scattered blocks and both head dims.
    Small,
}

impl CheckSizes {
    fn pick<T>(self, full: T, small: T) -> T {
        match self {
            CheckSizes::Full => full,
            CheckSizes::Small => small,
        }
    }
}

/// Every kernel check on the GPU, at full size.
pub fn run_kernel_checks() -> Result<Vec<CheckRow>> {
    let dev = Arc::new(CudaDevice::new(0)?);
    let st = dev.new_stream()?;
    let exec = CudaExec::new(dev, st)?;
    Ok(run_kernel_checks_on(&exec, CheckSizes::Full))
}

type Check = fn(&dyn Exec, &mut StdRng, CheckSizes) -> Result<CheckRow>;

/// Runs every kernel check on `exec`; a check that errors becomes a failing row, not an
/// abort. Inputs depend only on the check's position in the list (its seed) and `sizes`.
pub fn run_kernel_checks_on(exec: &dyn Exec, sizes: CheckSizes) -> Vec<CheckRow> {
    let checks: Vec<(&str, Check)> = vec![
        ("embedding_gather", check_embedding),
        ("rms_norm", check_rms_norm),
        ("add_rms_norm", |exec, r, z| {
            check_add_rms_norm(exec, r, z, false)
        }),
        ("head_rms_norm", check_head_rms_norm),
        ("rope_neox", |exec, r, z| check_rope(exec, r, z, false)),
        ("silu_mul", |exec, r, z| {
            check_gated(exec, r, z, MlpAct::Silu)
        }),
        ("kv_store", check_kv_store),
        ("argmax", check_argmax),
        ("sample", check_sample),
        ("attn_prefill_hd128", |exec, r, z| {
            check_prefill(exec, r, z, heads(z, 128), 128)
        }),
        ("attn_prefill_hd64", |exec, r, z| {
            check_prefill(exec, r, z, heads(z, 64), 64)
        }),
        ("attn_decode_hd128", |exec, r, z| {
            check_decode(exec, r, z, heads(z, 128), 128, 16)
        }),
        ("attn_decode_hd64 (ring slot)", |exec, r, z| {
            check_decode(exec, r, z, heads(z, 64), 64, 0)
        }),
        ("add_bias", check_add_bias),
        ("attn_prefill_hd96", |exec, r, z| {
            check_prefill(exec, r, z, heads(z, 96), 96)
        }),
        ("attn_decode_hd96", |exec, r, z| {
            check_decode(exec, r, z, heads(z, 96), 96, 16)
        }),
        ("cublas linear bf16→f32", check_linear),
        ("gemm_fixed (batch-invariant)", check_gemm_fixed),
        ("page_bounds (sparse)", check_page_bounds),
        ("head_bounds (sparse)", check_head_bounds),
        ("embedding_gather (scaled)", |exec, r, z| {
            check_embedding_scaled(exec, r, z, 25.3)
        }),
        ("gelu_tanh_mul", |exec, r, z| {
            check_gated(exec, r, z, MlpAct::GeluTanh)
        }),
        ("norm_add_rms_norm", |exec, r, z| {
            check_add_rms_norm(exec, r, z, true)
        }),
        ("kv_store (ring)", check_kv_store_ring),
        ("attn_prefill_hd256", |exec, r, z| {
            check_prefill(exec, r, z, heads(z, 256), 256)
        }),
        ("attn_decode_hd256", |exec, r, z| {
            check_decode(exec, r, z, heads(z, 256), 256, 16)
        }),
        ("attn_prefill_hd64 (unaligned chunks)", |exec, r, z| {
            check_window(exec, r, z, 64, Attn::Prefill, None, Layout::Paged(16))
        }),
        ("attn_prefill_hd64 (window)", |exec, r, z| {
            check_window(exec, r, z, 64, Attn::Prefill, Some(37), Layout::Paged(16))
        }),
        ("attn_prefill_hd256 (window, ring)", |exec, r, z| {
            check_window(exec, r, z, 256, Attn::Prefill, Some(37), Layout::Ring)
        }),
        ("attn_decode_hd128 (window)", |exec, r, z| {
            check_window(exec, r, z, 128, Attn::Decode, Some(300), Layout::Paged(16))
        }),
        ("attn_decode_hd256 (window, ring)", |exec, r, z| {
            check_window(exec, r, z, 256, Attn::Decode, Some(300), Layout::Ring)
        }),
        ("rope_neox (partial)", |exec, r, z| {
            check_rope(exec, r, z, true)
        }),
        ("sigmoid_gate", check_sigmoid_gate),
        ("delta_conv", check_delta_conv),
        ("delta_rule (grouped value heads)", |exec, r, z| {
            check_delta_rule(exec, r, z, false)
        }),
        ("delta_rule (tiled value heads)", |exec, r, z| {
            check_delta_rule(exec, r, z, true)
        }),
        ("delta_gated_norm", check_delta_gated_norm),
        ("moe_route", |exec, r, z| check_moe_route(exec, r, z, false)),
        ("moe_matvec (gate/up, down)", |exec, r, z| {
            check_moe_matvec(exec, r, z, false)
        }),
        ("moe_combine (+ shared expert)", check_moe_combine),
        ("attn_prefill_hd64 (window, sinks)", |exec, r, z| {
            check_sinks(exec, r, z, Attn::Prefill)
        }),
        ("attn_decode_hd64 (window, sinks)", |exec, r, z| {
            check_sinks(exec, r, z, Attn::Decode)
        }),
        ("clamped_swiglu_mul", check_clamped_swiglu),
        ("moe_route (router bias)", |exec, r, z| {
            check_moe_route(exec, r, z, true)
        }),
        ("moe_matvec (expert biases)", |exec, r, z| {
            check_moe_matvec(exec, r, z, true)
        }),
    ];
    let mut rows = Vec::new();
    for (i, (name, f)) in checks.into_iter().enumerate() {
        let mut rng = StdRng::seed_from_u64(1000 + i as u64);
        rows.push(f(exec, &mut rng, sizes).unwrap_or_else(|e| CheckRow {
            name: name.into(),
            shape: String::new(),
            max_abs_err: f32::NAN,
            tolerance: String::new(),
            pass: false,
            note: format!("error: {e:#}"),
        }));
    }
    rows
}

/// (num_heads, num_kv_heads) for a head dim: Qwen3-4B's 32/8 (hd 128) and SmolLM2's 9/3
/// (hd 64), GQA groups of 4 and 3; `Small` keeps the groups with two KV heads (with one,
/// a wrong head → KV head mapping would go unnoticed).
fn heads(z: CheckSizes, head_dim: usize) -> (usize, usize) {
    match head_dim {
        128 => z.pick((32, 8), (8, 2)),
        256 => z.pick((8, 4), (4, 2)), // Gemma 3 4B's 8/4
        _ => z.pick((9, 3), (6, 2)),
    }
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

/// An element type of device buffers, moved as little-endian bytes.
trait Elem: Copy {
    const SIZE: usize;
    /// Its type on the device (bf16 bits are `u16` here, `bf16` there).
    type Dev;
    fn put(self, out: &mut Vec<u8>);
    fn get(b: &[u8]) -> Self;
}

macro_rules! elem {
    ($($t:ty => $d:ty),*) => {$(
        impl Elem for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            type Dev = $d;
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn get(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("SIZE bytes"))
            }
        }
    )*};
}
elem!(u16 => half::bf16, i32 => i32, f32 => f32); // bf16 bits, ids/metadata, f32

/// The device memory of one check: typed uploads and downloads, freed when the check
/// ends. A download must lie inside a buffer allocated here.
struct Mem<'a> {
    exec: &'a dyn Exec,
    bufs: Vec<(Buf, u64, usize)>, // (allocation, address, bytes)
}

impl<'a> Mem<'a> {
    fn new(exec: &'a dyn Exec) -> Self {
        Self {
            exec,
            bufs: Vec::new(),
        }
    }

    fn upload<T: Elem>(&mut self, v: &[T]) -> Result<DevPtr<T::Dev>> {
        let mut bytes = Vec::with_capacity(v.len() * T::SIZE);
        v.iter().for_each(|e| e.put(&mut bytes));
        let (b, p) = self.exec.upload(&bytes)?;
        self.bufs.push((b, p.addr(), bytes.len()));
        Ok(p.cast())
    }

    /// `n` zeroed elements.
    fn zeros<T: Elem>(&mut self, n: usize) -> Result<DevPtr<T::Dev>> {
        let (b, p) = self.exec.alloc(n * T::SIZE)?;
        self.bufs.push((b, p.addr(), n * T::SIZE));
        Ok(p.cast())
    }

    /// `n` elements at `p`, after everything queued so far.
    fn download<T: Elem>(&self, p: DevPtr<T::Dev>, n: usize) -> Result<Vec<T>> {
        let (bytes, p) = (n * T::SIZE, p.cast::<u8>());
        let a = p.addr();
        let inside =
            |&(_, b, len): &(Buf, u64, usize)| a >= b && a + bytes as u64 <= b + len as u64;
        if !self.bufs.iter().any(inside) {
            bail!("download of {bytes} bytes at {a:#x}: not inside one of this check's buffers");
        }
        let mut raw = vec![0u8; bytes];
        // SAFETY: [p, p + bytes) lies inside a live allocation of this check (just checked).
        unsafe { self.exec.download(p, &mut raw)? };
        Ok(raw.chunks_exact(T::SIZE).map(T::get).collect())
    }

    /// `n` bf16 values at `p`, widened to f32.
    fn bf16(&self, p: DevPtr<half::bf16>, n: usize) -> Result<Vec<f32>> {
        Ok(widen(&self.download::<u16>(p, n)?))
    }
}

/// Random bf16 values in [-scale, scale): (bits for the device, widened for the twin).
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
        // A NaN anywhere is reported as NaN (f32::max would drop it).
        max_abs = if e.is_nan() || max_abs.is_nan() {
            f32::NAN
        } else {
            max_abs.max(e)
        };
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

fn check_embedding(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes) -> Result<CheckRow> {
    check_embedding_scaled(exec, rng, z, 1.0)
}

/// Scale 1 copies rows exactly; another (Gemma's √hidden) rounds each product to bf16.
fn check_embedding_scaled(
    exec: &dyn Exec,
    rng: &mut StdRng,
    z: CheckSizes,
    scale: f32,
) -> Result<CheckRow> {
    let (vocab, dim, tokens) = z.pick((1000, 2560, 37), (100, 320, 7));
    let (tb, tf) = rand_bf16(rng, vocab * dim, 1.0); // [vocab, dim]
    let mut ids: Vec<i32> = (0..tokens)
        .map(|_| rng.random_range(0..vocab as i32))
        .collect();
    ids[5] = -1; // out of range: a zero row
    let mut m = Mem::new(exec);
    let (table, ids_d) = (m.upload(&tb)?, m.upload(&ids)?);
    let out = m.zeros::<u16>(tokens * dim)?; // [tokens, dim]
    exec.launch(&kernels::embedding(
        table, ids_d, out, tokens, vocab, dim, scale,
    ))?;
    let got = m.bf16(out, tokens * dim)?;
    let mut want = vec![0.0; tokens * dim];
    twins::embedding_gather(&tf, &ids, dim, &mut want);
    want.iter_mut().for_each(|x| *x *= scale);
    let rtol = if scale == 1.0 { 0.0 } else { 1e-2 };
    Ok(compare(
        "embedding_gather",
        format!("vocab {vocab}, [{tokens}, {dim}], × {scale}"),
        &got,
        &want,
        0.0,
        rtol,
    ))
}

/// (rows, dim) of the row norms.
fn norm_rows(z: CheckSizes) -> (usize, usize) {
    z.pick((37, 2560), (5, 320))
}

fn check_rms_norm(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes) -> Result<CheckRow> {
    let ((rows, dim), eps) = (norm_rows(z), 1e-6f32);
    let (xb, xf) = rand_bf16(rng, rows * dim, 2.0); // [rows, dim]
    let (wb, wf) = rand_bf16(rng, dim, 1.5); // [dim]
    let mut m = Mem::new(exec);
    let (x_d, w_d) = (m.upload(&xb)?, m.upload(&wb)?);
    let out = m.zeros::<u16>(rows * dim)?;
    exec.launch(&kernels::rms_norm(x_d, w_d, out, rows, dim, eps))?;
    let got = m.bf16(out, rows * dim)?;
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

/// The residual add and the next norm; `sandwich` (Gemma): the delta normed by its own
/// weights before the add.
fn check_add_rms_norm(
    exec: &dyn Exec,
    rng: &mut StdRng,
    z: CheckSizes,
    sandwich: bool,
) -> Result<CheckRow> {
    let ((rows, dim), eps) = (norm_rows(z), 1e-6f32);
    let (xb, xf) = rand_bf16(rng, rows * dim, 2.0); // [rows, dim] residual
    let d_scale = if sandwich { 8.0 } else { 2.0 }; // a normed delta's scale is normed away
    let (db, df) = rand_bf16(rng, rows * dim, d_scale); // [rows, dim] delta
    let (wdb, wdf) = rand_bf16(rng, dim, 1.5); // [dim] the delta's norm (sandwich)
    let (wb, wf) = rand_bf16(rng, dim, 1.5); // [dim] the next block's norm
    let mut m = Mem::new(exec);
    let (x_d, d_d) = (m.upload(&xb)?, m.upload(&db)?);
    let (wd_d, w_d) = (m.upload(&wdb)?, m.upload(&wb)?);
    let out = m.zeros::<u16>(rows * dim)?;
    let delta_norm = sandwich.then_some(wd_d);
    exec.launch(&kernels::add_rms_norm(
        x_d, d_d, delta_norm, w_d, out, rows, dim, eps,
    ))?;
    let mut got = m.bf16(x_d, rows * dim)?; // the residual, then the normed output
    got.extend(m.bf16(out, rows * dim)?);
    let mut delta = df;
    if sandwich {
        ops::rms_norm_in_place(&mut delta, &wdf, eps);
    }
    let (mut xw, mut want) = (xf, vec![0.0; rows * dim]);
    ops::add_rms_norm(&mut xw, &delta, &wf, eps, &mut want);
    xw.extend(want);
    let (name, atol) = if sandwich {
        ("norm_add_rms_norm", 2e-2)
    } else {
        ("add_rms_norm", 1e-2)
    };
    Ok(compare(
        name,
        format!("[{rows}, {dim}] (+ residual)"),
        &got,
        &xw,
        atol,
        1e-2,
    ))
}

/// Fused QKV rows `[tokens, (heads + kv_heads + kv_heads) × head_dim]`:
/// (tokens, heads, kv heads, head_dim).
fn qkv(z: CheckSizes) -> (usize, usize, usize, usize) {
    z.pick((37, 32, 8, 128), (5, 4, 1, 128))
}

fn check_head_rms_norm(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes) -> Result<CheckRow> {
    let (tokens, nh, nkv, hd) = qkv(z);
    let stride = (nh + 2 * nkv) * hd;
    let eps = 1e-6f32;
    let (xb, mut xf) = rand_bf16(rng, tokens * stride, 2.0); // [tokens, stride]
    let (wb, wf) = rand_bf16(rng, hd, 1.5); // [hd]
    let mut m = Mem::new(exec);
    let (x_d, w_d) = (m.upload(&xb)?, m.upload(&wb)?);
    // The q heads of each row, in place.
    exec.launch(&kernels::head_rms_norm(
        x_d, w_d, tokens, nh, hd, stride, eps,
    ))?;
    let got = m.bf16(x_d, tokens * stride)?;
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

/// RoPE on q and k of the fused QKV rows, over whole heads or (`partial`) their first
/// quarter as Qwen3.5 rotates them (the rest must pass through untouched).
fn check_rope(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes, partial: bool) -> Result<CheckRow> {
    let (tokens, nh, nkv, hd) = qkv(z);
    let stride = (nh + 2 * nkv) * hd;
    let rot = if partial { hd / 4 } else { hd };
    let (half, max_pos) = (rot / 2, 4096usize);
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1.0 / 1e6f32.powf(2.0 * i as f32 / rot as f32))
        .collect();
    let (cos, sin) = ops::rope_tables(&inv_freq, 0, max_pos); // f32 [max_pos, half] each
    let pos: Vec<i32> = (0..tokens)
        .map(|_| rng.random_range(0..max_pos as i32))
        .collect();
    let (xb, mut xf) = rand_bf16(rng, tokens * stride, 2.0); // [tokens, stride]
    let mut m = Mem::new(exec);
    let (x_d, p_d) = (m.upload(&xb)?, m.upload(&pos)?);
    let (c_d, s_d) = (m.upload(&cos)?, m.upload(&sin)?);
    let heads = nh + nkv; // q and k are adjacent in the fused buffer: one launch rotates both
    exec.launch(&kernels::rope(
        x_d,
        p_d,
        c_d,
        s_d,
        tokens,
        heads,
        (hd, rot),
        stride,
    ))?;
    let got = m.bf16(x_d, tokens * stride)?;
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
        format!("q+k of fused QKV [{tokens}, {stride}], {rot} of {hd} rotated"),
        &got,
        &xf,
        2e-2,
        1e-2,
    ))
}

fn check_add_bias(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes) -> Result<CheckRow> {
    let (rows, n) = z.pick((37, 6144), (5, 768)); // fused QKV rows
    let (xb, xf) = rand_bf16(rng, rows * n, 4.0);
    let (bb, bf) = rand_bf16(rng, n, 1.0);
    let mut m = Mem::new(exec);
    let (x_d, b_d) = (m.upload(&xb)?, m.upload(&bb)?);
    exec.launch(&kernels::add_bias(x_d, b_d, rows, n))?;
    let got = m.bf16(x_d, rows * n)?;
    let want: Vec<f32> = xf.iter().enumerate().map(|(i, v)| v + bf[i % n]).collect();
    Ok(compare(
        "add_bias",
        format!("[{rows}, {n}] + [{n}]"),
        &got,
        &want,
        1e-2,
        1e-2,
    ))
}

/// Gated attention's output gate: the attention rows times σ of the gates that ride after
/// v in the fused projection (the fused QKV shape of the other checks).
fn check_sigmoid_gate(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes) -> Result<CheckRow> {
    let (tokens, nh, nkv, hd) = qkv(z);
    let width = nh * hd;
    let stride = (2 * nh + 2 * nkv) * hd; // [q | k | v | gates]
    let (xb, xf) = rand_bf16(rng, tokens * width, 3.0);
    let (gb, gf) = rand_bf16(rng, tokens * stride, 6.0);
    let gates_at = (nh + 2 * nkv) * hd;
    let mut m = Mem::new(exec);
    let (x_d, g_d) = (m.upload(&xb)?, m.upload(&gb)?);
    let gates = g_d.at(gates_at);
    exec.launch(&kernels::sigmoid_gate(x_d, gates, tokens, width, stride))?;
    let got = m.bf16(x_d, tokens * width)?;
    let want: Vec<f32> = (xf.iter().enumerate())
        .map(|(i, x)| x * ops::sigmoid(gf[(i / width) * stride + gates_at + i % width]))
        .collect();
    Ok(compare(
        "sigmoid_gate",
        format!("[{tokens}, {width}] × σ(gates at {gates_at} of {stride})"),
        &got,
        &want,
        1e-2,
        1e-2,
    ))
}

/// A Gated DeltaNet layer: Qwen3.5's real shape on the GPU, a small one on the emulator,
/// its value heads grouped by key head (transformers') or tiled (llama.cpp's GGUF).
fn delta_shape(z: CheckSizes, tiled: bool) -> (DeltaShape, usize) {
    let value_heads = match tiled {
        true => ValueHeadOrder::Tiled,
        false => ValueHeadOrder::Grouped,
    };
    let (k_heads, v_heads, dk, dv, tokens) = z.pick((16, 32, 128, 128, 37), (2, 4, 16, 32, 5));
    let s = DeltaShape {
        k_heads,
        v_heads,
        dk,
        dv,
        kernel: 4,
        value_heads,
    };
    (s, tokens)
}

fn rand_f32(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// The causal conv over a sequence's rows (strided, as in the fused projection),
/// continuing a random tail: every output and the tail it leaves, against
/// `delta_net::conv_step` row by row.
fn check_delta_conv(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes) -> Result<CheckRow> {
    let (s, tokens) = delta_shape(z, false);
    let c = s.conv_channels();
    let stride = c + 40;
    let (xb, xf) = rand_bf16(rng, tokens * stride, 2.0); // [tokens, stride]
    let mut tail = rand_f32(rng, s.conv_tail_len(), 2.0); // [kernel - 1, c]
    let w = rand_f32(rng, c * s.kernel, 0.5); // [c, kernel]
    let mut m = Mem::new(exec);
    let (x_d, tail_d, w_d) = (m.upload(&xb)?, m.upload(&tail)?, m.upload(&w)?);
    let out_d = m.zeros::<f32>(tokens * c)?;
    exec.launch(&kernels::delta_conv(
        x_d, tail_d, w_d, out_d, tokens, stride, s,
    ))?;
    let mut got = m.download::<f32>(out_d, tokens * c)?;
    got.extend(m.download::<f32>(tail_d, s.conv_tail_len())?);
    let mut want = vec![0.0f32; tokens * c];
    for (r, o) in want.chunks_exact_mut(c).enumerate() {
        delta_net::conv_step(s, &mut tail, &xf[r * stride..r * stride + c], &w, o);
    }
    want.extend(tail);
    Ok(compare(
        "delta_conv",
        format!("{tokens} rows of {c} channels, kernel {}", s.kernel),
        &got,
        &want,
        1e-5,
        1e-5,
    ))
}

/// The gated delta rule over a sequence's rows from a random state: every output and the
/// final state, against `delta_net::gates` and `delta_step` row by row.
fn check_delta_rule(
    exec: &dyn Exec,
    rng: &mut StdRng,
    z: CheckSizes,
    tiled: bool,
) -> Result<CheckRow> {
    let (s, tokens) = delta_shape(z, tiled);
    let (c, vd, nv) = (s.conv_channels(), s.v_heads * s.dv, s.v_heads);
    let kd = s.k_heads * s.dk;
    let ba_stride = 2 * nv + 24;
    let conv = rand_f32(rng, tokens * c, 1.0); // [tokens, c]
    let (bab, baf) = rand_bf16(rng, tokens * ba_stride, 3.0); // [tokens, b | a | ..]
    let mut state = rand_f32(rng, s.state_len(), 0.5);
    let decay_rate: Vec<f32> = rand_f32(rng, nv, 1.0).iter().map(|x| -x.exp()).collect();
    let dt_bias = rand_f32(rng, nv, 1.0);
    let mut m = Mem::new(exec);
    let (conv_d, ba_d, state_d) = (m.upload(&conv)?, m.upload(&bab)?, m.upload(&state)?);
    let (a_d, dt_d) = (m.upload(&decay_rate)?, m.upload(&dt_bias)?);
    let out_d = m.zeros::<f32>(tokens * vd)?;
    exec.launch(&kernels::delta_rule(
        conv_d, ba_d, state_d, a_d, dt_d, out_d, tokens, ba_stride, s,
    ))?;
    let mut got = m.download::<f32>(out_d, tokens * vd)?;
    got.extend(m.download::<f32>(state_d, s.state_len())?);
    let mut want = vec![0.0f32; tokens * vd];
    let (mut g, mut beta) = (vec![0.0f32; nv], vec![0.0f32; nv]);
    for (r, o) in want.chunks_exact_mut(vd).enumerate() {
        let row = &conv[r * c..(r + 1) * c];
        let (b, a) = baf[r * ba_stride..r * ba_stride + 2 * nv].split_at(nv);
        delta_net::gates(a, b, &decay_rate, &dt_bias, &mut g, &mut beta);
        let (q, rest) = row.split_at(kd);
        let (k, v) = rest.split_at(kd);
        delta_net::delta_step(s, &mut state, q, k, v, &g, &beta, o);
    }
    want.extend(state);
    Ok(compare(
        "delta_rule",
        format!(
            "{tokens} rows, {} key / {nv} value heads ({:?}), dk {} dv {}",
            s.k_heads, s.value_heads, s.dk, s.dv
        ),
        &got,
        &want,
        1e-4,
        1e-4,
    ))
}

/// The gated RMSNorm of each (row, value head) into bf16, z read from a strided row,
/// against `delta_net::gated_rms_norm`.
fn check_delta_gated_norm(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes) -> Result<CheckRow> {
    let (s, tokens) = delta_shape(z, false);
    let vd = s.v_heads * s.dv;
    let z_stride = vd + 72;
    let o = rand_f32(rng, tokens * vd, 2.0);
    let (zb, zf) = rand_bf16(rng, tokens * z_stride, 3.0);
    let w = rand_f32(rng, s.dv, 1.5);
    let eps = 1e-6f32;
    let mut m = Mem::new(exec);
    let (o_d, z_d, w_d) = (m.upload(&o)?, m.upload(&zb)?, m.upload(&w)?);
    let out_d = m.zeros::<u16>(tokens * vd)?;
    exec.launch(&kernels::delta_gated_norm(
        o_d, z_d, w_d, out_d, tokens, z_stride, s, eps,
    ))?;
    let got = m.bf16(out_d, tokens * vd)?;
    let mut want = vec![0.0f32; tokens * vd];
    for (r, out) in want.chunks_exact_mut(vd).enumerate() {
        let zr = &zf[r * z_stride..r * z_stride + vd];
        delta_net::gated_rms_norm(&o[r * vd..(r + 1) * vd], zr, &w, eps, out);
    }
    Ok(compare(
        "delta_gated_norm",
        format!("[{tokens}, {} × {}] → bf16", s.v_heads, s.dv),
        &got,
        &want,
        1e-2,
        1e-2,
    ))
}

/// SwiGLU or GeGLU (at Qwen3-4B's and Gemma 3 4B's intermediate sizes).
fn check_gated(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes, act: MlpAct) -> Result<CheckRow> {
    let (name, inter) = match act {
        MlpAct::Silu => ("silu_mul", 9728),
        MlpAct::GeluTanh => ("gelu_tanh_mul", 10240),
    };
    let (tokens, inter) = z.pick((37, inter), (5, 320));
    let (gb, gf) = rand_bf16(rng, tokens * 2 * inter, 4.0); // [tokens, gate | up]
    let mut m = Mem::new(exec);
    let g_d = m.upload(&gb)?;
    let out = m.zeros::<u16>(tokens * inter)?; // [tokens, inter]
    exec.launch(&kernels::gated_mul(act, g_d, out, tokens, inter))?;
    let got = m.bf16(out, tokens * inter)?;
    let mut want = vec![0.0; tokens * inter];
    ops::gated_act(act, &gf, inter, &mut want);
    Ok(compare(
        name,
        format!("[{tokens}, 2 × {inter}]"),
        &got,
        &want,
        1e-2,
        1e-2,
    ))
}

/// gpt-oss's expert activation on values spread past its limit (±7) both ways, so that
/// the clamps of gate and up are both taken and missed.
fn check_clamped_swiglu(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes) -> Result<CheckRow> {
    let (alpha, limit) = (1.702, 7.0);
    let (tokens, inter) = z.pick((37, 2880), (5, 320));
    let (gb, gf) = rand_bf16(rng, tokens * 2 * inter, 12.0); // [tokens, gate | up]
    let mut m = Mem::new(exec);
    let g_d = m.upload(&gb)?;
    let out = m.zeros::<u16>(tokens * inter)?; // [tokens, inter]
    let act = ExpertAct::ClampedSwiglu { alpha, limit };
    exec.launch(&kernels::expert_act(act, g_d, out, tokens, inter))?;
    let got = m.bf16(out, tokens * inter)?;
    let mut want = vec![0.0; tokens * inter];
    ops::clamped_swiglu_mul(&gf, inter, alpha, limit, &mut want);
    Ok(compare(
        "clamped_swiglu_mul",
        format!("[{tokens}, 2 × {inter}], alpha {alpha}, limit {limit}"),
        &got,
        &want,
        1e-2,
        1e-2,
    ))
}

fn check_kv_store(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes) -> Result<CheckRow> {
    let (tokens, n_slots) = (qkv(z).0, z.pick(256, 32));
    let mut perm: Vec<i32> = (0..n_slots as i32).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, rng.random_range(0..=i));
    }
    let mut slots = perm[..tokens].to_vec(); // [tokens], distinct
    slots[3] = -1; // padding
    kv_store_case(exec, rng, z, slots, n_slots, None)
}

/// A sliding-window ring: positions past its rows wrap (one step's rows stay distinct).
fn check_kv_store_ring(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes) -> Result<CheckRow> {
    let (tokens, rows) = (qkv(z).0, z.pick(256, 32));
    let pos0 = rng.random_range(rows..5 * rows) as i32;
    let slots: Vec<i32> = (pos0..pos0 + tokens as i32).collect(); // positions
    kv_store_case(exec, rng, z, slots, rows, Some(rows))
}

fn kv_store_case(
    exec: &dyn Exec,
    rng: &mut StdRng,
    z: CheckSizes,
    slots: Vec<i32>,
    n_slots: usize,
    ring: Option<usize>,
) -> Result<CheckRow> {
    let (tokens, nh, nkv, hd) = qkv(z);
    let (stride, kv_dim) = ((nh + 2 * nkv) * hd, nkv * hd);
    let (qkvb, qkvf) = rand_bf16(rng, tokens * stride, 1.0); // [tokens, stride]
    let mut m = Mem::new(exec);
    let qkv_d = m.upload(&qkvb)?;
    // K and V are views into the fused QKV rows.
    let (k_view, v_view) = (qkv_d.at(nh * hd), qkv_d.at((nh + nkv) * hd));
    let s_d = m.upload(&slots)?;
    let kc = m.zeros::<u16>(n_slots * kv_dim)?; // [n_slots, kv_dim]
    let vc = m.zeros::<u16>(n_slots * kv_dim)?;
    exec.launch(&kernels::kv_store(
        k_view, v_view, kc, vc, s_d, tokens, kv_dim, stride, ring,
    ))?;
    let mut got = m.bf16(kc, n_slots * kv_dim)?;
    got.extend(m.bf16(vc, n_slots * kv_dim)?);
    let (mut kw, mut vw) = (vec![0.0; n_slots * kv_dim], vec![0.0; n_slots * kv_dim]);
    twins::kv_store(
        &qkvf[nh * hd..],
        &qkvf[(nh + nkv) * hd..],
        stride,
        kv_dim,
        &slots,
        ring,
        &mut kw,
        &mut vw,
    );
    kw.extend(vw);
    let what = if ring.is_some() { "ring rows" } else { "slots" };
    Ok(compare(
        "kv_store",
        format!("{tokens} tokens → {n_slots} {what} × {kv_dim}"),
        &got,
        &kw,
        0.0,
        0.0,
    ))
}

fn rand_logits(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

fn check_argmax(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes) -> Result<CheckRow> {
    let (rows, vocab) = z.pick((8, 151_936), (2, 5000));
    let logits = rand_logits(rng, rows * vocab, 10.0); // f32 [rows, vocab]
    let mut m = Mem::new(exec);
    let l_d = m.upload(&logits)?;
    let out = m.zeros::<i32>(rows)?;
    exec.launch(&kernels::argmax(l_d, out, rows, vocab))?;
    let got: Vec<f32> = m
        .download::<i32>(out, rows)?
        .iter()
        .map(|&i| i as f32)
        .collect();
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

fn check_sample(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes) -> Result<CheckRow> {
    let (rows, vocab) = z.pick((64, 151_936), (8, 4000));
    let mut mismatches = 0;
    let mut total = 0;
    // (temperature, top_k, top_p): the CLI's defaults and typical chat settings.
    for &(temp, top_k, top_p) in &[
        (1.0f32, 0usize, 1.0f32),
        (0.7, 50, 0.9),
        (0.6, 20, 0.95),
        (1.0, 0, 0.8),
    ] {
        let logits = rand_logits(rng, rows * vocab, 8.0); // f32 [rows, vocab]
        let u: Vec<f32> = (0..rows).map(|_| rng.random::<f32>()).collect(); // [rows]
        let mut m = Mem::new(exec);
        let (l_d, u_d) = (m.upload(&logits)?, m.upload(&u)?);
        let out = m.zeros::<i32>(rows)?;
        exec.launch(&kernels::sample(
            l_d, u_d, out, rows, vocab, temp, top_k, top_p,
        ))?;
        let got = m.download::<i32>(out, rows)?;
        for (r, &g) in got.iter().enumerate() {
            let want = twins::sample(
                &logits[r * vocab..(r + 1) * vocab],
                temp,
                top_k,
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

fn max_of(v: &[i32]) -> usize {
    v.iter().copied().max().unwrap_or(0) as usize
}

/// Prefill: a fresh prompt, a chunk after a prefix (263 tokens; Small 73), and a one-token
/// tail; several query tiles (16) and key tiles (64) each; scattered blocks of 16.
fn check_prefill(
    exec: &dyn Exec,
    rng: &mut StdRng,
    z: CheckSizes,
    heads: (usize, usize),
    hd: usize,
) -> Result<CheckRow> {
    let (q_lens, ctx) = z.pick(
        ([100i32, 37, 1], [100i32, 300, 20]),
        ([20, 17, 1], [20, 90, 5]),
    );
    let case = AttnCase {
        attn: Attn::Prefill,
        q_lens: q_lens.to_vec(),
        ctx: ctx.to_vec(),
        layout: Layout::Paged(16),
        window: None,
        scale: 1.0 / (hd as f32).sqrt(),
        sinks: false,
        tol: (2e-2, 2e-2),
    };
    attn_check(exec, rng, heads, hd, case)
}

/// Decode: one key, and contexts over several 512-key splits (the last one partial), in
/// scattered blocks of `block_size`, or (0) the contiguous layout of one block per sequence.
fn check_decode(
    exec: &dyn Exec,
    rng: &mut StdRng,
    z: CheckSizes,
    heads: (usize, usize),
    hd: usize,
    block_size: usize,
) -> Result<CheckRow> {
    let case = AttnCase {
        attn: Attn::Decode,
        q_lens: vec![1; 3],
        ctx: z.pick([1i32, 700, 5000], [1, 300, 1100]).to_vec(),
        layout: match block_size {
            0 => Layout::Contiguous,
            bs => Layout::Paged(bs),
        },
        window: None,
        scale: 1.0 / (hd as f32).sqrt(),
        sinks: false,
        tol: (2e-2, 2e-2),
    };
    attn_check(exec, rng, heads, hd, case)
}

/// Sliding windows and query runs that start off a multiple of 4 (a warp's four queries
/// then straddle a key tile's start, and the later ones must still see that tile), with
/// a score scale other than 1/√head_dim; a tighter tolerance than the plain checks, so
/// that one key missed or taken too many shows. Prefill: chunks after a prefix at
/// positions ≡ 1 mod 4, a window shorter than the context and not a tile multiple.
/// Decode: contexts over several splits, the window starting past the first.
fn check_window(
    exec: &dyn Exec,
    rng: &mut StdRng,
    z: CheckSizes,
    hd: usize,
    attn: Attn,
    window: Option<usize>,
    layout: Layout,
) -> Result<CheckRow> {
    let (q_lens, ctx) = window_runs(z, attn);
    let case = AttnCase {
        attn,
        q_lens,
        ctx,
        layout,
        window,
        scale: 1.3 / (hd as f32).sqrt(),
        sinks: false,
        tol: (2e-3, 2e-2),
    };
    attn_check(exec, rng, heads(z, hd), hd, case)
}

/// `check_window`'s and `check_sinks`' (query lengths, contexts): prefill chunks after a
/// prefix at positions ≡ 1 mod 4; decode contexts over several splits.
fn window_runs(z: CheckSizes, attn: Attn) -> (Vec<i32>, Vec<i32>) {
    match attn {
        Attn::Prefill => {
            let (q, c) = z.pick(([100, 37, 1], [357, 302, 20]), ([40, 3, 20], [101, 70, 20]));
            (q.to_vec(), c.to_vec())
        }
        Attn::Decode => (vec![1; 3], z.pick([1, 700, 5000], [1, 300, 1100]).to_vec()),
    }
}

/// gpt-oss's attention: head_dim 64, 64 query heads over 8 KV heads (4 and 2 small), a
/// window, and per-head sinks from −4 to 8 (the scores' own range and well above it: some
/// heads' sinks take most of the weight), at `check_window`'s tight tolerance.
fn check_sinks(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes, attn: Attn) -> Result<CheckRow> {
    let (q_lens, ctx) = window_runs(z, attn);
    let case = AttnCase {
        attn,
        q_lens,
        ctx,
        layout: Layout::Paged(16),
        window: Some(z.pick(128, 37)),
        scale: 1.0 / 8.0,
        sinks: true,
        tol: (2e-3, 2e-2),
    };
    attn_check(exec, rng, z.pick((64, 8), (4, 2)), 64, case)
}

/// The CPU twin's view of a launch's attention shape.
fn twin_shape(a: &PagedAttn) -> twins::PagedShape {
    twins::PagedShape {
        num_heads: a.num_heads,
        num_kv_heads: a.num_kv_heads,
        head_dim: a.head_dim,
        block_size: a.block_size,
        max_blocks: a.max_blocks,
        scale: a.scale,
        window: a.window,
    }
}

#[derive(Clone, Copy)]
enum Attn {
    Prefill,
    Decode,
}

#[derive(Clone, Copy)]
enum Layout {
    /// Scattered blocks of this many tokens.
    Paged(usize),
    /// One block per sequence, as long as the longest context (a contiguous slot).
    Contiguous,
    /// Each sequence's keys in a ring of its window plus its step (`window − 1 + q_len`
    /// rows; key p at row p % rows): a block table whose row `b` repeats block `b`.
    Ring,
}

/// One attention launch over random bf16 q, K and V.
struct AttnCase {
    attn: Attn,
    q_lens: Vec<i32>, // [batch] new tokens (decode: 1 each)
    ctx: Vec<i32>,    // [batch] keys, new tokens included
    layout: Layout,
    window: Option<usize>,
    scale: f32,
    sinks: bool,     // random per-head sinks (gpt-oss)
    tol: (f32, f32), // (atol, rtol)
}

/// Runs `case` through the builders' launch and compares with the CPU twin. Decode's
/// split scratch holds NaN, as stale memory might: a split the reduce should not merge
/// (one wholly before a window) poisons the output if it is merged.
fn attn_check(
    exec: &dyn Exec,
    rng: &mut StdRng,
    (nh, nkv): (usize, usize),
    hd: usize,
    case: AttnCase,
) -> Result<CheckRow> {
    let AttnCase {
        attn,
        q_lens,
        ctx,
        layout,
        window,
        scale,
        sinks,
        tol,
    } = case;
    let batch = ctx.len();
    let max_q = max_of(&q_lens);
    let (tables, max_blocks, block_size, n_slots) = match layout {
        Layout::Paged(bs) => {
            let (t, mb, n) = block_tables(rng, &ctx, bs);
            (t, mb, bs, n)
        }
        Layout::Contiguous => {
            let bs = max_of(&ctx);
            let (t, mb, n) = block_tables(rng, &ctx, bs);
            (t, mb, bs, n)
        }
        Layout::Ring => {
            let rows = window.expect("a ring holds a window") - 1 + max_q;
            let mb = max_of(&ctx).div_ceil(rows);
            let t: Vec<i32> = (0..batch as i32).flat_map(|b| vec![b; mb]).collect();
            (t, mb, rows, batch * rows)
        }
    };
    let cu: Vec<i32> = std::iter::once(0)
        .chain(q_lens.iter().scan(0, |a, &l| {
            *a += l;
            Some(*a)
        }))
        .collect(); // [batch + 1]
    let total_q = cu[batch] as usize;
    let kv_dim = nkv * hd;
    let (qb, qf) = rand_bf16(rng, total_q * nh * hd, 1.0); // [total_q, nh × hd]
    let (kb, kf) = rand_bf16(rng, n_slots * kv_dim, 1.0); // [n_slots, kv_dim]
    let (vb, vf) = rand_bf16(rng, n_slots * kv_dim, 1.0);
    let sinks: Option<Vec<f32>> =
        sinks.then(|| (0..nh).map(|_| rng.random_range(-4.0..8.0)).collect());
    let mut m = Mem::new(exec);
    let sinks_d = sinks.as_deref().map(|s| m.upload(s)).transpose()?;
    let a = PagedAttn {
        q: m.upload(&qb)?,
        k: m.upload(&kb)?,
        v: m.upload(&vb)?,
        out: m.zeros::<u16>(total_q * nh * hd)?,
        cu_seqlens: m.upload(&cu)?, // not read by the decode kernels
        ctx_lens: m.upload(&ctx)?,
        tables: m.upload(&tables)?, // [batch, max_blocks]
        max_blocks,
        block_size,
        num_heads: nh,
        num_kv_heads: nkv,
        q_stride: nh * hd,
        head_dim: hd,
        batch,
        max_q_len: max_q,
        max_ctx: max_of(&ctx),
        scale,
        window,
        sinks: sinks_d,
    };
    let what = match attn {
        Attn::Prefill => {
            exec.launch(&kernels::attn_prefill(&a))?;
            "prefill"
        }
        Attn::Decode => {
            let (split_len, max_splits) = (512, max_of(&ctx).div_ceil(512));
            let parts = batch * nh * max_splits;
            let scratch = DecodeScratch {
                part_o: m.upload(&vec![f32::NAN; parts * hd])?,
                part_ml: m.upload(&vec![f32::NAN; parts * 2])?,
                split_len,
                max_splits,
            };
            for l in kernels::attn_decode(&a, &scratch)? {
                exec.launch(&l)?;
            }
            "decode"
        }
    };
    let got = m.bf16(a.out, total_q * nh * hd)?;
    let mut want = vec![0.0; total_q * nh * hd];
    let shape = twin_shape(&a);
    let sinks = sinks.as_deref();
    twins::paged_attention(&qf, &kf, &vf, &cu, &ctx, &tables, shape, sinks, &mut want);
    let window = window.map_or(String::new(), |w| format!(", window {w}"));
    let window = if sinks.is_some() {
        format!("{window}, sinks")
    } else {
        window
    };
    Ok(compare(
        &format!("attn_{what}_hd{hd}"),
        format!("q {q_lens:?} ctx {ctx:?} {nh}/{nkv} heads{window}, block {block_size}"),
        &got,
        &want,
        tol.0,
        tol.1,
    ))
}

/// `Exec::gemm` (cuBLAS on the GPU), bf16 in, f32 out.
fn check_linear(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes) -> Result<CheckRow> {
    let (rows, k, n) = z.pick((37, 2560, 1024), (5, 320, 96));
    let (xb, xf) = rand_bf16(rng, rows * k, 1.0); // [rows, k]
    let (wb, wf) = rand_bf16(rng, n * k, 0.05); // [n, k]
    let mut m = Mem::new(exec);
    let (x_d, w_d) = (m.upload(&xb)?, m.upload(&wb)?);
    let out = m.zeros::<f32>(rows * n)?; // f32 [rows, n]
    let shape = GemmShape { m: rows, k, n };
    exec.gemm(x_d, w_d, GemmOut::F32(out), shape)?;
    let got = m.download::<f32>(out, rows * n)?;
    let mut want = vec![0.0; rows * n];
    ops::linear(&xf, &wf, None, &mut want, rows, k, n);
    Ok(compare(
        "cublas linear bf16→f32",
        format!("[{rows}, {k}] · [{n}, {k}]ᵀ"),
        &got,
        &want,
        1e-3,
        1e-3,
    ))
}

/// The batch-invariant GEMM against the CPU linear, both output types, and against itself:
/// the first rows computed alone (m = 1 and m = 7: other tile heights, other grids) must
/// equal, bit for bit, the same rows of the m-row product.
fn check_gemm_fixed(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes) -> Result<CheckRow> {
    let (rows, k, n) = z.pick((77, 2560, 1000), (21, 200, 130)); // k, n: not tile multiples
    let (xb, xf) = rand_bf16(rng, rows * k, 1.0); // [rows, k]
    let (wb, wf) = rand_bf16(rng, n * k, 0.05); // [n, k]
    let mut m = Mem::new(exec);
    let (x_d, w_d) = (m.upload(&xb)?, m.upload(&wb)?);
    let run = |m: &mut Mem, rows: usize| -> Result<(Vec<f32>, Vec<f32>)> {
        let (of, ob) = (m.zeros::<f32>(rows * n)?, m.zeros::<u16>(rows * n)?);
        let shape = GemmShape { m: rows, k, n };
        exec.launch(&kernels::gemm_fixed(x_d, w_d, GemmOut::F32(of), shape))?;
        exec.launch(&kernels::gemm_fixed(x_d, w_d, GemmOut::Bf16(ob), shape))?;
        Ok((m.download::<f32>(of, rows * n)?, m.bf16(ob, rows * n)?))
    };
    let (got, got_bf16) = run(&mut m, rows)?;
    let mut note = String::new();
    for sub in [1, 7] {
        let (alone, alone_bf16) = run(&mut m, sub)?;
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        if !same(&alone, &got[..sub * n]) || !same(&alone_bf16, &got_bf16[..sub * n]) {
            note = format!("rows computed with m = {sub} differ from the same rows at m = {rows}");
        }
    }
    let mut want = vec![0.0; rows * n];
    ops::linear(&xf, &wf, None, &mut want, rows, k, n);
    let bf16_err = got_bf16
        .iter()
        .zip(&want)
        .any(|(g, w)| (g - w).abs() > 1e-2 + 8e-3 * w.abs());
    if bf16_err {
        note = "bf16 output outside 1e-2 + 8e-3·|cpu|".into();
    }
    let mut row = compare(
        "gemm_fixed (batch-invariant)",
        format!("[{rows}, {k}] · [{n}, {k}]ᵀ"),
        &got,
        &want,
        1e-3,
        1e-3,
    );
    if !note.is_empty() {
        row.pass = false;
        row.note = note;
    }
    Ok(row)
}

/// Bit-for-bit equality of `got` and `want` as a check row (sparse decode's kernels must
/// choose the pages their host references choose).
fn bitwise_row(name: &str, shape: String, got: &[f32], want: &[f32]) -> CheckRow {
    let mut row = compare(name, shape, got, want, 0.0, 0.0);
    let differ = got.len() != want.len()
        || got
            .iter()
            .zip(want)
            .any(|(g, w)| g.to_bits() != w.to_bits());
    row.tolerance = "bitwise".into();
    if differ {
        row.pass = false;
        row.note = "not bit-for-bit equal to crate::sparse".into();
    }
    row
}

/// Random bf16 keys from a coarse grid with repeats and both zeros, so the min/max tie
/// rules (first value kept, -0 vs +0) matter.
fn coarse_keys(rng: &mut StdRng, n: usize) -> Vec<u16> {
    (0..n)
        .map(|_| match rng.random_range(0..8) {
            0 => 0x8000, // -0.0
            1 => 0x0000,
            _ => twins::f32_to_bf16(rng.random_range(-8i32..8) as f32 * 0.375),
        })
        .collect()
}

fn as_bf16(bits: &[u16]) -> Vec<half::bf16> {
    bits.iter().map(|&b| half::bf16::from_bits(b)).collect()
}

/// The page metadata kernel against `crate::sparse::page_bounds`, bit for bit (min, max
/// and the mask planes; the emulator's page needs two mask rows a plane).
fn check_page_bounds(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes) -> Result<CheckRow> {
    let (pages, page_size, row) = z.pick((300, 16, 1024), (13, 21, 96));
    let keys = coarse_keys(rng, pages * page_size * row); // [pages · page_size, row]
    let n = pages * crate::sparse::meta_rows(page_size) * row; // [pages, meta_rows, row]
    let mut m = Mem::new(exec);
    let k_d = m.upload(&keys)?;
    let b_d = m.zeros::<u16>(n)?;
    exec.launch(&crate::device::cuda::sparse::page_bounds(
        k_d,
        b_d,
        pages,
        page_size,
        row,
        crate::sparse::KEY_BITS,
    ))?;
    let got = m.download::<u16>(b_d, n)?;
    let mut want = vec![half::bf16::ZERO; n];
    crate::sparse::page_bounds(&as_bf16(&keys), row, page_size, &mut want);
    // Compared as their bit patterns (a mask entry read as a bf16 may be a NaN).
    let got: Vec<f32> = got.iter().map(|&b| b as f32).collect();
    let want: Vec<f32> = want.iter().map(|b| b.to_bits() as f32).collect();
    Ok(bitwise_row(
        "page_bounds (sparse)",
        format!("{pages} pages × {page_size} rows × {row}"),
        &got,
        &want,
    ))
}

/// The box-bound kernel against `crate::sparse::head_bounds`, bit for bit, over
/// metadata the reference made from random keys, with GQA groups (a wrong head → KV head
/// mapping changes the bounds) and pages of more than one mask row.
fn check_head_bounds(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes) -> Result<CheckRow> {
    let (pages, page_size, (nh, nkv), hd) = z.pick((2048, 32, (32, 8), 128), (37, 20, (6, 2), 64));
    let heads = ops::AttnHeads::causal(nh, nkv, hd);
    let row = nkv * hd;
    let (q, _) = rand_bf16(rng, nh * hd, 2.0); // [num_heads, head_dim]
    let keys = as_bf16(&coarse_keys(rng, pages * page_size * row));
    let mut meta = vec![half::bf16::ZERO; pages * crate::sparse::meta_rows(page_size) * row];
    crate::sparse::page_bounds(&keys, row, page_size, &mut meta); // [pages, meta_rows, row]
    let meta_bits: Vec<u16> = meta.iter().map(|b| b.to_bits()).collect();
    let mut m = Mem::new(exec);
    let (q_d, b_d) = (m.upload(&q)?, m.upload(&meta_bits)?);
    let out = m.zeros::<f32>(pages * nh)?; // [pages, num_heads]
    exec.launch(&crate::device::cuda::sparse::head_bounds(
        q_d,
        b_d,
        out,
        pages,
        page_size,
        heads,
        crate::sparse::KEY_BITS,
    ))?;
    let got = m.download::<f32>(out, pages * nh)?;
    let want = crate::sparse::head_bounds(&as_bf16(&q), &meta, heads, pages, page_size);
    Ok(bitwise_row(
        "head_bounds (sparse)",
        format!("{pages} pages × {page_size} rows, {nh}/{nkv} heads × {hd}"),
        &got,
        &want,
    ))
}

/// Qwen3.5 MoE's router on the GPU (256 experts, top 8), a small one on the emulator:
/// (tokens, experts, top_k).
fn moe_shape(z: CheckSizes) -> (usize, usize, usize) {
    z.pick((37, 256, 8), (9, 16, 4))
}

/// Each token's experts and weights against `model::moe::route`, on logits with ties and
/// NaNs: the ids exactly, the weights within 1e-6. `bias`: gpt-oss's router bias (coarse
/// too, so biased logits still tie), added to the logits first.
fn check_moe_route(
    exec: &dyn Exec,
    rng: &mut StdRng,
    z: CheckSizes,
    bias: bool,
) -> Result<CheckRow> {
    let (tokens, experts, top_k) = moe_shape(z);
    // Coarse values (many ties), a NaN in every third row.
    let mut logits: Vec<f32> = (0..tokens * experts)
        .map(|_| rng.random_range(-8..8) as f32 * 0.5)
        .collect();
    for r in (0..tokens).step_by(3) {
        logits[r * experts + rng.random_range(0..experts)] = f32::NAN;
    }
    let bias: Option<Vec<f32>> = bias.then(|| {
        (0..experts)
            .map(|_| rng.random_range(-4..4) as f32 * 0.5)
            .collect()
    });
    let mut m = Mem::new(exec);
    let l_d = m.upload(&logits)?;
    let b_d = bias.as_deref().map(|b| m.upload(b)).transpose()?;
    let (ids_d, w_d) = (
        m.zeros::<i32>(tokens * top_k)?,
        m.zeros::<f32>(tokens * top_k)?,
    );
    exec.launch(&kernels::moe_route(
        l_d, b_d, ids_d, w_d, tokens, experts, top_k,
    ))?;
    if let Some(b) = &bias {
        for row in logits.chunks_exact_mut(experts) {
            row.iter_mut().zip(b).for_each(|(l, b)| *l += b);
        }
    }
    let ids = m.download::<i32>(ids_d, tokens * top_k)?;
    let weights = m.download::<f32>(w_d, tokens * top_k)?;
    let moe = crate::model::config::Moe {
        num_experts: experts,
        top_k,
        act: crate::model::config::ExpertAct::Silu,
        shared_intermediate: None,
        biases: false,
    };
    let want = crate::model::moe::route(&logits, moe);
    let want_ids: Vec<i32> = want.iter().flatten().map(|c| c.expert as i32).collect();
    let want_w: Vec<f32> = want.iter().flatten().map(|c| c.weight).collect();
    let biased = if bias.is_some() { ", router bias" } else { "" };
    let mut row = compare(
        "moe_route",
        format!("{tokens} tokens, {experts} experts, top {top_k}{biased}"),
        &weights,
        &want_w,
        1e-6,
        1e-5,
    );
    if ids != want_ids {
        row.pass = false;
        row.note = "chosen experts differ".into();
    }
    Ok(row)
}

/// Every (token, chosen expert) row through its expert's stacked matrix: gate/up (the
/// token's input for each of its rows) and down (each row its own input), against f32
/// dots of the same bf16 values; `bias`: with each expert's output biases (gpt-oss).
fn check_moe_matvec(
    exec: &dyn Exec,
    rng: &mut StdRng,
    z: CheckSizes,
    bias: bool,
) -> Result<CheckRow> {
    let (tokens, experts, top_k) = moe_shape(z);
    let (hidden, inter) = z.pick((2048, 512), (64, 48));
    let rows = tokens * top_k;
    let ids: Vec<i32> = (0..rows)
        .map(|_| rng.random_range(0..experts as i32))
        .collect();
    let (xb, xf) = rand_bf16(rng, tokens * hidden, 1.0);
    let (gub, guf) = rand_bf16(rng, experts * 2 * inter * hidden, 0.1);
    let (ab, af) = rand_bf16(rng, rows * inter, 1.0);
    let (db, df) = rand_bf16(rng, experts * hidden * inter, 0.1);
    // [experts, 2 inter] and [experts, hidden]
    let (gu_bias, d_bias) = if bias {
        let (a, b) = (
            rand_bf16(rng, experts * 2 * inter, 2.0),
            rand_bf16(rng, experts * hidden, 2.0),
        );
        (Some(a), Some(b))
    } else {
        (None, None)
    };
    let mut m = Mem::new(exec);
    let (x_d, ids_d, gu_d) = (m.upload(&xb)?, m.upload(&ids)?, m.upload(&gub)?);
    let (a_d, d_d) = (m.upload(&ab)?, m.upload(&db)?);
    let gub_d = gu_bias.as_ref().map(|b| m.upload(&b.0)).transpose()?;
    let db_d = d_bias.as_ref().map(|b| m.upload(&b.0)).transpose()?;
    let (gu_out, d_out) = (
        m.zeros::<u16>(rows * 2 * inter)?,
        m.zeros::<u16>(rows * hidden)?,
    );
    exec.launch(&kernels::moe_matvec(
        x_d,
        ids_d,
        gu_d,
        gub_d,
        gu_out,
        rows,
        2 * inter,
        hidden,
        top_k,
    ))?;
    exec.launch(&kernels::moe_matvec(
        a_d, ids_d, d_d, db_d, d_out, rows, hidden, inter, 1,
    ))?;
    let mut got = m.bf16(gu_out, rows * 2 * inter)?;
    got.extend(m.bf16(d_out, rows * hidden)?);
    let matvec = |x: &[f32], w: &[f32], b: Option<&[f32]>, (n, k): (usize, usize), x_div: usize| {
        let mut out = Vec::with_capacity(ids.len() * n);
        for (r, &e) in ids.iter().enumerate() {
            let (e, xr) = (e as usize, &x[(r / x_div) * k..][..k]);
            for j in 0..n {
                let wr = &w[(e * n + j) * k..][..k];
                let dot: f32 = xr.iter().zip(wr).map(|(a, b)| a * b).sum();
                out.push(dot + b.map_or(0.0, |b| b[e * n + j]));
            }
        }
        out
    };
    let gu_b = gu_bias.as_ref().map(|b| b.1.as_slice());
    let mut want = matvec(&xf, &guf, gu_b, (2 * inter, hidden), top_k);
    let d_b = d_bias.as_ref().map(|b| b.1.as_slice());
    want.extend(matvec(&af, &df, d_b, (hidden, inter), 1));
    let biased = if bias { ", biases" } else { "" };
    Ok(compare(
        "moe_matvec",
        format!("{rows} rows of {experts} experts, hidden {hidden}, inter {inter}{biased}"),
        &got,
        &want,
        1e-2,
        1e-2,
    ))
}

/// The weighted sum of each token's chosen rows in slot order, plus σ(gate) times the
/// shared expert's output, against the same in f32.
fn check_moe_combine(exec: &dyn Exec, rng: &mut StdRng, z: CheckSizes) -> Result<CheckRow> {
    let (tokens, _, top_k) = moe_shape(z);
    let hidden = z.pick(2048, 64);
    let (yb, yf) = rand_bf16(rng, tokens * top_k * hidden, 2.0);
    let weights = rand_f32(rng, tokens * top_k, 1.0);
    let (sb, sf) = rand_bf16(rng, tokens * hidden, 2.0);
    let gate = rand_f32(rng, tokens, 3.0);
    let mut m = Mem::new(exec);
    let (y_d, w_d, s_d, g_d) = (
        m.upload(&yb)?,
        m.upload(&weights)?,
        m.upload(&sb)?,
        m.upload(&gate)?,
    );
    let (plain, with_shared) = (
        m.zeros::<u16>(tokens * hidden)?,
        m.zeros::<u16>(tokens * hidden)?,
    );
    let launch = |shared, out| kernels::moe_combine(y_d, w_d, shared, out, tokens, top_k, hidden);
    exec.launch(&launch(None, plain))?;
    exec.launch(&launch(Some((s_d, g_d)), with_shared))?;
    let mut got = m.bf16(plain, tokens * hidden)?;
    got.extend(m.bf16(with_shared, tokens * hidden)?);
    let mut want = Vec::with_capacity(got.len());
    for shared in [false, true] {
        for t in 0..tokens {
            for i in 0..hidden {
                let mut acc: f32 = (0..top_k)
                    .map(|s| yf[(t * top_k + s) * hidden + i] * weights[t * top_k + s])
                    .sum();
                if shared {
                    acc += ops::sigmoid(gate[t]) * sf[t * hidden + i];
                }
                want.push(acc);
            }
        }
    }
    Ok(compare(
        "moe_combine",
        format!("{tokens} tokens × top {top_k}, hidden {hidden}, without and with a shared expert"),
        &got,
        &want,
        1e-2,
        1e-2,
    ))
}
