//! Self-speculation: the target's own layers as its draft. `self:LAYERS`
//! names the layers; `self:auto` tries the candidate subsets that skip a
//! block of middle layers, measures each one's agreement with the target
//! and what verifying extra rows costs here, and keeps the subset with the
//! best estimated speedup.

use super::adaptive;
use super::draft::{DraftModel, DraftModelConfig};
use crate::model::ModelFiles;
use crate::{Backend, Error, Result};

/// Parses a layer list such as `0-9,28,29` (for `--speculate self:LAYERS`).
pub fn parse_layers(spec: &str, num_layers: usize) -> Result<Vec<usize>> {
    let bad = |why: String| Error::InvalidRequest(format!("layer list `{spec}`: {why}"));
    let mut layers = Vec::new();
    for part in spec.split(',').map(str::trim) {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let parse = |s: &str| {
            s.parse::<usize>()
                .map_err(|_| bad(format!("`{s}` is not a layer number")))
        };
        let (lo, hi) = (parse(lo)?, parse(hi)?);
        if lo > hi {
            return Err(bad(format!("range {lo}-{hi} is reversed")));
        }
        if hi >= num_layers {
            return Err(bad(format!("the model has layers 0-{}", num_layers - 1)));
        }
        layers.extend(lo..=hi);
    }
    if layers.windows(2).any(|w| w[0] >= w[1]) {
        return Err(bad("layers must be increasing and distinct".into()));
    }
    if layers.len() == num_layers {
        return Err(bad("a draft with every layer is the model itself".into()));
    }
    Ok(layers)
}

/// Candidate self-drafts for `self:auto`: the model without a block of
/// middle layers (a quarter, a third, half of them), or without every other
/// layer of its middle half. Early layers build the representation and the
/// last ones map it to the head's space, so drafts that skip the middle
/// agree with the full model far more often than early exits do.
pub fn self_draft_candidates(num_layers: usize) -> Vec<Vec<usize>> {
    let l = num_layers;
    let mut out: Vec<Vec<usize>> = [4, 3, 2]
        .iter()
        .map(|&div| {
            let skip = l / div;
            let from = (l - skip) / 2;
            (0..l)
                .filter(|&i| i < from || i >= from + skip)
                .collect::<Vec<_>>()
        })
        .collect();
    out.push(
        (0..l)
            .filter(|&i| i < l / 4 || i >= 3 * l / 4 || i % 2 == 0)
            .collect(),
    );
    out.retain(|c| !c.is_empty() && c.len() < l);
    out.dedup();
    out
}

