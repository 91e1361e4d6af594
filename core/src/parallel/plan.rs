//! Which heads and FFN features each tensor-parallel rank holds.
//!
//! Attention is split by whole KV groups (a KV head and the query heads that
//! read it): with at least as many KV heads as ranks, each rank takes a
//! contiguous run of groups, so its KV cache holds only its heads and KV
//! memory per rank falls by the rank count. With fewer KV heads than ranks,
//! the rank count must be a multiple of the KV heads: each KV head is then
//! replicated on `ranks / kv_heads` ranks, which split its query heads.
//! Counts that do not divide evenly give ranks of different widths (9 heads
//! in 3 groups over 2 ranks: 6 and 3), never a refusal.
//!
//! The FFN is split into contiguous feature ranges whose bounds are
//! multiples of the down projection's quantization block, so each rank's
//! columns of `ffn_down` are whole blocks of the file.
//!
//! A Mixture-of-Experts layer's routed experts are placed over `ep` groups
//! of `ranks / ep` ranks (expert parallelism), each group holding a
//! contiguous run of whole experts, and each expert is split by features
//! over the ranks of its group as a dense FFN is. `ep` = 1 splits every
//! expert over every rank; `ep` = ranks gives each rank whole experts. A
//! shared expert is split by features over all the ranks. Every rank routes
//! every token (the router is small, its input the same on all ranks), runs
//! the experts it holds on the rows routed to them, and the FFN's one
//! all-reduce adds the parts: vLLM's default all-gather + reduce-scatter,
//! whose all-gather costs nothing here because tensor-parallel attention
//! already leaves every token's hidden state on every rank of the stage.

use std::ops::Range;

use crate::model::experts::{expert_view, ExpertMatrix};
use crate::model::{ModelConfig, ModelFiles, MoeSpec};
use crate::{Error, Result};

/// One rank's share of every layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorParallelPlan {
    pub rank: usize,
    pub size: usize,
    /// Query heads of this rank.
    pub heads: Range<usize>,
    /// KV heads of this rank (shared with other ranks when `kv_replicated`).
    pub kv_heads: Range<usize>,
    pub kv_replicated: bool,
    /// FFN features (rows of gate/up, columns of down) of this rank: of
    /// the dense FFN, or of each routed expert it holds.
    pub ffn: Range<usize>,
    /// Routed experts this rank holds (empty for a dense model).
    pub experts: Range<usize>,
    /// Features of the shared expert (empty without one).
    pub shared_ffn: Range<usize>,
    head_dim: usize,
}

/// Element counts of one quantization block of the down projections: the
/// dense FFN's (or each routed expert's) and the shared expert's (1 for float).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FfnBlocks {
    pub ffn: usize,
    pub shared: usize,
}

/// How one canonical tensor is cut for a rank: the element ranges are of
/// output rows (a matrix's rows, a bias's elements) or of input columns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Split {
    Whole,
    Rows(Range<usize>),
    Cols(Range<usize>),
}

