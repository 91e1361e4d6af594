//! Paged KV in the conformance suite: KV writes through scattered slots and
//! copied blocks, and paged attention over several sequences with partly
//! filled last blocks, prefill chunks starting mid-sequence, grouped heads,
//! sliding windows and every KV dtype, including the INT4 key blocks'
//! per-channel bounds through rollbacks and forks.

use tandem_core::backend::{Backend, KvCacheLayout, KvDtype};

use super::{attention_params, kv_kernel, IndexBuffers, Out, Rng, Suite};

/// One sequence of an attention case: its block-table row and how many of
/// its tokens are cached before the step.
struct Sequence {
    blocks: Vec<u32>,
    cached: usize,
}

/// A write or a block copy, in the order an engine does them.
enum KvStep {
    Write {
        slots: Vec<u32>,
        k: Vec<f32>,
        v: Vec<f32>,
    },
    Copy(Vec<(u32, u32)>),
}

/// An attention step: sequences with K/V already cached, then the step's
/// rows (their K/V are written first, then they attend).
struct AttentionCase {
    layout: KvCacheLayout,
    /// Steps before everything else (earlier prefills and decode steps).
    history: Vec<KvStep>,
    heads: usize,
    window: Option<usize>,
    max_blocks: usize,
    tables: Vec<u32>,
    /// K/V rows cached before the step, and their slots.
    prefix_k: Vec<f32>,
    prefix_v: Vec<f32>,
    prefix_slots: Vec<u32>,
    /// The step's rows.
    row_seq: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<u32>,
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
    /// Block copies done before the step (copy-on-write).
    copies: Vec<(u32, u32)>,
}

