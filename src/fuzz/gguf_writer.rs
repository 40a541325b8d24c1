//! A GGUF document as data, serialised with a layout the fuzzer controls (candle's writer
//! always lays tensors out correctly; a hostile file does not).

use candle_core::quantized::gguf_file::Value;

/// GGML type ids (ggml.h) of the tensor types the base corpus uses.
pub const GGML_F32: u32 = 0;
pub const GGML_F16: u32 = 1;
pub const GGML_Q8_0: u32 = 8;
pub const GGML_MXFP4: u32 = 39;

#[derive(Debug, Clone)]
pub struct GgufTensor {
    pub name: String,
    /// Outermost first, as strata and Hugging Face write shapes (GGUF stores them reversed).
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    pub data: Vec<u8>,
    /// Offset in the data section; `None` = placed after the previous tensor, aligned.
    pub offset: Option<u64>,
}

#[derive(Debug, Clone)]
pub struct GgufDoc {
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<GgufTensor>,
    /// Alignment used to lay the data out (the metadata may claim another).
    pub layout_alignment: u64,
}

fn put_len(out: &mut Vec<u8>, version: u32, n: u64) {
    if version == 1 {
        out.extend_from_slice(&(n as u32).to_le_bytes());
    } else {
        out.extend_from_slice(&n.to_le_bytes());
    }
}

fn put_str(out: &mut Vec<u8>, version: u32, s: &str) {
    put_len(out, version, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// GGUF's value type id.
pub fn type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, version: u32, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_str(out, version, s),
        Value::Array(items) => {
            // Elements of one type; an empty array claims u32.
            let ty = items.first().map_or(4, type_id);
            out.extend_from_slice(&ty.to_le_bytes());
            put_len(out, version, items.len() as u64);
            for item in items {
                put_value(out, version, item);
            }
        }
    }
}

impl GgufDoc {
    pub fn to_bytes(&self) -> Vec<u8> {
        let v = self.version;
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&v.to_le_bytes());
        put_len(&mut out, v, self.tensors.len() as u64);
        put_len(&mut out, v, self.metadata.len() as u64);
        for (key, value) in &self.metadata {
            put_str(&mut out, v, key);
            out.extend_from_slice(&type_id(value).to_le_bytes());
            put_value(&mut out, v, value);
        }
        let align = self.layout_alignment.max(1);
        let pad = |n: u64| n.div_ceil(align) * align;
        let mut next = 0u64;
        let mut offsets = Vec::new();
        for t in &self.tensors {
            let off = t.offset.unwrap_or(pad(next));
            offsets.push(off);
            next = off.saturating_add(t.data.len() as u64);
            put_str(&mut out, v, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for &d in t.dims.iter().rev() {
                if v == 1 {
                    out.extend_from_slice(&(d as u32).to_le_bytes());
                } else {
                    out.extend_from_slice(&d.to_le_bytes());
                }
            }
            out.extend_from_slice(&t.ggml_type.to_le_bytes());
            out.extend_from_slice(&off.to_le_bytes());
        }
        let data_start = pad(out.len() as u64) as usize;
        out.resize(data_start, 0);
        // Data at its (possibly hostile) offsets; a fuzz case stays small, so offsets past
        // a few MiB are left unbacked (the file is then too short, which is the point).
        const MAX_FILE: u64 = 8 << 20;
        for (t, &off) in self.tensors.iter().zip(&offsets) {
            let start = data_start as u64 + off;
            let end = start.saturating_add(t.data.len() as u64);
            if end > MAX_FILE {
                continue;
            }
            if out.len() < end as usize {
                out.resize(end as usize, 0);
            }
            out[start as usize..end as usize].copy_from_slice(&t.data);
        }
        out
    }
}