impl TensorParallelPlan {
    /// The share of `rank` among `size` ranks, experts placed over `ep` groups.
    pub fn new(
        cfg: &ModelConfig,
        rank: usize,
        size: usize,
        ep: usize,
        blocks: FfnBlocks,
    ) -> Result<Self> {
        let refuse = |why: String| Err(Error::Unsupported(format!("--tp {size}: {why}")));
        if size == 0 || rank >= size {
            return refuse(format!("rank {rank} is not one of {size} ranks"));
        }
        let ep = ep.max(1);
        if !size.is_multiple_of(ep) {
            return refuse(format!("--ep {ep} does not divide the {size} ranks"));
        }
        // The ranks one FFN (or expert) is split over, and this rank's place among them.
        let (experts, ffn_ranks, ffn_rank) = match cfg.moe {
            Some(MoeSpec { experts, .. }) if experts < ep => {
                return refuse(format!(
                    "{experts} experts cannot be placed over {ep} groups (--ep {ep})"
                ))
            }
            Some(MoeSpec { experts, .. }) => {
                let group = size / ep;
                (even(experts, ep, rank / group), group, rank % group)
            }
            None if ep > 1 => return refuse(format!("--ep {ep}: the model has no experts")),
            None => (0..0, size, rank),
        };
        let (heads, kv) = (cfg.num_heads, cfg.num_kv_heads);
        let group = heads / kv;
        let (head_range, kv_range, kv_replicated) = if size <= kv {
            let groups = even(kv, size, rank);
            (groups.start * group..groups.end * group, groups, false)
        } else if size.is_multiple_of(kv) && group >= size / kv {
            let per_group = size / kv;
            let g = rank / per_group;
            let within = even(group, per_group, rank % per_group);
            (
                g * group + within.start..g * group + within.end,
                g..g + 1,
                true,
            )
        } else {
            return refuse(format!(
                "{heads} query heads in {kv} KV groups cannot be split over {size} ranks: use at most {kv} ranks, or a multiple of {kv} up to {heads}"
            ));
        };
        let features = |width: usize, block: usize, parts: usize, part: usize| {
            let block = block.max(1);
            let units = width / block;
            if !width.is_multiple_of(block) || units < parts {
                return Err(Error::Unsupported(format!(
                    "--tp {size}: the FFN width {width} is not {parts} or more whole blocks of {block}"
                )));
            }
            let r = even(units, parts, part);
            Ok(r.start * block..r.end * block)
        };
        let ffn = features(cfg.intermediate_size, blocks.ffn, ffn_ranks, ffn_rank)?;
        let shared_ffn = match cfg.moe.and_then(|m| m.shared_ffn) {
            Some(width) => features(width, blocks.shared, size, rank)?,
            None => 0..0,
        };
        Ok(Self {
            rank,
            size,
            heads: head_range,
            kv_heads: kv_range,
            kv_replicated,
            ffn,
            experts,
            shared_ffn,
            head_dim: cfg.head_dim,
        })
    }

    /// The model as this rank runs it: its heads and FFN widths.
    pub fn local_config(&self, cfg: &ModelConfig) -> ModelConfig {
        ModelConfig {
            num_heads: self.heads.len(),
            num_kv_heads: self.kv_heads.len(),
            intermediate_size: self.ffn.len(),
            moe: cfg.moe.map(|m| MoeSpec {
                shared_ffn: m.shared_ffn.map(|_| self.shared_ffn.len()),
                ..m
            }),
            ..cfg.clone()
        }
    }

    /// Whether this rank holds routed expert `e`.
    pub fn holds_expert(&self, e: usize) -> bool {
        self.experts.contains(&e)
    }

    /// How one matrix of a routed expert this rank holds is cut.
    pub fn expert_split(&self, m: ExpertMatrix) -> Split {
        match (self.size, m) {
            (1, _) => Split::Whole,
            (_, ExpertMatrix::Down) => Split::Cols(self.ffn.clone()),
            _ => Split::Rows(self.ffn.clone()),
        }
    }

    /// How the tensor `name` (canonical, `blk.N.` + kind) is cut for this rank.
    pub fn split(&self, name: &str) -> Split {
        let kind = name.splitn(3, '.').nth(2).unwrap_or(name);
        let scaled = |r: &Range<usize>| r.start * self.head_dim..r.end * self.head_dim;
        match kind.rsplit_once('.').map_or(kind, |(k, _)| k) {
            _ if !name.starts_with("blk.") || self.size == 1 => Split::Whole,
            "attn_q" => Split::Rows(scaled(&self.heads)),
            "attn_k" | "attn_v" => Split::Rows(scaled(&self.kv_heads)),
            "attn_output" => Split::Cols(scaled(&self.heads)),
            "ffn_gate" | "ffn_up" => Split::Rows(self.ffn.clone()),
            "ffn_down" => Split::Cols(self.ffn.clone()),
            "ffn_gate_shexp" | "ffn_up_shexp" => Split::Rows(self.shared_ffn.clone()),
            "ffn_down_shexp" => Split::Cols(self.shared_ffn.clone()),
            _ => Split::Whole,
        }
    }

