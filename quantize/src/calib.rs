//! Calibration: runs the f32 model over text and records, for the input of
//! every linear layer (per layer and [`Site`]), what the methods need: the
//! Hessian `XᵀX` (GPTQ, AWQ's loss), the per-channel mean and max of `|x|`
//! (AWQ, SmoothQuant) and a few sample rows (SmoothQuant's alpha search).

use std::collections::HashMap;
use std::path::Path;

use tandem_core::tokenizer::Tokenizer;

use crate::dense::{DenseModel, Site};
use crate::{invalid, Result};

/// The fewest tokens a calibration text may have.
pub const MIN_TOKENS: usize = 16;

/// Statistics of one site's input over the calibration tokens.
#[derive(Clone, Debug)]
pub struct SiteStats {
    pub width: usize,
    /// `Σ xᵀx` over all calibration rows, `width × width`.
    pub hessian: Vec<f32>,
    pub mean_abs: Vec<f32>,
    pub max_abs: Vec<f32>,
    /// Rows kept verbatim, `[sample_rows, width]`.
    pub samples: Vec<f32>,
    /// Rows seen.
    pub rows: usize,
}

impl SiteStats {
    fn new(width: usize) -> Self {
        SiteStats {
            width,
            hessian: vec![0.0; width * width],
            mean_abs: vec![0.0; width],
            max_abs: vec![0.0; width],
            samples: Vec::new(),
            rows: 0,
        }
    }

    pub fn sample_rows(&self) -> usize {
        self.samples.len() / self.width
    }
}

/// Calibration statistics of a whole model.
pub struct Calibration {
    /// Per layer, per site.
    pub layers: Vec<HashMap<Site, SiteStats>>,
    pub tokens: usize,
}

impl Calibration {
    pub fn site(&self, layer: usize, site: Site) -> &SiteStats {
        &self.layers[layer][&site]
    }
}

/// Reads the calibration text and cuts its first `max_tokens` tokens into
/// windows of `window` (each starting with BOS when the model has one, as
/// `perplexity` does); a shorter tail of at least [`MIN_TOKENS`] is kept.
pub fn windows(
    tokenizer: &Tokenizer,
    path: &Path,
    max_tokens: usize,
    window: usize,
) -> Result<Vec<Vec<u32>>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| crate::Error::Invalid(format!("calibration file {}: {e}", path.display())))?;
    if text.trim().is_empty() {
        return invalid(format!("calibration file {} is empty", path.display()));
    }
    if max_tokens < MIN_TOKENS || window < MIN_TOKENS {
        return invalid(format!(
            "calibration needs at least {MIN_TOKENS} tokens (asked for {max_tokens} in windows of {window})"
        ));
    }
    let mut tokens = tokenizer.encode(&text, true)?;
    if tokens.len() < MIN_TOKENS {
        return invalid(format!(
            "calibration file {} has {} tokens, fewer than {MIN_TOKENS}",
            path.display(),
            tokens.len()
        ));
    }
    tokens.truncate(max_tokens);
    let bos = tokenizer.bos_token().filter(|b| tokens.first() == Some(b));
    Ok(tokens
        .chunks(window)
        .filter(|w| w.len() >= MIN_TOKENS)
        .map(|w| {
            let mut w = w.to_vec();
            if let Some(b) = bos {
                w[0] = b;
            }
            w
        })
        .collect())
}

/// Runs `model` over `windows`, keeping about `samples` rows per site.
pub fn collect(model: &DenseModel, windows: &[Vec<u32>], samples: usize) -> Result<Calibration> {
    let mut inputs = LayerInputs::new(model, windows)?;
    let mut layers = Vec::with_capacity(model.config.num_layers);
    for _ in 0..model.config.num_layers {
        let mut stats = site_stats(model);
        inputs.run(model, Some((&mut stats, samples)))?;
        layers.push(stats);
    }
    Ok(Calibration {
        layers,
        tokens: inputs.tokens(),
    })
}

