//! Sparse speculation in the conformance suite: key bounds kept by paged KV
//! writes (`kv_key_bounds`: blocks filled over several calls, a block
//! rewritten from its first slot, another copied) and the block selection
//! read from them (`select_kv_blocks`, a table per sequence and KV head, and
//! `paged_attention` through those tables), on every KV dtype with awkward
//! sizes: blocks of 5, grouped heads 9/3, sequences with two rows, one row,
//! no rows and a hole, and several budgets of top, sink and recent blocks.

use tandem_core::backend::{AttentionParams, Backend, BlockSelectParams, KvCacheLayout, KvDtype};
use tandem_core::kv::EVICTED_BLOCK;

use super::{attention_params, IndexBuffers, Out, Suite};

/// The writes that fill a cache, and the queries that select from it.
struct SelectCase {
    layout: KvCacheLayout,
    heads: usize,
    max_blocks: usize,
    tables: Vec<u32>,
    /// Calls of `paged_kv_write`: (slots, keys); values are the keys.
    writes: Vec<(Vec<u32>, Vec<f32>)>,
    /// Block copies after the writes.
    copies: Vec<(u32, u32)>,
    row_seq: Vec<u32>,
    positions: Vec<u32>,
    q: Vec<f32>,
}

const BUDGETS: [BlockSelectParams; 3] = [
    BlockSelectParams {
        top_blocks: 2,
        sink_blocks: 1,
        recent_blocks: 2,
    },
    BlockSelectParams {
        top_blocks: 5,
        sink_blocks: 0,
        recent_blocks: 1,
    },
    BlockSelectParams {
        top_blocks: 1,
        sink_blocks: 3,
        recent_blocks: 4,
    },
];

impl<B: Backend, R: Backend> Suite<'_, B, R> {
    pub(super) fn sparse_selection(&mut self) {
        for (dtype, head_dim) in [
            (KvDtype::F32, 40),
            (KvDtype::F16, 24),
            (KvDtype::Int8, 72),
            (KvDtype::Int4, 40),
        ] {
            let case = self.select_case(dtype, head_dim);
            for s in BUDGETS {
                let what = format!(
                    "{dtype:?} cache, 9/3 heads of {head_dim}, top {} sinks {} recent {}",
                    s.top_blocks, s.sink_blocks, s.recent_blocks
                );
                let (got, want) = (run(self.backend, &case, s), run(self.reference, &case, s));
                if let (Ok(g), Ok(w)) = (&got, &want) {
                    // The bounds are only seen through the choice they lead to.
                    let (g, w) = (Ok(g.clone()), Ok(w.clone()));
                    self.check(
                        "kv_key_bounds",
                        format!("selection from bounds: {what}"),
                        g,
                        w,
                    );
                }
                if let Ok(w) = &want {
                    let tables: Vec<u32> = w
                        .iter()
                        .map(|&b| if b < 0.0 { EVICTED_BLOCK } else { b as u32 })
                        .collect();
                    let got = attend_selected(self.backend, &case, &tables);
                    let want = attend_selected(self.reference, &case, &tables);
                    let case = format!("per-head tables of the selection: {what}");
                    self.check("paged_attention", case, got, want);
                }
                self.check("select_kv_blocks", what, got, want);
            }
        }
    }

    /// Sequence 0: 132 tokens in blocks of 5 (27 entries), written in calls
    /// of 101 and 31 tokens (the second starts mid-block), rows at 130 and
    /// 131. Sequence 1: 22 tokens, entry 1 a hole, its last block's first
    /// two tokens written twice (the second time from slot 0) and the block
    /// then copied, one row at 21. Sequence 2: 40 tokens, no rows.
    fn select_case(&mut self, dtype: KvDtype, head_dim: usize) -> SelectCase {
        let layout = KvCacheLayout {
            num_blocks: 48,
            block_size: 5,
            kv_heads: 3,
            head_dim,
            keys: dtype,
            values: dtype,
        };
        let (heads, max_blocks, bs) = (9, 29, layout.block_size);
        let width = layout.row_width();
        let mut free = self.rng.permutation(layout.num_blocks).into_iter();
        let mut tables = vec![0u32; 3 * max_blocks];
        let mut slots_of = |seq: usize, len: usize, holes: &[usize], tables: &mut Vec<u32>| {
            let mut slots = Vec::new();
            for b in 0..len.div_ceil(bs) {
                let entry = &mut tables[seq * max_blocks + b];
                if holes.contains(&b) {
                    *entry = EVICTED_BLOCK;
                    continue;
                }
                *entry = free.next().expect("enough blocks") as u32;
                let tokens = (len - b * bs).min(bs) as u32;
                slots.extend(*entry * bs as u32..*entry * bs as u32 + tokens);
            }
            slots
        };
        let s0 = slots_of(0, 132, &[], &mut tables);
        let s1 = slots_of(1, 22, &[1], &mut tables);
        let s2 = slots_of(2, 40, &[], &mut tables);
        let last1 = *s1.last().expect("tokens") / bs as u32;
        let copy_to = free.next().expect("a spare block") as u32;
        let mut writes = Vec::new();
        for slots in [
            &s0[..101],
            &s0[101..],
            &s1[..],
            &s1[s1.len() - 2..],
            &s2[..],
        ] {
            writes.push((slots.to_vec(), self.rng.values(slots.len() * width, 1.0)));
        }
        tables[max_blocks + 4] = copy_to;
        let rows: [(u32, u32); 3] = [(0, 130), (1, 21), (0, 131)];
        SelectCase {
            layout,
            heads,
            max_blocks,
            tables,
            writes,
            copies: vec![(last1, copy_to)],
            row_seq: rows.iter().map(|r| r.0).collect(),
            positions: rows.iter().map(|r| r.1).collect(),
            q: self.rng.values(rows.len() * heads * head_dim, 2.0),
        }
    }
}

