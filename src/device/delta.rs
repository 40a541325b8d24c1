//! A Gated DeltaNet layer's shape (Qwen3.5's state layers): what the CPU model's
//! recurrence (`model::delta_net`) and the CUDA kernels (`delta_net.cu`) are sized by.

/// One Gated DeltaNet layer's sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaShape {
    pub k_heads: usize,
    pub v_heads: usize,
    /// Per head: key (and query) and value widths.
    pub dk: usize,
    pub dv: usize,
    /// The causal conv's width (4 in Qwen3.5).
    pub kernel: usize,
    /// Which key head each value head reads.
    pub value_heads: ValueHeadOrder,
}

/// How a checkpoint orders the value heads when there are more of them than key heads
/// (`r = v_heads / k_heads` per key head). It orders every per-value-head tensor the same
/// way (the V rows and channels, z, b, a, A, dt_bias, `out_proj`'s columns), so only the
/// key head a value head reads differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueHeadOrder {
    /// transformers': grouped by key head, `[K0: v0..v(r−1) | K1: ...]`; value head `h`
    /// reads key head `h / r`.
    Grouped,
    /// llama.cpp's GGUF (its converter reorders them so ggml can broadcast the key heads):
    /// tiled, `[K0 K1 .. | K0 K1 ..]`; value head `h` reads key head `h % k_heads`.
    Tiled,
}

impl DeltaShape {
    /// The key (and query) head value head `h` reads.
    pub fn key_head(&self, h: usize) -> usize {
        match self.value_heads {
            ValueHeadOrder::Grouped => h / (self.v_heads / self.k_heads),
            ValueHeadOrder::Tiled => h % self.k_heads,
        }
    }

    /// The conv's channels: q, k and v side by side, `[q: k_heads·dk | k: k_heads·dk |
    /// v: v_heads·dv]`.
    pub fn conv_channels(&self) -> usize {
        2 * self.k_heads * self.dk + self.v_heads * self.dv
    }

    /// Floats of the recurrent state, `[v_heads, dk, dv]`.
    pub fn state_len(&self) -> usize {
        self.v_heads * self.dk * self.dv
    }

    /// Floats of the conv's tail, `[kernel − 1, conv_channels]` (oldest first).
    pub fn conv_tail_len(&self) -> usize {
        (self.kernel - 1) * self.conv_channels()
    }

    /// Floats of one sequence's whole state in this layer: `[conv tail | matrix state]`.
    pub fn seq_state_len(&self) -> usize {
        self.conv_tail_len() + self.state_len()
    }

    /// Width of one token's fused input projection: `[q | k | v | z | b | a]` (z
    /// `[v_heads, dv]`, the gates' inputs b and a `[v_heads]` each).
    pub fn proj_width(&self) -> usize {
        self.conv_channels() + self.v_heads * self.dv + 2 * self.v_heads
    }
}