impl<B: Backend, R: Backend> Suite<'_, B, R> {
    /// A window of one makes every query read exactly the V row written at
    /// its own position, so the output is the written values themselves,
    /// through scattered slots and a copied block.
    pub(super) fn paged_kv_write(&mut self) {
        use KvDtype::*;
        for (keys, values, head_dim) in [
            (F32, F32, 7),
            (F16, F16, 7),
            (Int8, Int8, 7),
            (Int8, Int8, 40),
            (Int4, Int4, 7),
            (Int4, Int4, 72),
            (Int2, Int2, 40),
            (Int8, Int2, 40),
            (Int4, Int8, 7),
            (Int2, Int4, 72),
        ] {
            let layout = KvCacheLayout {
                num_blocks: 9,
                block_size: 5,
                kv_heads: 3,
                head_dim,
                keys,
                values,
            };
            let rows = 6;
            let max_blocks = 3;
            // Row t is sequence t at a random position in a block of its own.
            // The last row's block is then copied (copy-on-write) to a spare
            // block, and its table points at the copy.
            let blocks = self.rng.permutation(layout.num_blocks);
            let mut tables = vec![0u32; rows * max_blocks];
            let mut positions = Vec::new();
            let mut slots = Vec::new();
            for (t, &block) in blocks.iter().take(rows).enumerate() {
                let pos = self.rng.below(max_blocks * layout.block_size);
                tables[t * max_blocks + pos / layout.block_size] = block as u32;
                positions.push(pos as u32);
                slots.push((block * layout.block_size + pos % layout.block_size) as u32);
            }
            let last = (rows - 1) * max_blocks + positions[rows - 1] as usize / layout.block_size;
            let copy = (tables[last], blocks[rows] as u32);
            tables[last] = copy.1;
            let width = layout.row_width();
            let case = AttentionCase {
                layout,
                history: Vec::new(),
                heads: 3,
                window: Some(1),
                max_blocks,
                tables,
                prefix_k: self.rng.values(rows * width, 1.0),
                prefix_v: self.rng.values(rows * width, 1.0),
                prefix_slots: slots,
                row_seq: (0..rows as u32).collect(),
                positions,
                slots: Vec::new(),
                k: Vec::new(),
                v: Vec::new(),
                q: self.rng.values(rows * 3 * layout.head_dim, 1.0),
                copies: vec![copy],
            };
            let got = attention(self.backend, &case);
            let want = attention(self.reference, &case);
            self.check(
                kv_kernel("paged_kv_write", values),
                format!("{keys}/{values} cache, head_dim {head_dim}, {rows} scattered rows"),
                got,
                want,
            );
        }
    }

    pub(super) fn paged_attention(&mut self) {
        use KvDtype::*;
        for (keys, values, head_dim, window) in [
            (F32, F32, 16, None),
            (F16, F16, 16, None),
            (F32, F32, 24, Some(4)),
            (F32, F32, 72, None),
            (Int8, Int8, 16, None),
            (Int8, Int8, 72, Some(4)),
            (Int4, Int4, 40, None),
            (Int4, Int4, 64, Some(4)),
            (Int2, Int2, 40, None),
            (Int8, Int2, 16, None),
            (Int4, Int2, 72, Some(4)),
            (Int2, Int8, 40, None),
        ] {
            // Sequence 0: 6 tokens cached, a prefill chunk of 5 (positions
            // 6..11, last block partly filled). Sequence 1: 6 cached, one
            // decode row. Sequence 2: a fresh 1-token prompt. Sequence 3: 70
            // cached (past one 64-key tile), one decode row.
            let layout = KvCacheLayout {
                num_blocks: 32,
                block_size: 4,
                kv_heads: 3,
                head_dim,
                keys,
                values,
            };
            let heads = 9;
            let lengths: [(usize, usize); 4] = [(6, 5), (6, 1), (0, 1), (70, 1)];
            let max_blocks = 18;
            let mut free = self.rng.permutation(layout.num_blocks).into_iter();
            let seqs: Vec<Sequence> = lengths
                .iter()
                .map(|&(cached, new)| Sequence {
                    blocks: (0..(cached + new).div_ceil(layout.block_size))
                        .map(|_| free.next().unwrap_or(0) as u32)
                        .collect(),
                    cached,
                })
                .collect();
            let mut tables = vec![0u32; seqs.len() * max_blocks];
            for (s, seq) in seqs.iter().enumerate() {
                tables[s * max_blocks..][..seq.blocks.len()].copy_from_slice(&seq.blocks);
            }
            let slot = |seq: &Sequence, pos: usize| {
                seq.blocks[pos / layout.block_size] * layout.block_size as u32
                    + (pos % layout.block_size) as u32
            };
            let mut prefix_slots = Vec::new();
            for seq in &seqs {
                prefix_slots.extend((0..seq.cached).map(|p| slot(seq, p)));
            }
            // The step's rows, interleaving the sequences.
            let mut rows: Vec<(usize, usize)> = Vec::new();
            for (s, &(cached, new)) in lengths.iter().enumerate() {
                rows.extend((cached..cached + new).map(|p| (s, p)));
            }
            // Interleaved, except for INT4, whose key blocks take a
            // sequence's rows consecutively (as the engine batches them).
            if layout.key_blocks().is_none() {
                rows.swap(0, 5);
                rows.swap(2, 7);
            }
            let width = layout.row_width();
            let n = rows.len();
            let case = AttentionCase {
                layout,
                history: Vec::new(),
                heads,
                window,
                max_blocks,
                tables,
                prefix_k: self.rng.values(prefix_slots.len() * width, 1.0),
                prefix_v: self.rng.values(prefix_slots.len() * width, 1.0),
                prefix_slots,
                row_seq: rows.iter().map(|&(s, _)| s as u32).collect(),
                positions: rows.iter().map(|&(_, p)| p as u32).collect(),
                slots: rows.iter().map(|&(s, p)| slot(&seqs[s], p)).collect(),
                k: self.rng.values(n * width, 1.0),
                v: self.rng.values(n * width, 1.0),
                q: self.rng.values(n * heads * head_dim, 1.0),
                copies: Vec::new(),
            };
            let got = attention(self.backend, &case);
            let want = attention(self.reference, &case);
            let window = window.map_or(String::new(), |w| format!(", window {w}"));
            self.check(
                kv_kernel("paged_attention", values),
                format!("{keys}/{values} cache, {heads}/3 heads of {head_dim}, {n} rows of 4 sequences{window}"),
                got,
                want,
            );
        }
    }

    /// INT4 and INT2 keys, quantized per channel over each block, through an
    /// engine's life: one prefill call for two sequences, decode steps one
    /// token per sequence, a rollback rewriting three positions (stale tokens
    /// past the first), a fork whose copied block holds the parent's later
    /// tokens (a stale tail for the child), then attention over partly
    /// filled blocks. Awkward widths (21 and 120 channels: a last code word
    /// half used) and blocks of 5 and 16.
    pub(super) fn int4_key_blocks(&mut self) {
        use KvDtype::{Int2, Int4, Int8};
        for (keys, values, head_dim, block_size) in [
            (Int4, Int4, 7, 5),
            (Int4, Int4, 40, 5),
            (Int4, Int4, 9, 16),
            (Int2, Int2, 7, 5),
            (Int2, Int8, 40, 16),
        ] {
            let layout = KvCacheLayout {
                num_blocks: 12,
                block_size,
                kv_heads: 3,
                head_dim,
                keys,
                values,
            };
            let width = layout.row_width();
            let max_blocks = 4;
            let free = self.rng.permutation(layout.num_blocks);
            // Sequences A, B and C (a fork of A); table rows of max_blocks.
            let mut tables = vec![0u32; 3 * max_blocks];
            for b in 0..max_blocks {
                tables[b] = free[b] as u32;
                tables[max_blocks + b] = free[max_blocks + b] as u32;
            }
            let slot = |tables: &[u32], seq: usize, pos: usize| {
                tables[seq * max_blocks + pos / block_size] * block_size as u32
                    + (pos % block_size) as u32
            };
            let step = |rng: &mut Rng, rows: &[(usize, usize)], tables: &[u32]| KvStep::Write {
                slots: rows.iter().map(|&(s, p)| slot(tables, s, p)).collect(),
                k: rng.values(rows.len() * width, 1.0),
                v: rng.values(rows.len() * width, 1.0),
            };
            let prefill: Vec<_> = (0..12)
                .map(|p| (0, p))
                .chain((0..3).map(|p| (1, p)))
                .collect();
            let mut history = vec![step(&mut self.rng, &prefill, &tables)];
            for i in 0..4 {
                history.push(step(&mut self.rng, &[(0, 12 + i), (1, 3 + i)], &tables));
            }
            // Rollback of A to 13 tokens (14 and 15 stay behind, stale):
            // position 13 again, then 14 and 15 in one step.
            history.push(step(&mut self.rng, &[(0, 13)], &tables));
            history.push(step(&mut self.rng, &[(0, 14), (0, 15)], &tables));
            // C shares A's first 14 tokens; the block of position 13 is copied.
            let shared = 13 / block_size;
            tables.copy_within(..max_blocks, 2 * max_blocks);
            let copy = (tables[shared], free[2 * max_blocks] as u32);
            tables[2 * max_blocks + shared] = copy.1;
            history.push(KvStep::Copy(vec![copy]));
            history.push(step(&mut self.rng, &[(2, 14), (0, 16)], &tables));
            let rows: [(u32, u32); 5] = [(0, 16), (0, 7), (1, 6), (2, 14), (2, 3)];
            let heads = 6;
            let case = AttentionCase {
                layout,
                history,
                heads,
                window: None,
                max_blocks,
                tables,
                prefix_k: Vec::new(),
                prefix_v: Vec::new(),
                prefix_slots: Vec::new(),
                row_seq: rows.iter().map(|&(s, _)| s).collect(),
                positions: rows.iter().map(|&(_, p)| p).collect(),
                slots: Vec::new(),
                k: Vec::new(),
                v: Vec::new(),
                q: self.rng.values(rows.len() * heads * head_dim, 2.0),
                copies: Vec::new(),
            };
            let got = attention(self.backend, &case);
            let want = attention(self.reference, &case);
            self.check(
                "paged_kv_write_int4_keys",
                format!(
                    "{keys}/{values}, 3 KV heads of {head_dim} in blocks of {block_size}: \
                     prefill, decode, rollback, fork"
                ),
                got,
                want,
            );
        }
    }
}