    /// The share of `rank` in the model of `files`, experts over `ep` groups.
    pub fn for_model(files: &ModelFiles, rank: usize, size: usize, ep: usize) -> Result<Self> {
        let block = |name: &str| files.tensors.info(name).map(|t| t.format.block_elems());
        let blocks = FfnBlocks {
            ffn: block("blk.0.ffn_down.weight")
                .or_else(|| {
                    let down = expert_view(&files.tensors, 0, ExpertMatrix::Down, 0)?;
                    Some(down.format.block_elems())
                })
                .unwrap_or(1),
            shared: block("blk.0.ffn_down_shexp.weight").unwrap_or(1),
        };
        Self::new(&files.config, rank, size, ep, blocks)
    }

    /// This rank's share in words (`inspect --tp`).
    pub fn describe(&self) -> String {
        let replicated = if self.kv_replicated {
            " (replicated)"
        } else {
            ""
        };
        let mut line = format!(
            "query heads {:?}, KV heads {:?}{replicated}, FFN features {:?}",
            self.heads, self.kv_heads, self.ffn
        );
        if !self.experts.is_empty() {
            line += &format!(" of experts {:?}", self.experts);
        }
        if !self.shared_ffn.is_empty() {
            line += &format!(", shared expert features {:?}", self.shared_ffn);
        }
        line
    }
}

