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

use std::ops::Range;

use crate::model::{ModelConfig, ModelFiles};
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
    /// FFN features (rows of gate/up, columns of down) of this rank.
    pub ffn: Range<usize>,
    head_dim: usize,
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
    /// The share of `rank` among `size` ranks; `ffn_block` is the element
    /// count of one quantization block of the down projection (1 for float).
    pub fn new(cfg: &ModelConfig, rank: usize, size: usize, ffn_block: usize) -> Result<Self> {
        let refuse = |why: String| Err(Error::Unsupported(format!("--tp {size}: {why}")));
        if size == 0 || rank >= size {
            return refuse(format!("rank {rank} is not one of {size} ranks"));
        }
        if size > 1 && cfg.moe.is_some() {
            return refuse("tensor parallelism of Mixture-of-Experts layers is not built yet (their experts would go to --ep)".into());
        }
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
        let ffn_block = ffn_block.max(1);
        let units = cfg.intermediate_size / ffn_block;
        if !cfg.intermediate_size.is_multiple_of(ffn_block) || units < size {
            return refuse(format!(
                "the FFN width {} is not {size} or more whole blocks of {ffn_block}",
                cfg.intermediate_size
            ));
        }
        let ffn = even(units, size, rank);
        Ok(Self {
            rank,
            size,
            heads: head_range,
            kv_heads: kv_range,
            kv_replicated,
            ffn: ffn.start * ffn_block..ffn.end * ffn_block,
            head_dim: cfg.head_dim,
        })
    }

    /// The model as this rank runs it: its heads and FFN width.
    pub fn local_config(&self, cfg: &ModelConfig) -> ModelConfig {
        ModelConfig {
            num_heads: self.heads.len(),
            num_kv_heads: self.kv_heads.len(),
            intermediate_size: self.ffn.len(),
            ..cfg.clone()
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
            _ => Split::Whole,
        }
    }

    /// The share of `rank` in the model of `files`.
    pub fn for_model(files: &ModelFiles, rank: usize, size: usize) -> Result<Self> {
        let ffn_block = files
            .tensors
            .info("blk.0.ffn_down.weight")
            .map_or(1, |t| t.format.block_elems());
        Self::new(&files.config, rank, size, ffn_block)
    }

    /// This rank's share in words (`inspect --tp`).
    pub fn describe(&self) -> String {
        format!(
            "query heads {:?}, KV heads {:?}{}, FFN features {:?}",
            self.heads,
            self.kv_heads,
            if self.kv_replicated {
                " (replicated)"
            } else {
                ""
            },
            self.ffn
        )
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
            .map(|r| TensorParallelPlan::new(cfg, r, size, block).unwrap())
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
        let p = TensorParallelPlan::new(&smollm, 1, 2, 32).unwrap();
        assert_eq!((p.heads, p.kv_heads, p.ffn), (3..9, 1..3, 768..1536));
        // Qwen2.5-0.5B: 14 heads, 2 KV heads (replicated over 4 ranks), 4864 in blocks of 256.
        let qwen = config(14, 2, 4864);
        for size in [1, 2, 4] {
            check_cover(&qwen, size, 256);
        }
        let p = TensorParallelPlan::new(&qwen, 3, 4, 256).unwrap();
        assert!(p.kv_replicated);
        assert_eq!((p.heads, p.kv_heads), (10..14, 1..2));
        check_cover(&config(7, 7, 37), 3, 1);
    }

    #[test]
    fn impossible_splits_name_the_reason() {
        let qwen = config(14, 2, 4864);
        let err = TensorParallelPlan::new(&qwen, 0, 3, 256)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("14 query heads in 2 KV groups cannot be split over 3 ranks"),
            "{err}"
        );
        let narrow = config(4, 4, 64);
        let err = TensorParallelPlan::new(&narrow, 0, 4, 32)
            .unwrap_err()
            .to_string();
        assert!(err.contains("FFN width 64"), "{err}");
        let err = TensorParallelPlan::new(&config(4, 1, 64), 0, 8, 1)
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot be split over 8 ranks"), "{err}");
    }

    #[test]
    fn tensors_are_cut_by_heads_and_features() {
        let cfg = config(9, 3, 1536);
        let p = TensorParallelPlan::new(&cfg, 1, 2, 32).unwrap();
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
}
