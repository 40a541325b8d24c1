//! IQ4_NL, IQ4_XS and MXFP4 tensors read from a GGUF file are the values gguf-py (llama.cpp's own
//! Python package, an implementation strata's was not derived from) dequantizes, bit for
//! bit: strata's tensor table reads their types, shapes and offsets, and `quant.rs`
//! decodes their blocks. (The fused kernels are checked against `quant.rs` in
//! `device::cpu::fused`'s tests.)
//!
//! Needs `pip install gguf` (.ci/run installs it, pinned). Without it the test fails under
//! CI=true and is skipped, loudly, elsewhere.

mod common;

use rand::{rngs::StdRng, Rng, SeedableRng};
use strata::device::cpu::quant::{self, Format};
use strata::fuzz::gguf_writer::{GgufDoc, GgufTensor};
use strata::model::weights::read_gguf_header;

/// `rows` × `cols` random blocks of `format`, each with a small f16 scale (MXFP4: every
/// E8M0 scale byte, the subnormal and the largest ones included).
fn random_tensor(
    rng: &mut StdRng,
    name: &str,
    format: Format,
    id: u32,
    rows: usize,
    cols: usize,
) -> GgufTensor {
    let mut data: Vec<u8> = (0..rows * format.row_bytes(cols).unwrap())
        .map(|_| rng.random())
        .collect();
    for (i, block) in data.chunks_exact_mut(format.block_bytes()).enumerate() {
        if format == Format::Mxfp4 {
            block[0] = i as u8; // 0..=255 over 256 blocks
            continue;
        }
        let d = half::f16::from_f32(rng.random_range(-0.05..0.05));
        block[..2].copy_from_slice(&d.to_le_bytes());
    }
    GgufTensor {
        name: name.into(),
        dims: vec![rows as u64, cols as u64],
        ggml_type: id,
        data,
        offset: None,
    }
}

#[test]
fn iq4_and_mxfp4_tensors_are_what_gguf_py_dequantizes_bit_for_bit() {
    let Some(python) = common::python_with("gguf, numpy", "pip install gguf") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(20);
    let doc = GgufDoc {
        version: 3,
        metadata: vec![],
        tensors: vec![
            random_tensor(&mut rng, "nl", Format::Iq4Nl, 20, 3, 96),
            random_tensor(&mut rng, "xs", Format::Iq4Xs, 23, 2, 512),
            random_tensor(&mut rng, "xs.wide", Format::Iq4Xs, 23, 1, 1024),
            random_tensor(&mut rng, "mxfp4", Format::Mxfp4, 39, 8, 1024),
        ],
        layout_alignment: 32,
    };
    let bytes = doc.to_bytes();
    let dir = std::env::temp_dir().join(format!("strata-iq4-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("iq4.gguf");
    std::fs::write(&path, &bytes).unwrap();

    let content = read_gguf_header(&mut std::io::Cursor::new(&bytes), bytes.len() as u64)
        .expect("strata reads the IQ4 tensor table");
    let out = std::process::Command::new(&python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/gguf_iq4_reference.py"
        ))
        .arg(&path)
        .output()
        .expect("running python3");
    assert!(
        out.status.success(),
        "gguf_iq4_reference.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reference: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for t in &doc.tensors {
        let info = &content.tensors[&t.name];
        let want = &reference[&t.name];
        assert_eq!(
            serde_json::json!(info.shape),
            want["shape"],
            "{}: shape",
            t.name
        );
        let (rows, cols) = (info.shape[0], info.shape[1]);
        let start = (content.tensor_data_offset + info.offset) as usize;
        let row_bytes = info.format.row_bytes(cols).unwrap();
        let mut got = vec![0f32; rows * cols];
        for (r, out) in got.chunks_exact_mut(cols).enumerate() {
            let row = &bytes[start + r * row_bytes..start + (r + 1) * row_bytes];
            quant::dequantize(info.format, row, out);
        }
        let got: Vec<u64> = got.iter().map(|x| x.to_bits() as u64).collect();
        let want: Vec<u64> = want["bits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap())
            .collect();
        assert_eq!(got.len(), want.len(), "{}", t.name);
        let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(
            differ,
            0,
            "{}: {differ} of {} values differ from gguf-py",
            t.name,
            got.len()
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
