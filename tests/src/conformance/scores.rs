//! KV eviction in the conformance suite: paged attention over block tables
//! with holes (evicted entries, `EVICTED_BLOCK`), and its attention-score
//! variant (`Backend::paged_attention_scores`), on every KV dtype with
//! awkward sizes: blocks of 5, grouped heads 9/3, a sequence past two
//! 64-key tiles, holes first, inside and next to the last block, a sliding
//! window, and scores added onto values already there.

use tandem_core::backend::{Backend, KvCacheLayout, KvDtype};
use tandem_core::kv::EVICTED_BLOCK;

use super::{attention_params, kv_kernel, IndexBuffers, Out, Suite};

/// Sequences whose K/V fill their live blocks, and query rows over them.
struct HoleCase {
    layout: KvCacheLayout,
    heads: usize,
    window: Option<usize>,
    max_blocks: usize,
    tables: Vec<u32>,
    /// Every cached token of the live blocks, a block's tokens consecutive.
    slots: Vec<u32>,
    k: Vec<f32>,
    v: Vec<f32>,
    row_seq: Vec<u32>,
    positions: Vec<u32>,
    q: Vec<f32>,
    /// Scores already accumulated (earlier layers).
    scores: Vec<f32>,
}

impl<B: Backend, R: Backend> Suite<'_, B, R> {
    pub(super) fn attention_with_holes(&mut self) {
        for (dtype, head_dim, window) in [
            (KvDtype::F32, 40, None),
            (KvDtype::F16, 24, Some(23)),
            (KvDtype::Int8, 72, None),
            (KvDtype::Int4, 40, Some(41)),
        ] {
            let case = self.hole_case(dtype, head_dim, window);
            let window = window.map_or(String::new(), |w| format!(", window {w}"));
            let what = format!(
                "{dtype:?} cache with evicted blocks, 9/3 heads of {head_dim}, {} rows{window}",
                case.row_seq.len()
            );
            let kernel = kv_kernel("paged_attention", dtype);
            let (got, want) = (
                run(self.backend, &case, false),
                run(self.reference, &case, false),
            );
            self.check(kernel, what.clone(), got, want);
            let (got, want) = (
                run(self.backend, &case, true),
                run(self.reference, &case, true),
            );
            self.check(kernel, format!("attention scores: {what}"), got, want);
        }
    }

    /// Sequence 0: 132 tokens in blocks of 5 (27 entries), entries 0, 3, 4,
    /// 20 and 25 evicted. Sequence 1: 12 tokens, entry 1 evicted. Rows: a
    /// chunk of 3 at the end of sequence 0, one row inside it, one decode
    /// row of sequence 1.
    fn hole_case(&mut self, dtype: KvDtype, head_dim: usize, window: Option<usize>) -> HoleCase {
        let layout = KvCacheLayout {
            num_blocks: 40,
            block_size: 5,
            kv_heads: 3,
            head_dim,
            keys: dtype,
            values: dtype,
        };
        let heads = 9;
        let max_blocks = 29;
        let lengths = [132usize, 12];
        let evicted: [&[usize]; 2] = [&[0, 3, 4, 20, 25], &[1]];
        let mut free = self.rng.permutation(layout.num_blocks).into_iter();
        let mut tables = vec![0u32; lengths.len() * max_blocks];
        let mut slots = Vec::new();
        for (s, &len) in lengths.iter().enumerate() {
            for b in 0..len.div_ceil(layout.block_size) {
                let entry = &mut tables[s * max_blocks + b];
                if evicted[s].contains(&b) {
                    *entry = EVICTED_BLOCK;
                    continue;
                }
                *entry = free.next().expect("enough blocks") as u32;
                let tokens = (len - b * layout.block_size).min(layout.block_size);
                let first = *entry * layout.block_size as u32;
                slots.extend(first..first + tokens as u32);
            }
        }
        let rows: [(u32, u32); 5] = [(0, 129), (0, 130), (0, 131), (0, 57), (1, 11)];
        let width = layout.row_width();
        HoleCase {
            layout,
            heads,
            window,
            max_blocks,
            tables,
            k: self.rng.values(slots.len() * width, 1.0),
            v: self.rng.values(slots.len() * width, 1.0),
            slots,
            row_seq: rows.iter().map(|r| r.0).collect(),
            positions: rows.iter().map(|r| r.1).collect(),
            q: self.rng.values(rows.len() * heads * head_dim, 2.0),
            scores: self.rng.values(rows.len() * 3 * max_blocks, 1.0),
        }
    }
}

/// Writes the cache, then attends (`scored`: the score variant's scores).
fn run<X: Backend>(be: &X, c: &HoleCase, scored: bool) -> Out {
    let mut cache = be.alloc_kv_cache(c.layout)?;
    let (k, v, s) = (
        be.upload(&c.k)?,
        be.upload(&c.v)?,
        be.upload_indices(&c.slots)?,
    );
    be.paged_kv_write(&k, &v, &s, c.slots.len(), &mut cache)?;
    let rows = c.row_seq.len();
    let q = be.upload(&c.q)?;
    let idx = IndexBuffers::upload(be, &c.row_seq, &c.positions, &c.tables)?;
    let p = attention_params(c.layout, rows, c.heads, c.max_blocks, c.window);
    if scored {
        let mut scores = be.upload(&c.scores)?;
        be.paged_attention_scores(&q, &cache, idx.view(), p, &mut scores)?;
        return be.download(&scores, c.scores.len());
    }
    let n = rows * c.heads * c.layout.head_dim;
    let mut out = be.alloc(n)?;
    be.paged_attention(&q, &cache, idx.view(), p, &mut out)?;
    be.download(&out, n)
}