/// Estimated speedup of greedy self-speculation with a draft that agrees
/// with the target on a fraction `agreement` of teacher-forced positions
/// and costs `cost` of a target decode per token, at the best fixed k,
/// assuming verification of k+1 rows costs `1 + verify_row_cost * k`.
pub fn estimated_speedup(
    agreement: f64,
    cost: f64,
    verify_row_cost: f64,
    max_k: usize,
) -> (usize, f64) {
    (1..=max_k)
        .map(|k| {
            let time = cost * k as f64 + 1.0 + verify_row_cost * k as f64;
            (k, adaptive::expected_tokens(agreement, k) / time)
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or((0, 1.0))
}

/// What `self:auto` measured for one candidate layer set.
#[derive(Clone, Debug)]
pub struct SelfDraftCandidate {
    pub layers: Vec<usize>,
    /// Fraction of positions where the draft's argmax equals the target's.
    pub agreement: f64,
    /// Draft weight bytes per token over the target's.
    pub cost: f64,
    /// Estimated greedy speedup at the best fixed k.
    pub speedup: f64,
    pub k: usize,
}

/// `self:auto`: loads each candidate layer subset of the target
/// ([`self_draft_candidates`]), measures how often its greedy
/// prediction agrees with the target's over `sample` (teacher forced, one
/// pass each) and how much verifying extra rows costs on this backend, and
/// returns the draft with the best estimated speedup and what was measured.
pub fn choose_self_draft<B: Backend>(
    engine: &mut crate::engine::Engine<B>,
    files: &ModelFiles,
    sample: &[u32],
    config: DraftModelConfig,
    max_k: usize,
) -> Result<(DraftModel<B>, Vec<SelfDraftCandidate>)> {
    if sample.len() < 2 {
        return Err(Error::InvalidRequest(
            "self:auto needs a sample text of at least two tokens".into(),
        ));
    }
    let vocab = engine.model().config.vocab_size;
    let target: Vec<u32> = engine
        .score(sample, 0)?
        .chunks(vocab)
        .map(crate::sched::sampling::argmax)
        .collect();
    let row_cost = verify_row_cost(engine, sample, max_k)?;
    let target_bytes = engine.model().weight_bytes.max(1) as f64;
    let mut best: Option<(DraftModel<B>, f64)> = None;
    let mut report = Vec::new();
    for layers in self_draft_candidates(files.config.num_layers) {
        let mut draft = DraftModel::load(engine.backend(), files, Some(&layers), config.clone())?;
        let predicted = draft.greedy_predictions(engine.backend(), sample)?;
        let agreement = predicted
            .iter()
            .zip(&target)
            .filter(|(a, b)| a == b)
            .count() as f64
            / target.len() as f64;
        let cost = draft.model().weight_bytes as f64 / target_bytes;
        let (k, speedup) = estimated_speedup(agreement, cost, row_cost, max_k);
        report.push(SelfDraftCandidate {
            layers,
            agreement,
            cost,
            speedup,
            k,
        });
        if best.as_ref().is_none_or(|b| speedup > b.1) {
            best = Some((draft, speedup));
        }
    }
    let (draft, _) = best.ok_or_else(|| {
        Error::InvalidRequest(format!(
            "a model of {} layers has no smaller self-draft",
            files.config.num_layers
        ))
    })?;
    Ok((draft, report))
}

/// The cost of each extra verified row relative to a one-row step: times
/// one forward pass of 1 and of `k + 1` rows (best of three each).
fn verify_row_cost<B: Backend>(
    engine: &mut crate::engine::Engine<B>,
    sample: &[u32],
    k: usize,
) -> Result<f64> {
    let k = k.clamp(1, sample.len() - 1);
    let mut time = |n: usize| -> Result<f64> {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let clock = super::Stopwatch::start();
            engine.score(&sample[..n], n - 1)?;
            best = best.min(clock.seconds());
        }
        Ok(best)
    };
    let one = time(1)?;
    let many = time(k + 1)?;
    if one <= 0.0 {
        return Ok(0.0);
    }
    Ok(((many - one) / (k as f64 * one)).max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_lists_parse_and_refuse_nonsense() {
        assert_eq!(parse_layers("0-3,7", 8).unwrap(), vec![0, 1, 2, 3, 7]);
        for bad in ["", "3-1", "0-8", "a", "1,1", "0-7", "2,1"] {
            let e = parse_layers(bad, 8).unwrap_err().to_string();
            assert!(e.contains("layer list"), "{bad}: {e}");
        }
    }

    #[test]
    fn self_draft_candidates_keep_the_first_and_last_layers() {
        let c = self_draft_candidates(30);
        assert_eq!(c.len(), 4);
        for l in &c {
            assert_eq!((l[0], *l.last().unwrap()), (0, 29));
            assert!(l.len() < 30 && l.len() >= 15);
            assert!(l.windows(2).all(|w| w[0] < w[1]));
        }
        assert!(self_draft_candidates(1).is_empty());
    }

    #[test]
    fn speedup_estimate_prefers_long_drafts_when_cheap_and_accurate() {
        let (k, s) = estimated_speedup(0.9, 0.05, 0.05, 8);
        assert!(k >= 4 && s > 2.0);
        let (_, s) = estimated_speedup(0.1, 0.5, 0.5, 8);
        assert!(s < 1.0);
    }
}