/// Part `i` of `n` near-equal contiguous parts of `0..len`.
fn even(len: usize, n: usize, i: usize) -> Range<usize> {
    len * i / n..len * (i + 1) / n
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synthetic::SyntheticModel;
    use crate::quant::WeightFormat;

    fn blocks(ffn: usize) -> FfnBlocks {
        FfnBlocks { ffn, shared: 1 }
    }

    fn config(heads: usize, kv: usize, ffn: usize) -> ModelConfig {
        ModelConfig {
            num_heads: heads,
            num_kv_heads: kv,
            intermediate_size: ffn,
            ..SyntheticModel::preset("tiny", WeightFormat::F32, 0)
                .unwrap()
                .config
        }
    }

    /// Every head, KV head and feature is held by some rank; query heads and
    /// features by exactly one; each rank's query heads read its KV heads.
    fn check_cover(cfg: &ModelConfig, size: usize, block: usize) {
        let plans: Vec<_> = (0..size)
            .map(|r| TensorParallelPlan::new(cfg, r, size, 1, blocks(block)).unwrap())
            .collect();
        let group = cfg.num_heads / cfg.num_kv_heads;
        let mut next_head = 0;
        let mut next_feature = 0;
        for p in &plans {
            assert_eq!(p.heads.start, next_head);
            assert_eq!(p.ffn.start, next_feature);
            assert!(!p.heads.is_empty() && !p.ffn.is_empty());
            assert_eq!(p.ffn.start % block, 0);
            next_head = p.heads.end;
            next_feature = p.ffn.end;
            for h in p.heads.clone() {
                assert!(p.kv_heads.contains(&(h / group)), "{p:?}");
            }
            let local = p.local_config(cfg);
            assert_eq!(local.num_heads % local.num_kv_heads, 0, "{p:?}");
        }
        assert_eq!(next_head, cfg.num_heads);
        assert_eq!(next_feature, cfg.intermediate_size);
    }

    #[test]
    fn uneven_counts_are_split_not_refused() {
        // SmolLM2-135M: 9 heads in 3 groups, FFN 1536 in blocks of 32.
        let smollm = config(9, 3, 1536);
        check_cover(&smollm, 2, 32);
        check_cover(&smollm, 3, 32);
        let p = TensorParallelPlan::new(&smollm, 1, 2, 1, blocks(32)).unwrap();
        assert_eq!((p.heads, p.kv_heads, p.ffn), (3..9, 1..3, 768..1536));
        // Qwen2.5-0.5B: 14 heads, 2 KV heads (replicated over 4 ranks), 4864 in blocks of 256.
        let qwen = config(14, 2, 4864);
        for size in [1, 2, 4] {
            check_cover(&qwen, size, 256);
        }
        let p = TensorParallelPlan::new(&qwen, 3, 4, 1, blocks(256)).unwrap();
        assert!(p.kv_replicated);
        assert_eq!((p.heads, p.kv_heads), (10..14, 1..2));
        check_cover(&config(7, 7, 37), 3, 1);
    }

    #[test]
    fn impossible_splits_name_the_reason() {
        let qwen = config(14, 2, 4864);
        let err = TensorParallelPlan::new(&qwen, 0, 3, 1, blocks(256))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("14 query heads in 2 KV groups cannot be split over 3 ranks"),
            "{err}"
        );
        let narrow = config(4, 4, 64);
        let err = TensorParallelPlan::new(&narrow, 0, 4, 1, blocks(32))
            .unwrap_err()
            .to_string();
        assert!(err.contains("FFN width 64"), "{err}");
        let err = TensorParallelPlan::new(&config(4, 1, 64), 0, 8, 1, blocks(1))
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot be split over 8 ranks"), "{err}");
    }

    #[test]
    fn tensors_are_cut_by_heads_and_features() {
        let cfg = config(9, 3, 1536);
        let p = TensorParallelPlan::new(&cfg, 1, 2, 1, blocks(32)).unwrap();
        let hd = cfg.head_dim;
        assert_eq!(p.split("blk.4.attn_q.weight"), Split::Rows(3 * hd..9 * hd));
        assert_eq!(p.split("blk.4.attn_q.bias"), Split::Rows(3 * hd..9 * hd));
        assert_eq!(p.split("blk.0.attn_v.weight"), Split::Rows(hd..3 * hd));
        assert_eq!(
            p.split("blk.0.attn_output.weight"),
            Split::Cols(3 * hd..9 * hd)
        );
        assert_eq!(p.split("blk.11.ffn_down.weight"), Split::Cols(768..1536));
        assert_eq!(p.split("blk.11.ffn_up.weight"), Split::Rows(768..1536));
        for whole in [
            "token_embd.weight",
            "output.weight",
            "blk.0.attn_norm.weight",
            "blk.0.attn_q_norm.weight",
        ] {
            assert_eq!(p.split(whole), Split::Whole, "{whole}");
        }
    }

    #[test]
    fn experts_are_placed_over_groups_and_split_within_them() {
        let moe = ModelConfig {
            moe: Some(MoeSpec {
                experts: 5,
                experts_per_token: 2,
                normalize_weights: true,
                shared_ffn: Some(128),
                group_rows: true,
            }),
            ..config(4, 2, 64)
        };
        let blocks = FfnBlocks {
            ffn: 32,
            shared: 32,
        };
        let plan = |rank, size, ep| TensorParallelPlan::new(&moe, rank, size, ep, blocks).unwrap();
        // Whole experts per rank: 5 over 2 ranks gives 2 and 3.
        let (a, b) = (plan(0, 2, 2), plan(1, 2, 2));
        assert_eq!((a.experts, b.experts), (0..2, 2..5));
        assert_eq!((a.ffn.clone(), b.ffn.clone()), (0..64, 0..64));
        // The shared expert is split over every rank.
        assert_eq!((a.shared_ffn, b.shared_ffn), (0..64, 64..128));
        // Without --ep every rank holds a slice of every expert.
        let c = plan(1, 2, 1);
        assert_eq!((c.experts.clone(), c.ffn.clone()), (0..5, 32..64));
        assert_eq!(c.expert_split(ExpertMatrix::Down), Split::Cols(32..64));
        assert_eq!(c.local_config(&moe).moe.unwrap().shared_ffn, Some(64));
        // Two groups of two ranks: whole experts per group, halves within.
        let d = plan(3, 4, 2);
        assert_eq!((d.experts, d.ffn), (2..5, 32..64));
        let err = TensorParallelPlan::new(&moe, 0, 2, 3, blocks)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--ep 3 does not divide the 2 ranks"), "{err}");
        let err = TensorParallelPlan::new(&config(4, 2, 64), 0, 2, 2, blocks)
            .unwrap_err()
            .to_string();
        assert!(err.contains("the model has no experts"), "{err}");
    }
}
