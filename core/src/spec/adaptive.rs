//! Choosing the draft length k from measurements.
//!
//! With a per-token acceptance rate `a`, a step with k drafts emits
//! `E(k) = (1 - a^(k+1)) / (1 - a)` tokens on average. Its cost is the
//! drafting time (`k` times the measured draft cost per token) plus this
//! sequence's share of the verification step. The step time is modelled as
//! `fixed + per_row * rows`, fitted online by exponentially weighted least
//! squares over the steps seen, so a device where extra rows are nearly
//! free (a GPU at small batch) speculates long, and one where every row
//! costs as much as a decode (a busy CPU, a large batch) stops speculating.
//! k maximises `E(k) / cost(k)`; k = 0 (plain decoding) is always a
//! candidate, so speculation switches itself off where it does not pay.
//! A sequence that stopped speculating probes with one draft now and then
//! so a change in acceptance is noticed; probes that fail come ever more
//! rarely, so a hopeless draft costs next to nothing, and a draft too slow
//! to pay even if it were always right is not probed at all. A sequence
//! that keeps speculating takes one plain step now and then: the fit then
//! sees one-row steps at today's context, not only those measured up
//! front, so a context that has grown dearer per row (attention) is noticed.

/// Weight of the newest observation in the running averages.
const DECAY: f64 = 0.1;
/// Acceptance assumed before a sequence has been measured; it weighs as
/// much as one observed draft token.
const PRIOR_ACCEPTANCE: f64 = 0.6;
/// Steps between probes of a sequence that stopped speculating, at first;
/// each failed probe doubles it, up to the maximum.
const PROBE_EVERY: u32 = 32;
/// Probing only happens when perfect acceptance would beat plain decoding
/// by this factor: a marginal draft is not worth its probes.
const PROBE_MIN_GAIN: f64 = 1.25;
const MAX_PROBE_EVERY: u32 = 256;
/// Speculating steps of a sequence between its plain steps (see above).
const REFRESH_EVERY: u32 = 24;

/// How the draft length is set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftLength {
    /// Always propose this many tokens.
    Fixed(usize),
    /// Choose per sequence and step, at most this many.
    Adaptive { max: usize },
}

/// Exponentially weighted least squares of step time on rows.
#[derive(Clone, Debug, Default)]
struct StepTimeModel {
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
    /// The latest fit with enough spread: plain decoding alone (always one
    /// row per sequence) cannot refit the slope, so it keeps the last one.
    last: Option<(f64, f64)>,
}

impl StepTimeModel {
    fn observe(&mut self, rows: f64, secs: f64) {
        let keep = 1.0 - DECAY;
        self.w = self.w * keep + 1.0;
        self.x = self.x * keep + rows;
        self.y = self.y * keep + secs;
        self.xx = self.xx * keep + rows * rows;
        self.xy = self.xy * keep + rows * secs;
        let (mx, my) = (self.x / self.w, self.y / self.w);
        let var = self.xx / self.w - mx * mx;
        if var >= 1e-3 * (1.0 + mx * mx) {
            let per_row = ((self.xy / self.w - mx * my) / var).max(0.0);
            self.last = Some(((my - per_row * mx).max(0.0), per_row));
        }
    }

    /// `(fixed, per_row)`, or `None` until two different row counts were seen.
    fn fit(&self) -> Option<(f64, f64)> {
        self.last
    }
}

/// Per-sequence acceptance, shared cost measurements, and the choice of k.
#[derive(Clone, Debug)]
pub struct DraftLengthController {
    length: DraftLength,
    step_time: StepTimeModel,
    /// Seconds of drafting per proposed token.
    draft_cost: Option<f64>,
}

/// What the controller keeps per sequence.
#[derive(Clone, Debug)]
pub struct SequenceAcceptance {
    /// Running acceptance rate per draft token.
    rate: f64,
    /// Draft tokens observed (the prior counts as one): early observations
    /// are averaged, later ones weighted by `DECAY`.
    trials: f64,
    /// Steps since this sequence last speculated.
    idle: u32,
    probe_every: u32,
    /// Whether the last speculation was a probe.
    probing: bool,
    /// Speculating steps since the last plain one.
    streak: u32,
}

impl Default for SequenceAcceptance {
    fn default() -> Self {
        Self {
            rate: PRIOR_ACCEPTANCE,
            trials: 1.0,
            idle: 0,
            probe_every: PROBE_EVERY,
            probing: false,
            streak: 0,
        }
    }
}