/// The residual stream of every calibration window at the input of one
/// layer. Stepping it with the model's current weights lets a method
/// calibrate each layer on the output of the layers it has already
/// quantized (GPTQ's sequential mode), so each layer compensates for the
/// error that reaches it rather than for an error-free float input.
pub struct LayerInputs {
    /// Per window, `[len, hidden]`.
    streams: Vec<Vec<f32>>,
    lens: Vec<usize>,
    next_layer: usize,
}

impl LayerInputs {
    /// The embeddings of `windows`: the input of layer 0.
    pub fn new(model: &DenseModel, windows: &[Vec<u32>]) -> Result<Self> {
        Ok(LayerInputs {
            streams: windows
                .iter()
                .map(|w| model.embed(w))
                .collect::<Result<_>>()?,
            lens: windows.iter().map(Vec::len).collect(),
            next_layer: 0,
        })
    }

    /// The layer whose input this is.
    pub fn layer(&self) -> usize {
        self.next_layer
    }

    pub fn tokens(&self) -> usize {
        self.lens.iter().sum()
    }

    /// Statistics of [`layer`](Self::layer)'s sites under `model`'s current
    /// weights (keeping about `samples` rows per site), without stepping.
    pub fn stats(&self, model: &DenseModel, samples: usize) -> Result<HashMap<Site, SiteStats>> {
        let mut stats = site_stats(model);
        let mut copy = LayerInputs {
            streams: self.streams.clone(),
            lens: self.lens.clone(),
            next_layer: self.next_layer,
        };
        copy.run(model, Some((&mut stats, samples)))?;
        Ok(stats)
    }

    /// Runs [`layer`](Self::layer) with `model`'s current weights.
    pub fn advance(&mut self, model: &DenseModel) -> Result<()> {
        self.run(model, None)
    }

    fn run(
        &mut self,
        model: &DenseModel,
        mut observe: Option<(&mut HashMap<Site, SiteStats>, usize)>,
    ) -> Result<()> {
        let total = self.tokens();
        let cpu = model.cpu();
        let mut seen = 0;
        for (h, &n) in self.streams.iter_mut().zip(&self.lens) {
            let mut failure = None;
            model.layer(self.next_layer, h, n, &mut |site, x| {
                if let Some((stats, samples)) = observe.as_mut() {
                    let s = stats.get_mut(&site).expect("every site has stats");
                    let stride = (total / (*samples).max(1)).max(1);
                    if let Err(e) = accumulate(cpu, s, x, n, seen, stride) {
                        failure = Some(e);
                    }
                }
            })?;
            if let Some(e) = failure {
                return Err(e);
            }
            seen += n;
        }
        if let Some((stats, _)) = observe {
            for s in stats.values_mut() {
                s.mean_abs.iter_mut().for_each(|m| *m /= total as f32);
            }
        }
        self.next_layer += 1;
        Ok(())
    }
}

/// Empty statistics for every site of one of `model`'s layers.
fn site_stats(model: &DenseModel) -> HashMap<Site, SiteStats> {
    let c = &model.config;
    Site::ALL
        .iter()
        .map(|&site| {
            let width = match site {
                Site::AttnIn | Site::FfnIn => c.hidden_size,
                Site::AttnOut => c.q_dim(),
                Site::FfnAct => c.intermediate_size,
            };
            (site, SiteStats::new(width))
        })
        .collect()
}

fn accumulate(
    cpu: &crate::linalg::Cpu,
    s: &mut SiteStats,
    x: &[f32],
    n: usize,
    first_row: usize,
    stride: usize,
) -> Result<()> {
    let w = s.width;
    let mut xt = vec![0.0; w * n];
    for (t, row) in x.chunks_exact(w).enumerate() {
        for (c, &v) in row.iter().enumerate() {
            xt[c * n + t] = v;
            s.mean_abs[c] += v.abs();
            s.max_abs[c] = s.max_abs[c].max(v.abs());
        }
        if (first_row + t).is_multiple_of(stride) {
            s.samples.extend_from_slice(row);
        }
    }
    // (Xᵀ)(Xᵀ)ᵀ = XᵀX.
    let h = cpu.xwt_once(&xt, w, &xt, w, n)?;
    s.hessian.iter_mut().zip(&h).for_each(|(a, b)| *a += b);
    s.rows += n;
    Ok(())
}
