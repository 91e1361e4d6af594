//! Token sampling: greedy, temperature, top-k, top-p, min-p, logit bias and
//! the repetition, frequency and presence penalties, seeded so a request
//! with a seed is reproducible on every backend.
//!
//! The order follows llama.cpp's default chain: logit bias, penalties,
//! top-k, top-p, min-p, then temperature, then a draw from what is left.
//! A constraint's mask of allowed tokens comes before all of them: the
//! other tokens get -inf and are never candidates.
//! The repetition penalty looks at the last `repeat_last_n` tokens, prompt
//! included (llama.cpp); the frequency and presence penalties count the
//! generated tokens only, as OpenAI defines them and vLLM applies them.

use super::constraint::TokenMask;
use crate::{Error, Result};

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p`; 1 disables.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 disables.
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of recently seen tokens; 1 disables.
    pub repeat_penalty: f32,
    /// How many recent tokens the repetition penalty looks at.
    pub repeat_last_n: usize,
    /// Subtracted from a token's logit once per time it was generated (OpenAI's `frequency_penalty`).
    pub frequency_penalty: f32,
    /// Subtracted once from the logit of every token generated so far (OpenAI's `presence_penalty`).
    pub presence_penalty: f32,
    /// `(token, bias)` added to the logits before anything else (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Plain argmax of the raw logits (which a backend can compute on the device).
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 && !self.shapes_logits()
    }

    /// Whether anything changes the logits before the choice.
    fn shapes_logits(&self) -> bool {
        self.repeat_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
            || !self.logit_bias.is_empty()
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::InvalidRequest(m.to_string()));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature must be a finite number >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p must be in [0, 1]");
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            return bad("repeat_penalty must be a finite number > 0");
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad("frequency_penalty must be in [-2, 2]");
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad("presence_penalty must be in [-2, 2]");
        }
        if let Some((token, bias)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(Error::InvalidRequest(format!(
                "logit_bias for token {token} is {bias}: biases must be in [-100, 100]"
            )));
        }
        Ok(())
    }
}

/// xoshiro256** seeded through splitmix64: small, fast, identical everywhere.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Self {
            s: [next(), next(), next(), next()],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// One sequence's sampler: its parameters and its random stream.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// Tokens of the history that are the prompt (not counted by the
    /// frequency and presence penalties).
    prompt_len: usize,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = Rng::new(params.seed);
        Self {
            params,
            rng,
            prompt_len: 0,
        }
    }

    /// The histories this sampler sees start with a prompt of `n` tokens.
    pub fn with_prompt_len(mut self, n: usize) -> Self {
        self.prompt_len = n;
        self
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Draws the next token from `logits` (modified in place) given the
    /// tokens so far, prompt included.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        self.sample_allowed(logits, history, None)
    }

    /// [`Sampler::sample`] among the tokens of `allowed` only.
    pub fn sample_allowed(
        &mut self,
        logits: &mut [f32],
        history: &[u32],
        allowed: Option<&TokenMask>,
    ) -> u32 {
        let dist = self.distribution_allowed(logits, history, allowed);
        self.draw(&dist)
    }

    /// The distribution this sampler draws from after penalties, truncation
    /// and temperature: `(token, probability)`, most likely first, summing
    /// to 1. Greedy parameters give the argmax with probability 1.
    /// Speculative decoding compares these distributions to accept drafts.
    pub fn distribution(&self, logits: &mut [f32], history: &[u32]) -> Vec<(u32, f64)> {
        self.distribution_allowed(logits, history, None)
    }

    /// [`Sampler::distribution`] among the tokens of `allowed` only (the
    /// others are set to -inf before anything else).
    pub fn distribution_allowed(
        &self,
        logits: &mut [f32],
        history: &[u32],
        allowed: Option<&TokenMask>,
    ) -> Vec<(u32, f64)> {
        if let Some(mask) = allowed {
            mask.restrict(logits);
        }
        let p = &self.params;
        for &(token, bias) in &p.logit_bias {
            if let Some(l) = logits.get_mut(token as usize) {
                *l += bias;
            }
        }
        if p.repeat_penalty != 1.0 {
            apply_repeat_penalty(logits, history, p.repeat_penalty, p.repeat_last_n);
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            let generated = history.get(self.prompt_len..).unwrap_or_default();
            apply_occurrence_penalties(logits, generated, p.frequency_penalty, p.presence_penalty);
        }
        if p.temperature <= 0.0 {
            return vec![(argmax(logits), 1.0)];
        }
        let mut cands = candidates(logits, p.top_k);
        keep_top_p(&mut cands, p.top_p);
        keep_min_p(&mut cands, p.min_p);
        let probs = softmax(&cands, p.temperature);
        cands.iter().map(|c| c.0).zip(probs).collect()
    }

    /// Draws one token from `dist` (as returned by [`Sampler::distribution`]).
    pub fn draw(&mut self, dist: &[(u32, f64)]) -> u32 {
        if self.params.temperature <= 0.0 {
            return dist.first().map_or(0, |c| c.0);
        }
        let r = self.rng.next_f64();
        let mut acc = 0.0;
        for &(id, pr) in dist {
            acc += pr;
            if r < acc {
                return id;
            }
        }
        dist.last().map_or(0, |c| c.0)
    }

    /// A uniform draw in `[0, 1)` from this sampler's stream (the acceptance
    /// test of speculative sampling).
    pub fn uniform(&mut self) -> f64 {
        self.rng.next_f64()
    }
}

pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn apply_repeat_penalty(logits: &mut [f32], history: &[u32], penalty: f32, last_n: usize) {
    let recent = &history[history.len().saturating_sub(last_n)..];
    let mut seen = std::collections::HashSet::with_capacity(recent.len());
    for &t in recent {
        if let Some(l) = logits.get_mut(t as usize) {
            if seen.insert(t) {
                *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
            }
        }
    }
}

/// OpenAI's penalties: `logit -= count * frequency + (count > 0) * presence`.
fn apply_occurrence_penalties(
    logits: &mut [f32],
    generated: &[u32],
    frequency: f32,
    presence: f32,
) {
    let mut counts = std::collections::HashMap::<u32, u32>::new();
    for &t in generated {
        *counts.entry(t).or_default() += 1;
    }
    for (t, count) in counts {
        if let Some(l) = logits.get_mut(t as usize) {
            *l -= count as f32 * frequency + presence;
        }
    }
}

/// `(token, logit)` sorted by logit descending, at most `top_k` of them;
/// masked (-inf) and NaN logits are never candidates.
fn candidates(logits: &[f32], top_k: usize) -> Vec<(u32, f32)> {
    let mut c: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, &l)| l > f32::NEG_INFINITY)
        .map(|(i, &l)| (i as u32, l))
        .collect();
    let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if top_k > 0 && top_k < c.len() {
        c.select_nth_unstable_by(top_k - 1, by_logit);
        c.truncate(top_k);
    }
    c.sort_unstable_by(by_logit);
    c
}

fn softmax(cands: &[(u32, f32)], temperature: f32) -> Vec<f64> {
    let max = cands.first().map_or(0.0, |c| c.1) as f64;
    let t = temperature.max(1e-6) as f64;
    let e: Vec<f64> = cands
        .iter()
        .map(|c| ((c.1 as f64 - max) / t).exp())
        .collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|x| x / sum).collect()
}

fn keep_top_p(cands: &mut Vec<(u32, f32)>, top_p: f32) {
    if top_p >= 1.0 {
        return;
    }
    let probs = softmax(cands, 1.0);
    let mut acc = 0.0;
    let keep = probs
        .iter()
        .position(|p| {
            acc += p;
            acc >= top_p as f64
        })
        .map_or(cands.len(), |i| i + 1);
    cands.truncate(keep.max(1));
}

fn keep_min_p(cands: &mut Vec<(u32, f32)>, min_p: f32) {
    if min_p <= 0.0 || cands.is_empty() {
        return;
    }
    // p_i / p_max = exp(l_i - l_max)
    let threshold = cands[0].1 + min_p.ln();
    cands.retain(|c| c.1 >= threshold);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            seed: 7,
            ..Default::default()
        }
    }

    #[test]
    fn greedy_takes_lowest_index_of_ties() {
        let mut s = Sampler::new(params(0.0));
        assert_eq!(s.sample(&mut [1.0, 3.0, 3.0, -1.0], &[]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let mut s = Sampler::new(SamplingParams {
            top_k: 1,
            ..params(5.0)
        });
        for _ in 0..50 {
            assert_eq!(s.sample(&mut [0.5, 0.1, 0.7, 0.69], &[]), 2);
        }
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 7919) % 101) as f32 / 20.0).collect();
        let run = || {
            let mut s = Sampler::new(params(1.0));
            (0..20)
                .map(|_| s.sample(&mut logits.clone(), &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn frequencies_follow_softmax() {
        let logits = [0.0f32, 1.0, 2.0];
        let mut s = Sampler::new(params(1.0));
        let mut counts = [0usize; 3];
        let n = 30000;
        for _ in 0..n {
            counts[s.sample(&mut logits.clone(), &[]) as usize] += 1;
        }
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        for (i, &c) in counts.iter().enumerate() {
            let p = (logits[i] as f64).exp() / z;
            let sd = (p * (1.0 - p) / n as f64).sqrt();
            assert!(
                ((c as f64 / n as f64) - p).abs() < 5.0 * sd,
                "token {i}: {c}"
            );
        }
    }

    #[test]
    fn min_p_and_top_p_cut_the_tail() {
        let mut logits = vec![10.0f32, 9.0, 0.0, -5.0];
        let mut s = Sampler::new(SamplingParams {
            min_p: 0.1,
            ..params(1.0)
        });
        for _ in 0..200 {
            assert!(s.sample(&mut logits, &[]) < 2);
        }
        let mut s = Sampler::new(SamplingParams {
            top_p: 0.5,
            ..params(1.0)
        });
        for _ in 0..200 {
            assert_eq!(s.sample(&mut logits, &[]), 0);
        }
    }

    #[test]
    fn repeat_penalty_discourages_seen_tokens() {
        let mut s = Sampler::new(SamplingParams {
            repeat_penalty: 2.0,
            ..params(0.0)
        });
        assert_eq!(s.sample(&mut [2.0, 1.5, -1.0], &[0]), 1);
    }

    fn softmax_of(logits: &[f64]) -> Vec<f64> {
        let z: f64 = logits.iter().map(|l| l.exp()).sum();
        logits.iter().map(|l| l.exp() / z).collect()
    }

    #[test]
    fn frequency_and_presence_penalties_count_generated_tokens_only() {
        let s = Sampler::new(SamplingParams {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..params(1.0)
        })
        .with_prompt_len(2);
        // Prompt [3, 1], then 1 generated twice and 2 once.
        let history = [3, 1, 1, 2, 1];
        let dist = s.distribution(&mut [1.0, 2.0, 3.0, 0.5], &history);
        let expected = softmax_of(&[1.0, 2.0 - 2.0 * 0.5 - 0.25, 3.0 - 0.5 - 0.25, 0.5]);
        assert_eq!(dist.len(), 4);
        for (token, p) in dist {
            assert!(
                (p - expected[token as usize]).abs() < 1e-6,
                "token {token}: {p}"
            );
        }
        // A negative penalty encourages repetition.
        let s = Sampler::new(SamplingParams {
            presence_penalty: -2.0,
            ..params(0.0)
        });
        assert!(!s.params().is_greedy());
        assert_eq!(s.distribution(&mut [1.0, 0.0], &[1]), vec![(1, 1.0)]);
    }

    #[test]
    fn logit_bias_is_added_before_the_choice() {
        let s = Sampler::new(SamplingParams {
            logit_bias: vec![(2, 5.0), (0, -100.0), (99, 1.0)],
            ..params(1.0)
        });
        let dist = s.distribution(&mut [10.0, 1.0, 0.0], &[]);
        let expected = softmax_of(&[10.0 - 100.0, 1.0, 5.0]);
        for (token, p) in dist {
            assert!(
                (p - expected[token as usize]).abs() < 1e-9,
                "token {token}: {p}"
            );
        }
        let mut greedy = Sampler::new(SamplingParams {
            logit_bias: vec![(0, -100.0)],
            ..params(0.0)
        });
        assert!(
            !greedy.params().is_greedy(),
            "the device argmax would ignore the bias"
        );
        assert_eq!(greedy.sample(&mut [10.0, 1.0, 0.0], &[]), 1);
    }

    #[test]
    fn the_mask_comes_before_everything_else() {
        let mut allowed = TokenMask::none(4);
        allowed.allow(1);
        allowed.allow(3);
        // The bias would make token 0 the argmax; the mask forbids it.
        let mut greedy = Sampler::new(SamplingParams {
            logit_bias: vec![(0, 50.0)],
            ..params(0.0)
        });
        let logits = [5.0f32, 1.0, 9.0, 2.0];
        assert_eq!(
            greedy.sample_allowed(&mut logits.clone(), &[], Some(&allowed)),
            3
        );
        let s = Sampler::new(params(1.0));
        let dist = s.distribution_allowed(&mut logits.clone(), &[], Some(&allowed));
        let expected = softmax_of(&[2.0, 1.0]);
        assert_eq!(dist.iter().map(|d| d.0).collect::<Vec<_>>(), vec![3, 1]);
        assert!((dist[0].1 - expected[0]).abs() < 1e-12);
        let mut s = Sampler::new(params(2.0));
        for _ in 0..500 {
            assert!(allowed.allows(s.sample_allowed(&mut logits.clone(), &[], Some(&allowed))));
        }
    }

    #[test]
    fn bad_params_are_rejected() {
        for p in [
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                min_p: 2.0,
                ..Default::default()
            },
            SamplingParams {
                repeat_penalty: 0.0,
                ..Default::default()
            },
            SamplingParams {
                frequency_penalty: 2.5,
                ..Default::default()
            },
            SamplingParams {
                presence_penalty: f32::NAN,
                ..Default::default()
            },
            SamplingParams {
                logit_bias: vec![(3, 101.0)],
                ..Default::default()
            },
        ] {
            assert!(p.validate().is_err());
        }
    }
}