impl SequenceAcceptance {
    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// Records a verification: `accepted` of `proposed` drafts kept.
    /// Acceptance is per token up to the first rejection, so a step counts
    /// `accepted` successes and one failure unless all were kept.
    pub fn observe(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        let trials = (accepted + usize::from(accepted < proposed)) as f64;
        let sample = accepted as f64 / trials;
        let ema = 1.0 - (1.0 - DECAY).powf(trials);
        let weight = (trials / (self.trials + trials)).max(ema);
        self.trials += trials;
        self.rate += weight * (sample - self.rate);
        if self.probing {
            self.probing = false;
            self.probe_every = if accepted == 0 {
                (self.probe_every * 2).min(MAX_PROBE_EVERY)
            } else {
                PROBE_EVERY
            };
        }
    }
}

/// Expected tokens emitted by a step with `k` drafts at acceptance `a`.
pub fn expected_tokens(a: f64, k: usize) -> f64 {
    if a >= 1.0 - 1e-9 {
        return (k + 1) as f64;
    }
    (1.0 - a.powi(k as i32 + 1)) / (1.0 - a)
}

impl DraftLengthController {
    pub fn new(length: DraftLength) -> Self {
        Self {
            length,
            step_time: StepTimeModel::default(),
            draft_cost: None,
        }
    }

    pub fn length(&self) -> DraftLength {
        self.length
    }

    /// Records a verification step of `rows` rows over `seqs` sequences.
    pub fn observe_step(&mut self, rows: usize, secs: f64) {
        self.step_time.observe(rows as f64, secs);
    }

    /// Records drafting `tokens` tokens in `secs`.
    pub fn observe_drafting(&mut self, tokens: usize, secs: f64) {
        if tokens == 0 {
            return;
        }
        let per = secs / tokens as f64;
        self.draft_cost = Some(match self.draft_cost {
            Some(c) => c + DECAY * (per - c),
            None => per,
        });
    }

    /// The draft length for a sequence in a step of `seqs` decoding
    /// sequences, at most `limit` (tokens left before a length limit).
    pub fn choose(&self, acc: &mut SequenceAcceptance, seqs: usize, limit: usize) -> usize {
        let k = match self.length {
            DraftLength::Fixed(k) => k,
            DraftLength::Adaptive { max } => {
                let best = self.best_k(acc.rate, seqs.max(1), max);
                if best == 0 && self.best_gain(1.0, seqs.max(1), max) < PROBE_MIN_GAIN {
                    // Not even perfect acceptance would pay: no probing.
                    acc.idle = 0;
                    0
                } else if best == 0 {
                    acc.idle += 1;
                    if acc.idle >= acc.probe_every {
                        acc.idle = 0;
                        acc.probing = true;
                        1
                    } else {
                        0
                    }
                } else {
                    acc.idle = 0;
                    acc.streak += 1;
                    if acc.streak >= REFRESH_EVERY {
                        acc.streak = 0;
                        0
                    } else {
                        best
                    }
                }
            }
        };
        k.min(limit)
    }

    /// Speedup over plain decoding at the best k for acceptance `a`
    /// (1 when nothing is known yet).
    fn best_gain(&self, a: f64, seqs: usize, max: usize) -> f64 {
        let Some((fixed, per_row)) = self.step_time.fit() else {
            return f64::INFINITY;
        };
        let draft = self.draft_cost.unwrap_or(0.0);
        let share = fixed / seqs as f64;
        let rate = |k: usize| {
            let cost = share + per_row * (k + 1) as f64 + draft * k as f64;
            expected_tokens(a, k) / cost.max(1e-12)
        };
        let k = self.best_k(a, seqs, max);
        rate(k) / rate(0)
    }