/// Writes the prefix, copies blocks, writes the step's K/V, then attends.
fn attention<X: Backend>(be: &X, c: &AttentionCase) -> Out {
    let mut cache = be.alloc_kv_cache(c.layout)?;
    let write = |cache: &mut X::KvCache, k: &[f32], v: &[f32], slots: &[u32]| {
        if slots.is_empty() {
            return Ok(());
        }
        let (k, v, s) = (be.upload(k)?, be.upload(v)?, be.upload_indices(slots)?);
        be.paged_kv_write(&k, &v, &s, slots.len(), cache)
    };
    for step in &c.history {
        match step {
            KvStep::Write { slots, k, v } => write(&mut cache, k, v, slots)?,
            KvStep::Copy(pairs) => be.copy_kv_blocks(&mut cache, pairs)?,
        }
    }
    write(&mut cache, &c.prefix_k, &c.prefix_v, &c.prefix_slots)?;
    if !c.copies.is_empty() {
        be.copy_kv_blocks(&mut cache, &c.copies)?;
    }
    write(&mut cache, &c.k, &c.v, &c.slots)?;
    let rows = c.row_seq.len();
    let q = be.upload(&c.q)?;
    let idx = IndexBuffers::upload(be, &c.row_seq, &c.positions, &c.tables)?;
    let n = rows * c.heads * c.layout.head_dim;
    let mut out = be.alloc(n)?;
    let p = attention_params(c.layout, rows, c.heads, c.max_blocks, c.window);
    be.paged_attention(&q, &cache, idx.view(), p, &mut out)?;
    be.download(&out, n)
}
