//! Which layers each pipeline stage holds.
//!
//! Stages take contiguous layer ranges, each at least one layer. Stage 0
//! also embeds the tokens and, on rank 0, computes the logits, so the
//! ranges balance the weight bytes a decoded token reads, the output head
//! counted on stage 0: split by layer count alone, SmolLM2's stage 0 would
//! carry its 49152-row tied embedding (as many bytes as 8 of its 30 layers)
//! on top of half the layers and hold every other stage back.

use std::ops::Range;

use crate::model::ModelFiles;
use crate::{Error, Result};

/// One stage's share of the layers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelinePlan {
    pub stage: usize,
    pub stages: usize,
    pub layers: Range<usize>,
}

impl PipelinePlan {
    /// Stage `stage` of `stages` over layers of `layer_bytes` each, with
    /// `head_bytes` of output head on stage 0.
    pub fn new(
        layer_bytes: &[usize],
        head_bytes: usize,
        stage: usize,
        stages: usize,
    ) -> Result<Self> {
        let layers = layer_bytes.len();
        if stages == 0 || stage >= stages {
            return Err(Error::InvalidRequest(format!(
                "--pp {stages}: stage {stage} is not one of {stages}"
            )));
        }
        if stages > layers {
            return Err(Error::Unsupported(format!(
                "--pp {stages}: the model has {layers} layers, so at most {layers} stages"
            )));
        }
        let total = head_bytes + layer_bytes.iter().sum::<usize>();
        // Stage k ends where the running total (head first) comes nearest
        // k/stages of the whole, leaving every stage at least one layer.
        let mut bounds = vec![0];
        let mut sum = head_bytes;
        let mut ends = Vec::with_capacity(layers);
        for &b in layer_bytes {
            sum += b;
            ends.push(sum);
        }
        for k in 1..stages {
            let target = total as f64 * k as f64 / stages as f64;
            let lo = bounds[k - 1] + 1;
            let hi = layers - (stages - k);
            let end = (lo..=hi)
                .min_by(|&a, &b| {
                    let gap = |i: usize| (ends[i - 1] as f64 - target).abs();
                    gap(a).total_cmp(&gap(b))
                })
                .unwrap_or(lo);
            bounds.push(end);
        }
        bounds.push(layers);
        Ok(Self {
            stage,
            stages,
            layers: bounds[stage]..bounds[stage + 1],
        })
    }

    /// Stage `stage` of `stages` of the model in `files`.
    pub fn for_model(files: &ModelFiles, stage: usize, stages: usize) -> Result<Self> {
        let cfg = &files.config;
        let mut layer_bytes = vec![0; cfg.num_layers];
        for t in files.tensors.tensors() {
            let layer = t
                .name
                .strip_prefix("blk.")
                .and_then(|rest| rest.split('.').next()?.parse::<usize>().ok());
            if let Some(bytes) = layer.and_then(|l| layer_bytes.get_mut(l)) {
                *bytes += t.len;
            }
        }
        let head = match cfg.tied_embeddings {
            true => "token_embd.weight",
            false => "output.weight",
        };
        let head_bytes = files.tensors.info(head).map_or(0, |t| t.len);
        Self::new(&layer_bytes, head_bytes, stage, stages)
    }

    pub fn is_first(&self) -> bool {
        self.stage == 0
    }

    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(layer_bytes: &[usize], head: usize, stages: usize) -> Vec<Range<usize>> {
        (0..stages)
            .map(|s| {
                PipelinePlan::new(layer_bytes, head, s, stages)
                    .unwrap()
                    .layers
            })
            .collect()
    }

    #[test]
    fn stages_cover_the_layers_in_order_and_balance_bytes() {
        assert_eq!(ranges(&[1; 6], 0, 2), [0..3, 3..6]);
        assert_eq!(ranges(&[1; 7], 0, 3), [0..2, 2..5, 5..7]);
        // SmolLM2-shaped: 30 layers and a head as heavy as 8 of them.
        assert_eq!(ranges(&[10; 30], 80, 2), [0..11, 11..30]);
        // More stages than the head's weight allows still gives each a layer.
        assert_eq!(ranges(&[1; 3], 1000, 3), [0..1, 1..2, 2..3]);
        for stages in 1..=5 {
            let r = ranges(&[3, 1, 4, 1, 5, 9, 2, 6], 7, stages);
            assert_eq!(r[0].start, 0);
            assert_eq!(r[stages - 1].end, 8);
            assert!(r.windows(2).all(|w| w[0].end == w[1].start));
            assert!(r.iter().all(|l| !l.is_empty()));
        }
    }

    #[test]
    fn more_stages_than_layers_is_refused() {
        let err = PipelinePlan::new(&[1; 3], 0, 0, 4).unwrap_err().to_string();
        assert!(err.contains("--pp 4: the model has 3 layers"), "{err}");
    }
}