    fn best_k(&self, a: f64, seqs: usize, max: usize) -> usize {
        // Until the step time has been fitted, explore at a moderate length:
        // the steps seen meanwhile give the fit its spread of row counts.
        let Some((fixed, per_row)) = self.step_time.fit() else {
            return max.min(2 + usize::from(self.step_time.w as usize % 2 == 1));
        };
        let draft = self.draft_cost.unwrap_or(0.0);
        let share = fixed / seqs as f64;
        let rate = |k: usize| {
            let cost = share + per_row * (k + 1) as f64 + draft * k as f64;
            expected_tokens(a, k) / cost.max(1e-12)
        };
        (0..=max)
            .max_by(|&x, &y| rate(x).total_cmp(&rate(y)).then(y.cmp(&x)))
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trained(fixed: f64, per_row: f64, draft: f64) -> DraftLengthController {
        let mut c = DraftLengthController::new(DraftLength::Adaptive { max: 8 });
        for rows in [1, 3, 5, 2, 7, 1, 4] {
            c.observe_step(rows, fixed + per_row * rows as f64);
        }
        c.observe_drafting(10, 10.0 * draft);
        c
    }

    #[test]
    fn plain_steps_do_not_erase_the_fitted_slope() {
        let mut c = trained(10e-3, 2e-3, 0.0);
        for _ in 0..200 {
            c.observe_step(1, 12e-3);
        }
        let (fixed, per_row) = c.step_time.fit().unwrap();
        assert!((per_row - 2e-3).abs() < 1e-4 && (fixed - 10e-3).abs() < 1e-4);
    }

    #[test]
    fn expected_tokens_matches_the_geometric_series() {
        assert!((expected_tokens(0.5, 2) - 1.75).abs() < 1e-12);
        assert_eq!(expected_tokens(1.0, 4), 5.0);
        assert_eq!(expected_tokens(0.0, 4), 1.0);
    }

    #[test]
    fn cheap_rows_and_high_acceptance_speculate_long() {
        let c = trained(10e-3, 0.1e-3, 0.0);
        let mut acc = SequenceAcceptance {
            rate: 0.9,
            ..Default::default()
        };
        assert!(c.choose(&mut acc, 1, 100) >= 6);
    }

    #[test]
    fn expensive_rows_or_poor_acceptance_turn_speculation_off() {
        let c = trained(1e-3, 10e-3, 0.0);
        let mut acc = SequenceAcceptance {
            rate: 0.5,
            ..Default::default()
        };
        assert_eq!(c.choose(&mut acc, 1, 100), 0);
        let c = trained(10e-3, 0.1e-3, 2e-3);
        let mut acc = SequenceAcceptance {
            rate: 0.05,
            ..Default::default()
        };
        assert_eq!(c.choose(&mut acc, 1, 100), 0);
    }

    #[test]
    fn an_idle_sequence_probes_ever_more_rarely_while_probes_fail() {
        let c = trained(10e-3, 2e-3, 0.0);
        let mut acc = SequenceAcceptance {
            rate: 0.1,
            ..Default::default()
        };
        let mut probes = Vec::new();
        for step in 0..(16 + 32 + 64) {
            if c.choose(&mut acc, 1, 100) == 1 {
                probes.push(step);
                acc.observe(1, 0);
            }
        }
        assert_eq!(probes, vec![31, 95]);
    }

    #[test]
    fn a_draft_too_slow_to_ever_pay_is_never_probed() {
        // Each draft token costs as much as a whole decode step.
        let c = trained(1e-3, 0.5e-3, 1.5e-3);
        let mut acc = SequenceAcceptance::default();
        assert!((0..100).all(|_| c.choose(&mut acc, 1, 100) == 0));
    }

    #[test]
    fn a_poor_draft_is_recognised_within_a_few_steps() {
        let mut acc = SequenceAcceptance::default();
        for _ in 0..4 {
            acc.observe(3, 0);
        }
        assert!(acc.rate() < 0.15, "{}", acc.rate());
    }

    #[test]
    fn acceptance_follows_observations() {
        let mut acc = SequenceAcceptance::default();
        for _ in 0..50 {
            acc.observe(4, 4);
        }
        assert!(acc.rate() > 0.95);
        for _ in 0..50 {
            acc.observe(4, 0);
        }
        assert!(acc.rate() < 0.05);
    }

    /// Measured up front at a short context, where rows are cheap; then
    /// every row costs 40 ms of attention and a draft token 35 ms (a sparse
    /// draft at 14k tokens): drafting stops once plain steps show it.
    /// Where drafting pays it goes on, with one plain step in
    /// `REFRESH_EVERY`.
    #[test]
    fn a_context_that_makes_rows_dear_turns_speculation_off() {
        let run = |per_row: f64, draft: f64| {
            let mut c = trained(12e-3, 4e-3, 0.0);
            c.observe_drafting(1, 12e-3);
            let mut acc = SequenceAcceptance::default();
            let mut ks = Vec::new();
            for _ in 0..200 {
                let k = c.choose(&mut acc, 1, 100);
                c.observe_step(k + 1, 24e-3 + per_row * (k + 1) as f64);
                if k > 0 {
                    c.observe_drafting(k, draft * k as f64);
                    acc.observe(k, k);
                }
                ks.push(k);
            }
            ks
        };
        let dear = run(40e-3, 35e-3);
        assert!(dear[100..].iter().all(|&k| k == 0), "{dear:?}");
        let cheap = run(4e-3, 2e-3);
        let plain = cheap[100..].iter().filter(|&&k| k == 0).count();
        assert!(
            (1..=100 / REFRESH_EVERY as usize + 1).contains(&plain),
            "{cheap:?}"
        );
    }

    #[test]
    fn the_limit_caps_k() {
        let c = DraftLengthController::new(DraftLength::Fixed(5));
        assert_eq!(c.choose(&mut SequenceAcceptance::default(), 1, 2), 2);
    }
}