/// The case's cache, written with its bounds tracked.
fn filled_cache<X: Backend>(be: &X, c: &SelectCase) -> tandem_core::Result<X::KvCache> {
    let mut cache = be.alloc_kv_cache(c.layout)?;
    be.track_key_bounds(&mut cache)?;
    for (slots, k) in &c.writes {
        let (k, idx) = (be.upload(k)?, be.upload_indices(slots)?);
        be.paged_kv_write(&k, &k, &idx, slots.len(), &mut cache)?;
    }
    be.copy_kv_blocks(&mut cache, &c.copies)?;
    Ok(cache)
}

/// The case's queries attending through per-head `tables` (a selection's),
/// as a sparse draft attends.
fn attend_selected<X: Backend>(be: &X, c: &SelectCase, tables: &[u32]) -> Out {
    let cache = filled_cache(be, c)?;
    let p = AttentionParams {
        per_head_tables: true,
        ..params(c)
    };
    let q = be.upload(&c.q)?;
    let idx = IndexBuffers::upload(be, &c.row_seq, &c.positions, tables)?;
    let n = c.q.len();
    let mut out = be.alloc(n)?;
    be.paged_attention(&q, &cache, idx.view(), p, &mut out)?;
    be.download(&out, n)
}

fn params(c: &SelectCase) -> AttentionParams {
    attention_params(c.layout, c.row_seq.len(), c.heads, c.max_blocks, None)
}

/// Writes the cache, then selects with `s`.
fn run<X: Backend>(be: &X, c: &SelectCase, s: BlockSelectParams) -> Out {
    let cache = filled_cache(be, c)?;
    let p = params(c);
    let q = be.upload(&c.q)?;
    let idx = IndexBuffers::upload(be, &c.row_seq, &c.positions, &c.tables)?;
    // A table per sequence and KV head.
    let len = c.tables.len() * c.layout.kv_heads;
    let mut out = be.upload_indices(&vec![0; len])?;
    be.select_kv_blocks(&q, &cache, idx.view(), p, s, &mut out)?;
    let tables = be.download_indices(&out, len)?;
    // Block ids as floats (exact below 2^24); holes as -1.
    Ok(tables
        .iter()
        .map(|&b| if b == EVICTED_BLOCK { -1.0 } else { b as f32 })
        .collect())
}
